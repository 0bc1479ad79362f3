"""What every role built on a training engine does the same way: keep the engine off the
device between its phases, and save, load and export it.

The one thing to know: each method wraps its use of the engine in `engine.resident()`, so
with `param_offload`/`optimizer_offload` a role is on the device only while it works, and
callers (the trainer, a Ray worker) never touch the engine.
"""

from __future__ import annotations

from ember.engines.base import DataLayout, TrainEngine


class EngineRole:
    """A role holding one TrainEngine (its builder offloads the engine once built: `offload()`)."""

    def __init__(self, engine: TrainEngine):
        self.engine = engine

    def data_layout(self) -> DataLayout:
        """Which share of a batch this rank takes, and whether the driver collects its results."""
        return self.engine.data_layout()

    def save(self, path: str) -> None:
        """A resumable checkpoint of the engine under `path`; every rank of the role calls it."""
        with self.engine.resident():
            self.engine.save(path)

    def checkpoint_problem(self, path: str) -> str | None:
        """What is wrong with the engine's files under `path` before loading them (None: nothing found)."""
        return self.engine.checkpoint_problem(path)

    def load(self, path: str) -> None:
        with self.engine.resident():
            self.engine.load(path)

    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """A Hugging Face model directory of the current weights; every rank of the role calls it."""
        with self.engine.resident():
            self.engine.export_hf(out_dir, tokenizer=tokenizer)
