"""The roles as the trainer sees them: actor, reference, critic and rollout on a worker group.

Each object here has the methods the RL loop needs and nothing about ranks, engines or
Ray. The one thing to know: a role's ranks report their data layout once (`DataLayout`:
data-parallel size and rank, and whether the rank returns outputs), and every call is
dispatched by it. A batch method splits the batch into one contiguous share per
data-parallel rank (the order `trainer.balance_batch` balanced), gives each rank its
data-parallel rank's share (all ranks of a tensor- or pipeline-parallel replica the same
samples), runs the role's method on every rank at once and joins the shares' results, each
taken from its replica's output rank; an update returns the metrics the engine already
reduced over ranks. The rollout splits prompts the same way by its own layout (each rank a
whole generation engine) and renumbers the samples; each share is seeded from its place in
the whole batch, so the samples do not depend on how many ranks generate them (ember's engine).
`start_update` returns a pending call, so roles in separate pools update at the same time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ember.data.batch import Batch
from ember.distributed.worker_group import LocalWorkerGroup, Pending
from ember.engines.base import DataLayout
from ember.rollout import Injection, RolloutOutput, SamplingParams


class RoleGroup:
    """Role `role` on every rank of `group`, dispatched by the data layout its ranks report."""

    def __init__(self, group, role: str):
        self.group = group
        self.role = role
        self.layouts: list[DataLayout] = self._run_all("data_layout")
        self.output_ranks = output_ranks(self.layouts, f"{group.name}'s {role}")

    @property
    def dp_size(self) -> int:
        return len(self.output_ranks)

    def in_process(self) -> Any:
        """The role object itself when it lives in the driver's process (one-device runs, tests)."""
        if not isinstance(self.group, LocalWorkerGroup):
            raise RuntimeError(f"the {self.role} runs in {self.group.world_size} worker processes, not in this one")
        return self.group.worker.roles[self.role]

    def _start_all(self, method: str, *args: Any) -> Pending:
        return self.group.start_all("call", self.role, method, *args)

    def _run_all(self, method: str, *args: Any) -> list[Any]:
        return self._start_all(method, *args).wait()

    def _start_split(self, method: str, batch: Batch, *args: Any, measured: bool = False) -> Pending:
        """`method(share, *args)` on each rank with its data-parallel rank's contiguous share of `batch`
        (every rank of one model replica the same share); the results in rank order, every rank's
        (`measured`: each with its seconds and peak memory, see `RankWorker.call_measured`)."""
        if len(batch) % self.dp_size:
            raise ValueError(f"{self.role}.{method}: a batch of {len(batch)} samples does not split evenly over "
                             f"{self.dp_size} data-parallel ranks")
        size = len(batch) // self.dp_size
        shares = [batch.select(range(start, start + size)) if self.dp_size > 1 else batch
                  for start in range(0, len(batch), size)]
        call = "call_measured" if measured else "call"
        return self._start_by_layout(call, [(self.role, method, share, *args) for share in shares])

    def _start_by_layout(self, call: str, per_share: list[tuple]) -> Pending:
        """`call` on every rank with the arguments of its data-parallel rank's share (`per_share[dp_rank]`)."""
        return self.group.start_each(call, [(per_share[layout.dp_rank], {}) for layout in self.layouts])

    def _output_results(self, results: list[Any]) -> list[Any]:
        """Of every rank's results, each share's, from its replica's output rank, in data-parallel order."""
        return [results[rank] for rank in self.output_ranks]

    def _split_outputs(self, method: str, batch: Batch) -> list[Any]:
        """`method` over `batch` split by data-parallel rank: each share's result, in the batch's order."""
        return self._output_results(self._start_split(method, batch).wait())


