"""NLA's injection in training forwards: an activation vector in place of (or added to) one token's input embedding.

A forward hook on the model's input embeddings rewrites the output rows of the tokens that
`Batch.injection_positions` names, for the duration of one forward (and its backward: the
vector is a constant, the rest of the embedding output keeps its gradient). The token is
found by its position id, counted over real tokens, which the padded [b, T] layout and the
packed [1, N] layout (`use_remove_padding`) both keep, so the same rows are rewritten either
way. The vector goes in raw (cast to the compute dtype, no normalisation or scale), as in the
NLA fork. A sample whose position names no real token stops the forward, naming the sample.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ember.data.batch import Batch
from ember.rollout.base import INJECTION_MODES


def injection_mask(batch: Batch, packed: bool = False) -> Tensor:
    """Bool mask over the model's input layout ([b, T], or [1, N] packed): the one token per sample whose
    embedding output the vector rewrites (none for a sample at position -1)."""
    positions = batch.injection_positions.to(batch.position_ids.device)
    real = batch.attention_mask.bool()
    mask = (batch.position_ids == positions[:, None]) & real & (positions[:, None] >= 0)
    found = mask.sum(dim=1)
    wanted = (positions >= 0).long()
    if not torch.equal(found, wanted):
        sample = int((found != wanted).nonzero()[0])
        raise ValueError(f"sample {sample}: injection position {int(positions[sample])} names no real token of its "
                         f"{int(real[sample].sum())}; the vector has nowhere to go")
    return mask.reshape(-1)[real.reshape(-1)].unsqueeze(0) if packed else mask


def injected_rows(batch: Batch) -> Tensor:
    """[k, H] the vectors of the samples that inject, in sample order (the order of the mask's rows)."""
    return batch.activation_vectors[batch.injection_positions.to(batch.activation_vectors.device) >= 0]


def rewrite_embeddings(output: Tensor, mask: Tensor, vectors: Tensor, mode: str) -> Tensor:
    """`output` [.., T, H] with the masked tokens' rows replaced by (or added to) `vectors`, in order."""
    where = mask.to(output.device).unsqueeze(-1)
    placed = torch.zeros_like(output).masked_scatter(where, vectors.to(output.device, output.dtype))
    return torch.where(where, placed, output) if mode == "replace" else output + placed


def injection_inputs(batch: Batch, mode: str, packed: bool = False) -> tuple[Tensor, Tensor] | None:
    """(mask, vectors) of `batch`'s injection, checked (`injection_mask`, `injected_rows`); None when the
    batch carries no `injection_positions`. Every engine's hook starts from these."""
    if batch.injection_positions is None:
        return None
    if mode not in INJECTION_MODES:
        raise ValueError(f"injection mode {mode!r}: choose one of {INJECTION_MODES}")
    if batch.activation_vectors is None:
        raise ValueError("the batch names injection positions but carries no activation_vectors")
    return injection_mask(batch, packed), injected_rows(batch)


@contextmanager
def injecting(model: nn.Module, batch: Batch, *, packed: bool = False, mode: str = "replace") -> Iterator[None]:
    """Within the block, `model`'s forwards see `batch`'s vectors at their tokens (nothing when the batch
    carries no `injection_positions`)."""
    injection = injection_inputs(batch, mode, packed)
    if injection is None:
        yield
        return
    mask, vectors = injection

    def hook(module: nn.Module, args, output: Tensor) -> Tensor:
        return rewrite_embeddings(output, mask, vectors, mode)

    handle = model.get_input_embeddings().register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
