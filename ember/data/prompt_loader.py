"""Batches of prompts, epoch by epoch, in a seeded order that a resumed run reproduces exactly.

The order of epoch `e` depends only on (`seed`, `e`), so the loader's whole state is three
integers: the seed, the epoch and how many batches of that epoch were handed out (plus what it
walks: the number of samples, the batch size and whether it shuffles, checked on resume).
`state_dict()` taken after any batch, loaded into a fresh loader over the same dataset,
continues with exactly the batch that would have come next.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np

from ember.data.parquet import DatasetError

Sample = TypeVar("Sample")


class PromptLoader(Generic[Sample]):
    """Lists of `batch_size` samples; `len()` is the number of batches (steps) per epoch.

    Iterating yields the batches left in the current epoch and then moves to the next
    epoch, so `for batch in loader` inside `for epoch in ...` walks the epochs in turn.
    Once a batch is handed out the state already points past it: saving a checkpoint
    after training on that batch resumes with the one after it.
    """

    def __init__(
        self,
        dataset: Sequence[Sample],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
    ):
        if batch_size < 1:
            raise DatasetError(f"batch size must be at least 1, got {batch_size}; set data.train_batch_size")
        if len(dataset) == 0 or (drop_last and len(dataset) < batch_size):
            raise DatasetError(
                f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}; "
                "lower data.train_batch_size (or data.val_batch_size) or add rows to data.train_files (data.val_files)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0  # epochs completed
        self.position = 0  # batches already handed out in the current epoch

    def __len__(self) -> int:
        full, remainder = divmod(len(self.dataset), self.batch_size)
        return full + (1 if remainder and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which epoch `epoch` visits the dataset's indices."""
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[list[Sample]]:
        order = self.epoch_order(self.epoch)
        steps = len(self)
        while self.position < steps:
            start = self.position * self.batch_size
            batch = [self.dataset[int(index)] for index in order[start : start + self.batch_size]]
            self.position += 1
            epoch_done = self.position == steps
            if epoch_done:
                self.epoch, self.position = self.epoch + 1, 0
            yield batch
            if epoch_done:
                return

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands: seed, epoch, and batches already handed out in that epoch; and what it walks
        (the number of samples, the batch size, whether it shuffles), which a resume must find unchanged."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "samples": len(self.dataset),
                "batch_size": self.batch_size, "shuffle": int(self.shuffle)}  # integers all (trainer_state.json)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a `state_dict()`; the next batch is the one that would have followed it. A state of a
        loader over another number of samples, in other batches or another order is refused: its position would
        point into another walk of the data (a state from before these were saved is checked by position only)."""
        here = {"samples": len(self.dataset), "batch_size": self.batch_size, "shuffle": int(self.shuffle)}
        changed = {key: (state[key], value) for key, value in here.items() if key in state and state[key] != value}
        if changed:
            listed = ", ".join(f"{key} {saved} then, {now} now" for key, (saved, now) in changed.items())
            raise DatasetError(
                f"the checkpoint's data loader walked other data ({listed}); resume with the same data files, "
                "data.train_batch_size, data.shuffle and prompt filtering (data.max_prompt_length, "
                "data.filter_overlong_prompts) as the checkpointed run, or start a new run in another "
                "trainer.default_local_dir"
            )
        if not 0 <= state["position"] < len(self):
            raise DatasetError(
                f"loader state has position {state['position']} but an epoch here has {len(self)} batches; "
                "resume with the same data files and data.train_batch_size as the checkpointed run"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
