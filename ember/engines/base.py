"""The training-engine interface every backend (FSDP2, Megatron) implements.

The RL loop and the workers hold a `TrainEngine` and never ask which backend it is. An
engine owns one model (actor, critic or reference), its optimizer and schedule, and its
sharding; the caller gives it Batches and a loss function.

The one contract to know is how losses are scaled. For each mini-batch the engine counts
the response tokens (sum of `response_mask`) and sequences over ALL micro-batches on ALL
data-parallel ranks and hands them to the loss function in a `LossContext`. The loss
function returns its micro-batch's share of the mini-batch loss, normalised by those global
counts (e.g. Σ token losses / num_tokens). The engine then backpropagates `share × dp_size`
because data-parallel gradient reduction averages over ranks. Gradients are then the same
for one rank with the whole mini-batch and N ranks with 1/N each, at any micro-batch size,
and whether micro-batches hold a fixed number of samples or a token budget (`MicroBatchSpec`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch import Tensor, nn

from ember.data.batch import Batch


@dataclass
class ModelOutput:
    """Per-response-token outputs of a forward pass, each [b, R] float32 (None when not computed);
    `predictions` is per sample."""

    log_probs: Tensor | None = None
    """log π(token | prefix) of each response token, at the given temperature (actor, reference)."""
    entropy: Tensor | None = None
    """Entropy of the next-token distribution at each response position (when asked for)."""
    values: Tensor | None = None
    """Critic's value before each response token, zero outside `response_mask` (critic)."""
    predictions: Tensor | None = field(default=None, metadata={"per_sample": True})
    """[b, H] float32: NLA's reconstructor's vector for each sample (one row per sample, not per token)."""


@dataclass(frozen=True)
class MicroBatchSpec:
    """How a batch is cut into micro-batches: a fixed number of samples, or a token budget (set one).

    With a token budget the engine partitions the samples into the fewest micro-batches of
    near-equal token counts within it (ember/engines/micro_batches.py), the same number on
    every data-parallel rank; a sample longer than the budget gets a micro-batch of its own.
    """

    size: int | None = None
    """Samples per micro-batch (the last may hold fewer)."""
    max_token_len: int | None = None
    """Most prompt + response tokens (attention-mask sums) per micro-batch."""

    def __post_init__(self) -> None:
        if (self.size is None) == (self.max_token_len is None):
            raise ValueError(f"MicroBatchSpec(size={self.size}, max_token_len={self.max_token_len}): "
                             "give exactly one of a sample count and a token budget")
        chosen = self.size if self.size is not None else self.max_token_len
        if chosen < 1:
            raise ValueError(f"MicroBatchSpec(size={self.size}, max_token_len={self.max_token_len}): use at least 1")

    @classmethod
    def of(cls, micro_batch_size: int | MicroBatchSpec) -> MicroBatchSpec:
        """A spec as given, or a sample count as a spec."""
        return micro_batch_size if isinstance(micro_batch_size, MicroBatchSpec) else cls(size=micro_batch_size)


@dataclass(frozen=True)
class LossContext:
    """Global counts over the whole mini-batch (all micro-batches, all data-parallel ranks)."""

    num_tokens: int
    """Response tokens counted by `response_mask` in the mini-batch."""
    num_sequences: int
    """Samples in the mini-batch."""
    dp_size: int
    """Data-parallel ranks sharing the mini-batch."""
    sum_over_ranks: Callable[[Tensor], Tensor] | None = None
    """A small tensor summed over those ranks (an all-reduce every rank must call alike, once per micro-batch);
    None with one rank. For statistics that verl takes over the ranks' micro-batches together."""


@dataclass(frozen=True)
class DataLayout:
    """Where one rank sits in its role's data layout, as the driver dispatches batches by it.

    Ranks of one model replica (a tensor-, pipeline- or context-parallel group) share a
    data-parallel rank: the driver gives them the same share of a batch, and takes that share's
    outputs from the one rank of the replica that `returns_outputs`. Only data-parallel ranks
    see different samples, so the world size is never the data-parallel size by itself.
    """

    dp_size: int
    """Data-parallel ranks a batch is split over."""
    dp_rank: int
    """This rank's share of a batch, in [0, dp_size)."""
    returns_outputs: bool = True
    """Whether the driver collects this rank's results (exactly one rank per `dp_rank` does)."""


LossFn = Callable[[ModelOutput, Batch, LossContext], tuple[Tensor, dict[str, float]]]
"""(micro-batch output, micro-batch, global counts) -> (this micro-batch's share of the loss, metrics).

The metrics are floats with the same keys on every rank; the engine averages them.
"""