def output_ranks(layouts: list[DataLayout], what: str) -> list[int]:
    """The rank that returns each data-parallel share's results, in data-parallel order; a layout
    whose ranks disagree (a share nobody returns, or two ranks returning one) is a bug, named here."""
    returning = sorted((layout.dp_rank, rank) for rank, layout in enumerate(layouts) if layout.returns_outputs)
    dp_size = layouts[0].dp_size
    if any(layout.dp_size != dp_size for layout in layouts) or [dp_rank for dp_rank, _ in returning] != list(range(dp_size)):
        raise RuntimeError(f"{what}: inconsistent data layout over its ranks: {layouts}")
    return [rank for _, rank in returning]


class TrainedRoleGroup(RoleGroup):
    """A role that updates its weights (actor, critic)."""

    def start_update(self, batch: Batch, step: int) -> Pending:
        """The update on every rank; its metrics (reduced over ranks by the engine) with, per role, the
        slowest and fastest rank's seconds and the largest peak memory of any rank."""
        pending = self._start_split("update", batch, step, measured=True)

        def joined() -> dict[str, float]:
            results = pending.wait()
            seconds = [result[1] for result in results]
            metrics = dict(self._output_results(results)[0][0])
            metrics.update({f"perf/{self.role}/update_seconds_max_rank": max(seconds),
                            f"perf/{self.role}/update_seconds_min_rank": min(seconds),
                            f"perf/{self.role}/peak_memory_gb": max(result[2] for result in results) / 2**30})
            return metrics

        return Pending(joined)

    def update(self, batch: Batch, step: int) -> dict[str, float]:
        return self.start_update(batch, step).wait()

    def save(self, path: str) -> None:
        self._run_all("save", path)

    def checkpoint_problem(self, path: str) -> str | None:
        """The first problem any rank finds with the role's files under `path` (None: nothing found)."""
        return next((problem for problem in self._run_all("checkpoint_problem", path) if problem is not None), None)

    def load(self, path: str) -> None:
        self._run_all("load", path)

    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """A Hugging Face folder of the role's current weights (every rank takes part)."""
        self._run_all("export_hf", out_dir, tokenizer)


class ActorGroup(TrainedRoleGroup):
    def __init__(self, group, mini_batch_samples: int, ppo_epochs: int):
        super().__init__(group, "actor")
        self.mini_batch_samples = mini_batch_samples  # the whole mini-batch: ppo_mini_batch_size × rollout.n
        self.ppo_epochs = ppo_epochs
        self.version = 0  # the training step whose update made the weights (`Actor.version`, as the ranks hold it)

    def start_update(self, batch: Batch, step: int) -> Pending:
        self.version = step
        return super().start_update(batch, step)

    def set_version(self, step: int) -> None:
        """The weights are those of training step `step` (a resume loaded its checkpoint)."""
        self._run_all("set_version", step)
        self.version = step

    def needs_old_log_probs(self, num_samples: int) -> bool:
        """Old log-probs equal the current ones when the batch is used for exactly one update."""
        return self.ppo_epochs > 1 or num_samples > self.mini_batch_samples

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        return torch.cat(self._split_outputs("compute_log_probs", batch))


class ReferenceGroup(RoleGroup):
    def __init__(self, group):
        super().__init__(group, "reference")

    def compute_log_probs(self, batch: Batch) -> torch.Tensor:
        return torch.cat(self._split_outputs("compute_log_probs", batch))


class CriticGroup(TrainedRoleGroup):
    def __init__(self, group):
        super().__init__(group, "critic")

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return torch.cat(self._split_outputs("compute_values", batch))


class ReconstructorGroup(TrainedRoleGroup):
    """NLA's critic: predicts the vectors from the explanations (`workers/reconstructor.py`)."""

    def __init__(self, group):
        super().__init__(group, "critic")

    def predict(self, batch: Batch) -> torch.Tensor:
        return torch.cat(self._split_outputs("predict", batch))


