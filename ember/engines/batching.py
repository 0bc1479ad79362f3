"""Backend-neutral pieces of an engine: micro-batches, global counts, joined outputs, weight buckets.

Every engine (FSDP2, Megatron) cuts a batch the same way and hands its loss function the
same `LossContext`; only the collective differs (the data-parallel group of the backend),
so each function here takes the engine's `all_reduce(tensor, op) -> tensor`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields

import torch
import torch.distributed as dist
from torch import Tensor

from ember.data.batch import Batch
from ember.engines.base import LossContext, MicroBatchSpec, ModelOutput
from ember.engines.micro_batches import min_micro_batch_count, plan_micro_batches, trim_columns, used_extents
from ember.errors import UserError

AllReduce = Callable[[Tensor, dist.ReduceOp], Tensor]


def micro_batches(batch: Batch, spec: MicroBatchSpec, all_reduce: AllReduce,
                  count_multiple: int = 1) -> tuple[list[Batch], list[list[int]]]:
    """The micro-batches of `batch` and the sample indices each holds: `batch.split` views for a
    fixed size (the same count checked on every rank); for a token budget, the planned groups
    (every rank planned with the largest count any rank needs), each trimmed of the padding
    columns none of its samples use. Fixed-size micro-batches keep the batch's width, so their
    outputs stay bitwise those of the unsplit batch. `count_multiple`: the count must be a multiple
    of it (megatron-core's interleaved pipeline schedule: the pipeline size), so it is rounded up to one:
    more, smaller micro-batches (for a fixed size, consecutive groups whose sizes differ by at most one)."""
    if spec.size is not None:
        micros = batch.split(spec.size)
        _check_micro_batch_count(len(micros), all_reduce)
        count = _rounded_count(len(micros), count_multiple, len(batch))
        if count == len(micros):
            return micros, [list(range(start, start + len(micro)))
                            for start, micro in zip(range(0, len(batch), spec.size), micros)]
        bounds = [len(batch) * index // count for index in range(count + 1)]  # consecutive, sizes within one
        groups = [list(range(start, end)) for start, end in zip(bounds, bounds[1:])]
        return [batch.select(group) for group in groups], groups
    lengths = batch.attention_mask.sum(dim=1).tolist()
    local_count = torch.tensor([min_micro_batch_count(lengths, spec.max_token_len)], dtype=torch.int64)
    count = _rounded_count(int(all_reduce(local_count, dist.ReduceOp.MAX)), count_multiple, len(batch))
    groups = plan_micro_batches(lengths, spec.max_token_len, count)
    prompt_starts, response_lengths = used_extents(batch)
    micros = [trim_columns(batch.select(group), min(prompt_starts[i] for i in group),
                           max(response_lengths[i] for i in group)) for group in groups]
    return micros, groups


def _rounded_count(count: int, multiple: int, samples: int) -> int:
    """`count` micro-batches rounded up to a multiple of `multiple` (smaller micro-batches: the loss-scaling
    contract keeps the update the same); a UserError when the rank's `samples` cannot fill that many."""
    rounded = -(-count // multiple) * multiple
    if rounded > samples:
        raise UserError(f"the interleaved pipeline schedule (virtual_pipeline_model_parallel_size) runs a multiple "
                        f"of {multiple} micro-batches (the pipeline size), {rounded} here, but a rank holds "
                        f"{samples} samples: give each rank at least {rounded} samples, or drop the virtual stages")
    return rounded


def _check_micro_batch_count(count: int, all_reduce: AllReduce) -> None:
    extremes = all_reduce(torch.tensor([count, -count], dtype=torch.int64), dist.ReduceOp.MAX).tolist()
    most, fewest = extremes[0], -extremes[1]
    if most != fewest:
        raise ValueError(f"ranks split their batches into {fewest} to {most} micro-batches; every rank must "
                         "get the same number of samples (make the batch size divisible by the "
                         "data-parallel size times the micro-batch size)")


def loss_context(batch: Batch, dp_size: int, all_reduce: AllReduce) -> LossContext:
    """The mini-batch's response tokens and samples summed over the data-parallel ranks."""
    counts = torch.tensor([int(batch.response_mask.sum()), len(batch)], dtype=torch.int64)
    num_tokens, num_sequences = all_reduce(counts, dist.ReduceOp.SUM).tolist()
    sum_over_ranks = (lambda tensor: all_reduce(tensor, dist.ReduceOp.SUM)) if dp_size > 1 else None
    return LossContext(num_tokens=num_tokens, num_sequences=num_sequences, dp_size=dp_size,
                       sum_over_ranks=sum_over_ranks)


def join_outputs(outputs: list[ModelOutput], groups: list[list[int]], response_length: int,
                 device: torch.device) -> ModelOutput:
    """One ModelOutput for the whole batch on `device`: each computed per-token field zero-padded back
    to `response_length` columns, and every field's rows put back in sample order (micro-batch i holds the
    samples `groups[i]`)."""
    order = torch.tensor([index for group in groups for index in group], dtype=torch.long)
    joined = {}
    for item in fields(ModelOutput):
        parts = [getattr(output, item.name) for output in outputs]
        if parts[0] is None:
            joined[item.name] = None
            continue
        per_sample = item.metadata.get("per_sample", False)
        stacked = torch.cat(parts if per_sample else
                            [torch.nn.functional.pad(part, (0, response_length - part.shape[1])) for part in parts])
        restored = torch.empty_like(stacked)
        restored[order.to(stacked.device)] = stacked
        joined[item.name] = restored.to(device)
    return ModelOutput(**joined)


def in_buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """`named_tensors` in lists of about `bucket_bytes` each (a list closes once it reaches the size),
    as weights stream to a rollout engine."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def in_dtype_buckets(named_tensors: Iterable[tuple[str, Tensor]], bucket_bytes: int,
                     dtype: torch.dtype) -> Iterator[list[tuple[str, Tensor]]]:
    """`in_buckets`, each bucket's tensors in `dtype`: those of another dtype become views of one new
    buffer per bucket, filled by one foreach copy (a cast per tensor is a launch per tensor, which
    sets the pace of a small model's weight sync); tensors already in `dtype` pass as they are."""
    for bucket in in_buckets(named_tensors, bucket_bytes):
        by_device: dict[torch.device, list[int]] = {}  # the positions to cast, per device
        for index, (_, tensor) in enumerate(bucket):
            if tensor.dtype != dtype:
                by_device.setdefault(tensor.device, []).append(index)
        for device, indices in by_device.items():
            sources = [bucket[index][1] for index in indices]
            buffer = torch.empty(sum(source.numel() for source in sources), dtype=dtype, device=device)
            views = [view.view(source.shape) for view, source in
                     zip(buffer.split([source.numel() for source in sources]), sources)]
            with torch.no_grad():
                torch._foreach_copy_(views, sources)
            for index, view in zip(indices, views):
                bucket[index] = (bucket[index][0], view)
        yield bucket
