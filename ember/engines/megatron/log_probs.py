"""Log-probabilities and entropy from vocabulary-parallel logits.

With tensor parallelism each rank holds logits for its slice of the vocabulary
[..., V/TP]; the log-softmax needs the maximum and the sum of exponentials over the whole
vocabulary, so both are all-reduced over the tensor-parallel group and no rank ever holds
the full [..., V] logits. At TP = 1 the group has one rank and this is the plain
computation. Entropy = log Z − Σ exp(logit)·logit / Z.

Every quantity past a reduction is computed alike on every rank, which is what lets the
reduction's backward pass its gradient through unchanged (each rank's slice of a sum gets the
sum's gradient); a rank-local use of a reduced value would need its gradient summed too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group in forward; gradients pass through unchanged (each rank's part of a sum)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group) -> Tensor:
        tensor = tensor.clone()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def vocab_parallel_log_probs(logits: Tensor, targets: Tensor, group, vocab_start: int, *,
                             compute_entropy: bool = False, entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """(log p(target), entropy or None), float32, shaped like `targets`.

    `logits` [..., V_local] hold vocabulary entries vocab_start .. vocab_start + V_local − 1
    (already divided by the temperature); `targets` are global token ids.
    """
    logits = logits.float()
    with torch.no_grad():
        local_max = logits.max(dim=-1, keepdim=True).values
        if dist.get_world_size(group) > 1:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max
    sum_exp = _AllReduceSum.apply(shifted.exp().sum(dim=-1), group)
    log_z = sum_exp.log()
    local_targets = targets - vocab_start
    in_slice = (local_targets >= 0) & (local_targets < logits.shape[-1])
    picked = shifted.gather(-1, local_targets.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _AllReduceSum.apply(picked * in_slice, group)
    log_probs = target_logit - log_z
    entropy = None
    if compute_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            source = shifted if entropy_grad else shifted.detach()
            exp = source.exp()
            # Both sums all-reduced before anything else uses them: every rank then computes the
            # same entropy from the same totals, so each rank's gradient is its own slice's.
            total = _AllReduceSum.apply(exp.sum(dim=-1), group)
            weighted = _AllReduceSum.apply((exp * source).sum(dim=-1), group)
            entropy = total.log() - weighted / total
    return log_probs, entropy
