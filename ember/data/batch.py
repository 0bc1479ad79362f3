"""The Batch: the samples of one RL step as typed, padded tensors plus per-sample metadata.

Every sample is a prompt followed by its response. Prompts are left-padded to a common
length P and responses right-padded to a common length R, so position P-1 is always the
last prompt token and positions P .. P+R-1 hold the response: a model's prediction for
response token i sits at position P-1+i for every sample alike.

Each field declares its layout in its metadata (`sequence`: [B, P+R, ...], `response`:
[B, R, ...], `sample`: [B, ...] or a list of B objects) and every operation (select,
split, concat, to) loops over the dataclass fields by layout. A new field (NLA's injected
vectors, say) therefore needs only its declaration here, no new code.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

SEQUENCE = "sequence"  # [B, P+R, ...]: prompt ++ response, re-padded on both sides by concat
RESPONSE = "response"  # [B, R, ...]: one entry per response position, right-padded
SAMPLE = "sample"  # [B, ...] tensor, or a list with one entry per sample (or empty)


def _tensor(layout: str, required: bool = False) -> Any:
    if required:
        return field(metadata={"layout": layout})
    return field(default=None, metadata={"layout": layout})


def _per_sample_list() -> Any:
    return field(default_factory=list, metadata={"layout": SAMPLE})


@dataclass
class Batch:
    """B samples of one RL step. Prompt left-padded to P, response right-padded to R."""

    input_ids: Tensor = _tensor(SEQUENCE, required=True)
    """[B, P+R] prompt ++ response token ids; padding holds the pad id (or 0 after concat)."""
    attention_mask: Tensor = _tensor(SEQUENCE, required=True)
    """[B, P+R] 1 on real tokens: the prompt, and the response up to and including EOS."""
    position_ids: Tensor = _tensor(SEQUENCE, required=True)
    """[B, P+R] position of each token counted over real tokens only (0 at the first)."""
    response_mask: Tensor = _tensor(RESPONSE, required=True)
    """[B, R] 1 on response tokens that count (up to and including the first EOS; multi-turn: the model's own
    tokens, not the tool turns', which `attention_mask` covers)."""

    rollout_log_probs: Tensor | None = _tensor(RESPONSE)
    """[B, R] log-prob of each response token under the rollout engine's policy."""
    old_log_probs: Tensor | None = _tensor(RESPONSE)
    """[B, R] log-probs under the actor before this step's updates (the PPO ratio's denominator)."""
    ref_log_probs: Tensor | None = _tensor(RESPONSE)
    """[B, R] log-probs under the frozen reference policy (for the KL term)."""
    values: Tensor | None = _tensor(RESPONSE)
    """[B, R] critic's value estimate before each response token."""
    token_level_scores: Tensor | None = _tensor(RESPONSE)
    """[B, R] reward-function scores, placed on the last response token."""
    token_level_rewards: Tensor | None = _tensor(RESPONSE)
    """[B, R] scores after the in-reward KL penalty (equal to the scores without one)."""
    advantages: Tensor | None = _tensor(RESPONSE)
    """[B, R] advantage of each response token."""
    returns: Tensor | None = _tensor(RESPONSE)
    """[B, R] value targets for the critic."""
    rollout_is_weights: Tensor | None = _tensor(RESPONSE)
    """[B, R] rollout correction's truncated importance weights π_old/π_rollout (detached; 0 on
    padding), multiplying each token's policy loss; None without `rollout_is`."""

    activation_vectors: Tensor | None = _tensor(SAMPLE)
    """[B, H] float32 NLA: each sample's activation vector (the actor's injected input; the
    reconstructor's target)."""
    injection_positions: Tensor | None = _tensor(SAMPLE)
    """[B] int64 NLA: the position id (counted over real tokens, as `position_ids`) of the token
    whose input embedding the vector replaces; -1 = none. Set only on the actor's batches."""

    policy_versions: Tensor | None = _tensor(SAMPLE)
    """[B] int64: the version of the weights that generated each sample (the training step whose update
    made them; 0: the weights loaded at the start)."""

    uids: list[str] = _per_sample_list()
    """Prompt-group id: the samples of one prompt share it (GRPO groups by it)."""
    data_sources: list[str] = _per_sample_list()
    """Name of the data set each sample came from; picks the reward function."""
    ground_truths: list = _per_sample_list()
    """Reference answer of each sample, passed to the reward function."""
    extra_infos: list[dict] = _per_sample_list()
    """Free-form per-sample information from the data set row, passed to the reward function."""

    def __post_init__(self) -> None:
        batch_size, total_length = self.input_ids.shape[:2]
        response_length = self.response_mask.shape[1]
        if response_length >= total_length:
            raise ValueError(f"response_mask has {response_length} positions and input_ids {total_length}; "
                             "input_ids must hold at least one prompt position before the response")
        expected = {SEQUENCE: (batch_size, total_length), RESPONSE: (batch_size, response_length)}
        for name, layout, value in self._fields():
            if value is None:
                continue
            if isinstance(value, Tensor):
                leading = expected.get(layout, (batch_size,))
                if tuple(value.shape[:len(leading)]) != leading:
                    raise ValueError(f"Batch.{name} has shape {tuple(value.shape)}; its leading dimensions "
                                     f"must be {leading} ({layout} layout)")
            elif len(value) not in (0, batch_size):
                raise ValueError(f"Batch.{name} has {len(value)} entries; give one per sample ({batch_size}) or none")

    def _fields(self) -> list[tuple[str, str, Any]]:
        """(name, layout, value) of every field, in declaration order."""
        return [(f.name, f.metadata["layout"], getattr(self, f.name)) for f in dataclasses.fields(self)]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        """R: positions of the (right-padded) response."""
        return self.response_mask.shape[1]

    @property
    def prompt_length(self) -> int:
        """P: positions of the (left-padded) prompt."""
        return self.input_ids.shape[1] - self.response_length

    @property
    def response_prediction_positions(self) -> slice:
        """Positions P-1 .. P+R-2, whose model outputs predict (or value) the R response tokens."""
        return slice(self.prompt_length - 1, self.input_ids.shape[1] - 1)

    @property
    def responses(self) -> Tensor:
        """[B, R] view of the response token ids."""
        return self.input_ids[:, self.prompt_length:]

    def _map(self, tensor_fn, list_fn) -> Batch:
        updates = {}
        for name, _, value in self._fields():
            if isinstance(value, Tensor):
                updates[name] = tensor_fn(value)
            elif isinstance(value, list):
                updates[name] = list_fn(value)
        return dataclasses.replace(self, **updates)

    def select(self, indices: Sequence[int] | Tensor) -> Batch:
        """The samples at `indices`, in that order (tensors are gathered, so this copies)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        picked = index.tolist()
        return self._map(lambda t: t[index.to(t.device)], lambda values: [values[i] for i in picked] if values else [])

    def _slice(self, start: int, end: int) -> Batch:
        return self._map(lambda t: t[start:end], lambda values: values[start:end])

    def split(self, size: int) -> list[Batch]:
        """Consecutive chunks of `size` samples (views, no copy); the last may be smaller."""
        if size < 1:
            raise ValueError(f"cannot split a batch into chunks of {size} samples; use a size of at least 1")
        return [self._slice(start, start + size) for start in range(0, len(self), size)]

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on `device`."""
        return self._map(lambda t: t.to(device), lambda values: values)

    def with_fields(self, **updates: Any) -> Batch:
        """A copy with the given fields replaced (validated like a new Batch)."""
        return dataclasses.replace(self, **updates)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """All samples of `batches` in order, re-padded to the largest prompt and response lengths."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        prompt_length = max(b.prompt_length for b in batches)
        response_length = max(b.response_length for b in batches)
        joined = {}
        for name, layout, _ in batches[0]._fields():
            values = [getattr(b, name) for b in batches]
            missing = [v is None or (isinstance(v, list) and not v) for v in values]
            if all(missing):
                joined[name] = values[0]
            elif any(missing):
                raise ValueError(f"Batch.concat: field {name!r} is set in some batches and missing in others; "
                                 "fill it in every batch or in none")
            elif isinstance(values[0], Tensor):
                joined[name] = torch.cat([_pad_to(v, layout, b, prompt_length, response_length)
                                          for v, b in zip(values, batches)])
            else:
                joined[name] = [item for v in values for item in v]
        return Batch(**joined)

    @classmethod
    def from_rollout(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        *,
        pad_token_id: int,
        eos_token_ids: int | Collection[int] = (),
        rollout_log_probs: Sequence[Sequence[float]] | None = None,
        response_masks: Sequence[Sequence[int] | None] | None = None,
        uids: Sequence[str] = (),
        data_sources: Sequence[str] = (),
        ground_truths: Sequence = (),
        extra_infos: Sequence[dict] = (),
        prompt_length: int | None = None,
        response_length: int | None = None,
    ) -> Batch:
        """Pad token-id lists into a Batch: prompts on the left, responses on the right.

        A response counts up to and including its first token in `eos_token_ids`; tokens
        after it are masked out of both `response_mask` and `attention_mask`. A response given a
        mask in `response_masks` (multi-turn: 1 on model tokens, 0 on tool tokens) is attended
        whole and counts where its mask is 1. P and R default to the longest prompt and
        response; pass them to pad to fixed lengths.
        """
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses; "
                             "give one prompt per response")
        for i, prompt in enumerate(prompt_ids):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; every sample needs at least one prompt token")
        stop_ids = {eos_token_ids} if isinstance(eos_token_ids, int) else set(eos_token_ids)
        prompt_length = _padded_length(prompt_ids, prompt_length, "prompt_length")
        response_length = _padded_length(response_ids, response_length, "response_length")

        batch_size = len(prompt_ids)
        masks = response_masks if response_masks is not None else [None] * batch_size
        if len(masks) != batch_size:
            raise ValueError(f"{len(masks)} response masks for {batch_size} responses; give one (or None) per response")
        prompt_lengths = np.array([len(prompt) for prompt in prompt_ids], dtype=np.int64)
        response_lengths = np.array([len(response) for response in response_ids], dtype=np.int64)
        columns = np.arange(prompt_length + response_length)
        # prompts end at column P (left padding), responses start there; one row-major fill of each
        in_prompt = (columns[None, :] >= prompt_length - prompt_lengths[:, None]) & (columns[None, :] < prompt_length)
        in_response = (columns[None, :] >= prompt_length) & (columns[None, :] < prompt_length + response_lengths[:, None])
        tokens = np.full((batch_size, prompt_length + response_length), pad_token_id, dtype=np.int64)
        tokens[in_prompt] = _flat(prompt_ids, np.int64, int(prompt_lengths.sum()))
        tokens[in_response] = _flat(response_ids, np.int64, int(response_lengths.sum()))
        # a response counts up to and including its first stop token; a masked (multi-turn) one whole
        responses = np.where(in_response[:, prompt_length:], tokens[:, prompt_length:], -1)
        stops = np.isin(responses, list(stop_ids)) if stop_ids else np.zeros_like(responses, dtype=bool)
        attended = np.where(stops.any(axis=1), stops.argmax(axis=1) + 1, response_lengths)
        given = np.array([mask is not None for mask in masks])
        attended = np.where(given, response_lengths, attended)
        attention = in_prompt | (in_response & (columns[None, :] < prompt_length + attended[:, None]))
        input_ids = torch.from_numpy(tokens)
        attention_mask = torch.from_numpy(attention.astype(np.int64))
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        response_mask = attention_mask[:, prompt_length:].clone()
        for i, mask in enumerate(masks):
            if mask is not None:
                if len(mask) != len(response_ids[i]):
                    raise ValueError(f"response {i} has {len(response_ids[i])} tokens but a mask of {len(mask)}")
                response_mask[i, :len(mask)] = torch.tensor(mask, dtype=response_mask.dtype)
        log_probs = None
        if rollout_log_probs is not None:
            lengths = np.array([len(values) for values in rollout_log_probs], dtype=np.int64)
            filled = np.arange(response_length)[None, :] < lengths[:, None]
            values = np.zeros((batch_size, response_length), dtype=np.float32)
            values[filled] = _flat(rollout_log_probs, np.float32, int(lengths.sum()))
            log_probs = torch.from_numpy(values)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            response_mask=response_mask,
            rollout_log_probs=log_probs,
            uids=list(uids),
            data_sources=list(data_sources),
            ground_truths=list(ground_truths),
            extra_infos=list(extra_infos),
        )


def _padded_length(sequences: Sequence[Sequence[int]], requested: int | None, name: str) -> int:
    longest = max((len(s) for s in sequences), default=0)
    if requested is None:
        return longest
    if requested < longest:
        raise ValueError(f"{name}={requested} is shorter than the longest sequence ({longest} tokens); "
                         f"raise {name} or truncate the inputs")
    return requested


def _flat(rows: Sequence[Sequence], dtype: type, count: int) -> np.ndarray:
    """Every row's values one after the other, in one array (the rows are host lists)."""
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=count)


def _pad_to(tensor: Tensor, layout: str, batch: Batch, prompt_length: int, response_length: int) -> Tensor:
    """Zero-pad `tensor` (of `batch`) along dim 1 to the target P / R for its layout."""
    if layout == SEQUENCE:
        left, right = prompt_length - batch.prompt_length, response_length - batch.response_length
    elif layout == RESPONSE:
        left, right = 0, response_length - batch.response_length
    else:
        return tensor
    if left == right == 0:
        return tensor
    shape = list(tensor.shape)
    pieces = []
    if left:
        pieces.append(tensor.new_zeros([shape[0], left, *shape[2:]]))
    pieces.append(tensor)
    if right:
        pieces.append(tensor.new_zeros([shape[0], right, *shape[2:]]))
    return torch.cat(pieces, dim=1)