class WeightSenderGroup(RoleGroup):
    """The actor's pool as the source of a separate rollout pool's weights (`workers/weight_sync.py`)."""

    def __init__(self, group):
        super().__init__(group, "weight_sender")

    def first_rank(self, method: str, *args: Any) -> Any:
        """`method` on every rank (a collective over the pool), the first rank's result."""
        return self._output_results(self._run_all(method, *args))[0]

    def start_connect(self, address: str, port: int, group_size: int) -> Pending:
        return self._start_all("connect", address, port, group_size)

    def start_send(self) -> Pending:
        """One sync started on every rank; `wait()` gives the first rank's bytes and seconds."""
        pending = self._start_all("send")
        return Pending(lambda: self._output_results(pending.wait())[0])


class RolloutGroup(RoleGroup):
    """Generation on every rank of the actor's pool, each with its share of the prompts; or, with a
    `sender` (`hybrid_engine=false`), on a pool of its own that the sender's first rank sends the
    actor's weights to (`sync_weights`, whenever the actor's version has moved)."""

    def __init__(self, group, sender: WeightSenderGroup | None = None):
        super().__init__(group, "rollout")
        self.sender = sender
        self.synced_version: int | None = None  # the actor's version the rollout pool holds (None: none sent yet)
        if sender is not None:
            address, port = sender.first_rank("address")
            specs = sender.first_rank("tensor_specs")
            group_size = 1 + group.world_size
            joining = [sender.start_connect(address, port, group_size),
                       self._start_all("connect_weights", address, port, group_size, specs)]
            for pending in joining:
                pending.wait()

    def sync_weights(self, version: int) -> dict[str, float]:
        """A rollout pool of its own: send it the actor's weights unless it holds `version` already; the
        seconds the sync took and the bytes it sent (empty where nothing was sent)."""
        if self.sender is None or version == self.synced_version:
            return {}
        # The rollout ranks run one call at a time: a sync sent now would wait behind the generations queued there
        # while the actor's side of the broadcast stays open, past the weight group's timeout on long answers.
        self._run_all("idle")
        sending = self.sender.start_send()
        receiving = self._start_all("receive_weights")
        sent = sending.wait()  # the source's failure first: receivers then wait
        received = receiving.wait()
        if set(received) != {version}:
            raise RuntimeError(f"the rollout ranks received weight versions {received}, not the actor's {version}")
        self.synced_version = version
        return {"seconds": sent["seconds"], "gb": sent["bytes"] / 2**30}

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 injections: list[Injection | None] | None = None,
                 extra_infos: list[dict] | None = None) -> list[RolloutOutput]:
        """Samples grouped by prompt; NLA's `injections` and the agent loop's `extra_infos` (one per prompt)
        travel with each rank's prompts."""
        return self.start_generate(prompts, sampling, injections, extra_infos).wait()

    def start_generate(self, prompts: list[list[int]], sampling: SamplingParams,
                       injections: list[Injection | None] | None = None,
                       extra_infos: list[dict] | None = None) -> Pending:
        """`generate`, started: its `wait()` returns the samples (meanwhile the driver may drive other pools)."""
        bounds = [len(prompts) * dp_rank // self.dp_size for dp_rank in range(self.dp_size + 1)]
        per_share = [(self.role, "generate", prompts[start:end],
                      replace(sampling, first_prompt_index=sampling.first_prompt_index + start),
                      None if injections is None else injections[start:end],
                      None if extra_infos is None else extra_infos[start:end])
                     for start, end in zip(bounds, bounds[1:])]
        pending = self._start_by_layout("call", per_share)

        def joined() -> list[RolloutOutput]:
            outputs = []
            for start, share_outputs in zip(bounds, self._output_results(pending.wait())):
                for output in share_outputs:
                    output.prompt_index += start
                    outputs.append(output)
            return outputs

        return Pending(joined)

    def sleep(self) -> None:
        """Hand the KV cache back to training (`rollout.free_cache_engine`); a pool of its own keeps it."""
        if self.sender is None:
            self._run_all("sleep")

    def use_noise(self, step: int | None) -> None:
        """Noised weights of training step `step` for the next generations, or clean ones (None)."""
        self._run_all("use_noise", step)