class TrainEngine(ABC):
    """One model with its optimizer, sharding and checkpoints; see the module docstring for loss scaling."""

    @abstractmethod
    def forward(self, batch: Batch, micro_batch_size: int | MicroBatchSpec, *, compute_entropy: bool = False,
                temperature: float = 1.0) -> ModelOutput:
        """Outputs for every sample of `batch` in its order, without gradients, in eval mode.

        `micro_batch_size` is samples per micro-batch or a `MicroBatchSpec` (a token budget).
        With a token budget, response positions a micro-batch did not need (padding beyond
        its longest response) hold 0.
        """

    @abstractmethod
    def train_mini_batch(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int | MicroBatchSpec, *,
                         compute_entropy: bool = False, temperature: float = 1.0,
                         entropy_grad: bool = False) -> dict[str, float]:
        """One optimizer step on `batch` (this rank's part of the mini-batch).

        The entropy is a metric without gradients unless `entropy_grad` (an entropy term in
        the loss).

        `micro_batch_size` is samples per micro-batch or a `MicroBatchSpec` (a token budget);
        with a budget the loss function sees each micro-batch trimmed of its all-padding
        columns, so its response width may be narrower than `batch`'s (give
        seq-mean-token-sum-norm an explicit `norm_length`). Accumulates gradients over
        micro-batches, clips them, steps the optimizer and the
        learning-rate schedule. A non-finite gradient norm skips both steps. Returns
        `loss` (the whole mini-batch's loss), the loss function's metrics averaged over
        micro-batches and ranks, `grad_norm`, `lr` (used by this step) and `skipped` (0 or 1).
        """

    dp_size: int = 1
    """Data-parallel ranks this engine's batches are split over (the loss-scaling contract's N)."""
    dp_rank: int = 0
    """This process's index among them."""

    def data_layout(self) -> DataLayout:
        """This rank's place in the data layout; every rank returns outputs unless a backend
        splits one replica over several ranks (Megatron's tensor and pipeline parallelism)."""
        return DataLayout(self.dp_size, self.dp_rank)

    @property
    def syncs_live_parameters(self) -> bool:
        """Whether `named_parameters_for_sync` yields the live parameters themselves (at addresses
        that stay put), so a rollout engine may share them instead of copying; False by default."""
        return False

    @property
    def trains_every_weight(self) -> bool:
        """Whether training changes every weight `named_parameters_for_sync` yields, so `trained_only` yields
        them all too (False with LoRA: only the adapted layers change); True by default."""
        return True

    @abstractmethod
    def named_parameters_for_sync(self, bucket_bytes: int = 512 << 20,
                                  trained_only: bool = False) -> Iterator[list[tuple[str, Tensor]]]:
        """Full (unsharded) weights under their Hugging Face names, in buckets of about `bucket_bytes`;
        with `trained_only`, only those training can change (with LoRA, the adapted layers, merged;
        otherwise all of them).

        Every rank must consume the whole iterator: gathering a weight is a collective.
        """

    @contextmanager
    def adapters_disabled(self) -> Iterator[TrainEngine]:
        """Forwards in the block compute the base model without its LoRA adapters (the reference policy of a
        LoRA actor); an engine without adapters computes as it always does."""
        yield self

    @abstractmethod
    def module(self) -> nn.Module:
        """The trained module itself (no copy), for an in-process rollout engine at world size 1."""

    @abstractmethod
    def save(self, path: str) -> None:
        """Write a sharded, resumable checkpoint (model, optimizer, schedule) under `path`; every rank calls."""

    @abstractmethod
    def load(self, path: str) -> None:
        """Restore what `save` wrote, so that the next update is the one the saved engine would make."""

    @abstractmethod
    def checkpoint_problem(self, path: str) -> str | None:
        """None when `path` holds every file `load` reads, intact as far as can be seen without
        loading; else what is wrong, naming the file. Reads files only: any rank may call."""

    @abstractmethod
    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """Write a Hugging Face model directory (safetensors, config, generation config, tokenizer if given)."""

    @abstractmethod
    def offload(self) -> None:
        """Move what the options say (parameters, optimizer state) to CPU memory between phases.

        Call `onload` before the next forward, update or checkpoint.
        """

    @abstractmethod
    def onload(self) -> None:
        """Bring back to the device what `offload` moved."""

    @contextmanager
    def resident(self) -> Iterator[TrainEngine]:
        """On the device for the block (`onload`), back in CPU memory after it (`offload`): how the
        trainer wraps each phase that uses the engine; both are no-ops when nothing is offloaded."""
        self.onload()
        try:
            yield self
        finally:
            self.offload()
