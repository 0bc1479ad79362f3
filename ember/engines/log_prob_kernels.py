"""Triton kernels for the fused log-prob path on CUDA: one pass over a chunk's logits each way.

`fused_log_probs` computes each chunk's logits with the LM head's matrix product in the
compute dtype; the PyTorch path then upcasts them to float32 and makes about ten passes
over that [chunk, vocab] float32 tensor (logsumexp, gather, the entropy's softmax, and
backward's softmax, scaling and cast). These kernels read the compute-dtype logits once:

    `row_statistics`: per row an online logsumexp (running max, rescaled sums of exp(z) and
    of exp(z - max)·(z - max)), giving lse, the target's log-prob and the entropy
    lse - Σp·z, taken about the row's max so large logits lose no precision;
    `logit_gradients`: per (row, vocab block) d(loss)/d(raw logits) from lse (and H), written
    straight in the compute dtype for the two gradient matrix products.

The math is that of `fused_log_probs`' docstring, in float32; they must equal its PyTorch
path within float32 summation order (tests/gpu compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096
_FAR_BELOW = tl.constexpr(-1.0e30)  # a finite "minus infinity": exp(_FAR_BELOW - m) is 0 without inf - inf


@triton.jit
def _row_statistics_kernel(
    logits_ptr, targets_ptr, log_probs_ptr, logsumexp_ptr, entropy_ptr, row_stride, vocab, temperature,
    COMPUTE_ENTROPY: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_start = logits_ptr + row * row_stride
    lanes = tl.arange(0, BLOCK_SIZE)
    running_max = tl.full([BLOCK_SIZE], _FAR_BELOW, tl.float32)
    exp_sum = tl.zeros([BLOCK_SIZE], tl.float32)
    weighted_sum = tl.zeros([BLOCK_SIZE], tl.float32)
    for start in range(0, vocab, BLOCK_SIZE):
        columns = start + lanes
        valid = columns < vocab
        z = tl.load(row_start + columns, mask=valid, other=0.0).to(tl.float32) / temperature
        z = tl.where(valid, z, _FAR_BELOW)
        new_max = tl.maximum(running_max, z)
        rescale = tl.exp(running_max - new_max)
        exponentials = tl.where(valid, tl.exp(z - new_max), 0.0)
        if COMPUTE_ENTROPY:  # Σ exp(z - m)·(z - m) about the lane's max m, moved to the new max first
            shifted_sum = weighted_sum + (running_max - new_max) * exp_sum
            weighted_sum = shifted_sum * rescale + exponentials * tl.where(valid, z - new_max, 0.0)
        exp_sum = exp_sum * rescale + exponentials
        running_max = new_max
    row_max = tl.max(running_max, 0)
    lane_scale = tl.exp(running_max - row_max)
    total = tl.sum(exp_sum * lane_scale, 0)
    logsumexp = row_max + tl.log(total)
    target = tl.load(targets_ptr + row).to(tl.int64)
    target_logit = tl.load(row_start + target).to(tl.float32) / temperature
    tl.store(log_probs_ptr + row, target_logit - logsumexp)
    tl.store(logsumexp_ptr + row, logsumexp)
    if COMPUTE_ENTROPY:
        # H = lse - Σp·z = log(total) - Σ exp(z - M)·(z - M) / total about the row's max M: no
        # difference of two large numbers when the logits are large.
        centred_sum = tl.sum((weighted_sum + (running_max - row_max) * exp_sum) * lane_scale, 0)
        tl.store(entropy_ptr + row, tl.log(total) - centred_sum / total)


@triton.jit
def _logit_gradients_kernel(
    logits_ptr, grads_ptr, targets_ptr, logsumexp_ptr, grad_log_probs_ptr, grad_entropy_ptr, entropy_ptr,
    row_stride, grad_row_stride, vocab, temperature,
    HAS_LOG_PROB_GRAD: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    valid = columns < vocab
    z = tl.load(logits_ptr + row * row_stride + columns, mask=valid, other=0.0).to(tl.float32) / temperature
    log_p = z - tl.load(logsumexp_ptr + row)
    probabilities = tl.exp(log_p)
    grad_log_prob = 0.0
    if HAS_LOG_PROB_GRAD:
        grad_log_prob = tl.load(grad_log_probs_ptr + row)
    scale = -grad_log_prob
    if HAS_ENTROPY_GRAD:
        grad_entropy = tl.load(grad_entropy_ptr + row)
        scale = scale - grad_entropy * tl.load(entropy_ptr + row)
        grad = probabilities * (scale - grad_entropy * log_p)
    else:
        grad = probabilities * scale
    target = tl.load(targets_ptr + row).to(tl.int64)
    grad = tl.where(columns == target, grad + grad_log_prob, grad) / temperature
    tl.store(grads_ptr + row * grad_row_stride + columns, grad.to(grads_ptr.dtype.element_ty), mask=valid)


def row_statistics(logits: Tensor, targets: Tensor, temperature: float,
                   compute_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log-prob of each row's target, logsumexp, entropy or None), float32, of `logits / temperature`
    for raw logits (rows, vocab) in any float dtype."""
    rows, vocab = logits.shape
    log_probs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    logsumexp = torch.empty_like(log_probs)
    entropy = torch.empty_like(log_probs) if compute_entropy else None
    _row_statistics_kernel[(rows,)](
        logits, targets, log_probs, logsumexp, entropy if compute_entropy else log_probs, logits.stride(0), vocab,
        temperature, COMPUTE_ENTROPY=compute_entropy, BLOCK_SIZE=BLOCK, num_warps=8,
    )
    return log_probs, logsumexp, entropy


def logit_gradients(logits: Tensor, targets: Tensor, logsumexp: Tensor, grad_log_probs: Tensor | None,
                    grad_entropy: tuple[Tensor, Tensor] | None, temperature: float) -> Tensor:
    """d(loss)/d(raw logits) (rows, vocab) in the logits' dtype, written over `logits`, from the incoming
    gradients of the log-probs and (with the saved entropy) of the entropy; the math of
    `fused_log_probs._grad_chunk_logits`."""
    rows, vocab = logits.shape
    grads = logits  # in place: each program reads its block of logits before writing the block's gradient
    placeholder = logsumexp
    _logit_gradients_kernel[(rows, triton.cdiv(vocab, BLOCK))](
        logits, grads, targets, logsumexp,
        grad_log_probs if grad_log_probs is not None else placeholder,
        grad_entropy[0] if grad_entropy is not None else placeholder,
        grad_entropy[1] if grad_entropy is not None else placeholder,
        logits.stride(0), grads.stride(0), vocab, temperature,
        HAS_LOG_PROB_GRAD=grad_log_probs is not None, HAS_ENTROPY_GRAD=grad_entropy is not None,
        BLOCK_SIZE=BLOCK, num_warps=8,
    )
    return grads
