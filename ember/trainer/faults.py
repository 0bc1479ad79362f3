"""Faults a long run must survive: a Ctrl-C or SIGTERM becomes a request to stop after the
current step with a checkpoint written, and bad updates (non-finite, or finite but beyond
`trainer.max_loss_or_grad_norm`) keep unsound weights out of checkpoints and, several in a
row, stop the run, naming the last sound checkpoint."""

from __future__ import annotations

import math
import signal
import threading

import torch
import torch.distributed as dist

from ember.distributed.device import current_device, is_distributed
from ember.errors import UserError


class StopRequest:
    """Within the `with` block, SIGINT and SIGTERM set `requested` instead of killing the
    process; a second signal restores the default behaviour (a stuck run can still be killed)."""

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def on_any_rank(self) -> bool:
        """Whether any rank of the process group was asked to stop (one small all-reduce; `requested` in a single
        process). Each rank's signal lands on its own side of a step's end: ranks that decided alone could save
        while another trained on, and their mismatched collectives hang."""
        if not is_distributed():
            return self.requested
        flag = torch.tensor([float(self.requested)], device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class BadStepsError(UserError):
    """Several bad updates in a row stopped the run: `error: <BadStepGuard.stop_message>` and exit status 2, no
    traceback (the weights, data or learning rate are at fault, and the message names the checkpoint to go back to)."""


class BadStepGuard:
    """Watches each step's updates and says whether the weights are fit for a checkpoint.

    A step is bad when the engine skipped an update (a non-finite loss or gradient norm: the
    weights did not change) or when a watched value, a loss or a gradient norm before
    clipping, is finite but above `bound`: that update was applied, and weights that blew up
    without a NaN (1e30 everywhere) are finite garbage a NaN check never sees. From such a
    diverged step the weights are unsound until a later step updates them within the bound
    (garbage weights keep producing huge losses, so a sound update means they recovered). The
    trainer writes no checkpoint from unsound weights, so `last_sound_checkpoint`, the newest
    it wrote or resumed from, is always one to go back to. `should_stop` after `max_in_a_row`
    bad steps in a row.
    """

    BOUND_KEY = "trainer.max_loss_or_grad_norm"

    def __init__(self, bound: float, max_in_a_row: int = 3):
        self.bound = bound
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0
        self.last_bad_step = ""  # "step N: why", for messages
        self.unsound_since = ""  # "step N: why" of the first diverged step while the weights are unsound
        self.last_sound_checkpoint: str | None = None  # set by the trainer when it saves or resumes

    def record(self, step: int, skipped: bool, watched: dict[str, float]) -> None:
        """The outcome of step `step`: whether an update was skipped, and its losses and gradient norms."""
        too_large = {key: value for key, value in watched.items() if math.isfinite(value) and abs(value) > self.bound}
        if too_large:
            shown = ", ".join(f"{key}={value:.3g}" for key, value in too_large.items())
            self.last_bad_step = f"step {step}: {shown} above {self.BOUND_KEY}={self.bound:g}"
            self.unsound_since = self.unsound_since or self.last_bad_step
        elif skipped:
            self.last_bad_step = f"step {step}: a non-finite loss or gradient norm, update skipped"
        else:
            self.unsound_since = ""
        bad = skipped or bool(too_large)
        self.in_a_row = self.in_a_row + 1 if bad else 0
        self.total += int(bad)

    @property
    def should_stop(self) -> bool:
        return self.in_a_row >= self.max_in_a_row

    @property
    def weights_sound(self) -> bool:
        return not self.unsound_since

    def sound_checkpoint_text(self) -> str:
        if self.last_sound_checkpoint is None:
            return "no sound checkpoint has been written yet"
        return f"the last sound checkpoint is {self.last_sound_checkpoint}"

    def stop_message(self) -> str:
        return (f"{self.in_a_row} updates in a row were bad (last at {self.last_bad_step}); "
                f"{self.sound_checkpoint_text()}")

    def unsound_export_message(self, export_dir: str) -> str:
        where = ("; `ember export CHECKPOINT_DIR OUT_DIR` writes it as a Hugging Face model"
                 if self.last_sound_checkpoint is not None else "")
        return (f"final model not exported to {export_dir}: the weights are unsound since {self.unsound_since}; "
                f"{self.sound_checkpoint_text()}{where}")

    def unsound_save_message(self, step: int) -> str:
        return (f"not writing the checkpoint of step {step}: the weights are unsound since {self.unsound_since}; "
                f"{self.sound_checkpoint_text()}")
