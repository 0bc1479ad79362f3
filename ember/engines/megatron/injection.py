"""NLA's injection in the Megatron engine: the vector written over one token's embedding output.

The same rewrite as the FSDP2 engine's (`engines/injection.py`: the mask of the tokens
`Batch.injection_positions` names, replace or add, the vector cast to the compute dtype),
hooked on the GPTModel's `embedding` module, which only the pipeline stage with
`pre_process` runs. Two things differ from a HF model's input embeddings:

- megatron-core's embedding output is sequence-first, [s, b, h]: the hook rewrites its
  [b, s, h] transpose, so that the mask, built over the micro-batch's [b, s] input, and the
  vectors, in sample order, line up as they do for FSDP2;
- under sequence parallelism each tensor-parallel rank holds its slice of s, [s/TP, b, h]
  (the embedding scatters its output): each rank rewrites the tokens of its own slice, so
  every injected token is written once, by the rank that holds it. Without sequence
  parallelism every rank holds the whole [s, b, h] (after the vocabulary-parallel
  all-reduce) and every rank rewrites it alike.

A packed micro-batch (`use_remove_padding`, `model_inputs.py`) is one row, [T, 1, h]: the marker
tokens are found by their position ids in the packed row (`injection_mask(packed=True)`, as for
FSDP2), and the padding that sequence parallelism adds at the row's end injects nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ember.data.batch import Batch
from ember.engines.injection import injection_inputs, rewrite_embeddings
from ember.engines.megatron.bridge import unwrapped


@contextmanager
def injecting(chunk: nn.Module, batch: Batch, *, mode: str = "replace", packed_length: int | None = None,
              ) -> Iterator[None]:
    """Within the block, the forwards of model chunk `chunk` (inside its wrappers) see `batch`'s vectors
    at their tokens: nothing when the batch carries no `injection_positions` or the chunk has no
    embedding (a later pipeline stage). `batch` is the micro-batch in ember's padded [b, s] layout; the
    chunk is fed that, or its packed row of `packed_length` tokens."""
    injection = injection_inputs(batch, mode, packed=packed_length is not None)  # checked on every stage alike
    model = unwrapped(chunk)
    if injection is None or not model.pre_process:
        yield
        return
    mask, vectors = injection
    if packed_length is not None:
        mask = torch.nn.functional.pad(mask, (0, packed_length - mask.shape[1]))

    def hook(module: nn.Module, args, output: Tensor) -> Tensor:
        local_mask, local_vectors = _sequence_slice(mask, vectors, output.shape[0])
        rewritten = rewrite_embeddings(output.transpose(0, 1), local_mask, local_vectors, mode)
        return rewritten.transpose(0, 1).contiguous()

    handle = model.embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _sequence_slice(mask: Tensor, vectors: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """The [b, length] columns of `mask` that this rank's embedding output holds, and the vectors of
    the tokens injected there: all of them, or under sequence parallelism the tensor-parallel
    rank's slice (megatron-core scatters s in TP equal parts, rank r holding part r). A packed row
    ([1, s]) holds several samples' tokens, so vectors go by token, in row-major order."""
    width = mask.shape[1]
    if length == width:
        return mask, vectors
    from megatron.core import parallel_state as mpu

    ranks = mpu.get_tensor_model_parallel_world_size()
    if length * ranks != width:
        raise ValueError(f"the embedding returned {length} sequence positions for a micro-batch of {width} "
                         f"with tensor parallel size {ranks}; NLA's injection knows the whole sequence or "
                         "its sequence-parallel slice only")
    start = mpu.get_tensor_model_parallel_rank() * length
    columns = mask.nonzero()[:, 1]  # the injected tokens in row-major order, the order of `vectors`' rows
    return mask[:, start:start + length], vectors[(columns >= start) & (columns < start + length)]
