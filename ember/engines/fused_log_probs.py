"""Log-probabilities and entropy straight from the last hidden states, chunked over tokens,
without ever holding the [tokens, vocab] float32 logits.

The one thing to know: the LM head's matrix product is folded into the log-prob, so only a
chunk of `chunk_size` tokens' logits exists at any time, in forward and in backward alike.
For a 150k vocabulary the full float32 logits are the largest activation of a training
step (4 bytes × tokens × vocab, twice over with the softmax autograd keeps); here the step
keeps per token only the logsumexp (and the entropy when it is differentiated), and
backward recomputes each chunk's logits from the saved hidden states and weight.

The math, per token, with z = (h · Wᵀ) / T the logits at temperature T, lse = logsumexp(z),
log p = z - lse and p = softmax(z):

    log-prob   = z[target] - lse
    entropy  H = lse - Σ p·z = -Σ p·log p
    ∂ log-prob / ∂z = onehot(target) - p
    ∂ H / ∂z        = -p · (log p + H)          (= -p·(log p - Σ p log p))

and with g the incoming gradient of each output, d(raw logits) = (g_lp·(onehot - p) +
g_H·∂H/∂z) / T, from which grad_hidden = d(raw logits) · W and grad_weight = Σ over chunks of
d(raw logits)ᵀ · h. The matrix products run in the inputs' dtype (bf16 on an accelerator,
as the model's own LM head would); the softmax, logsumexp and entropy in float32, and
grad_weight is accumulated over chunks in float32 before it is cast back to the weight's
dtype. The entropy carries a gradient only with `entropy_grad` (an entropy bonus in the
loss); as a metric it is detached, and backward does no work for it.

On CUDA the softmax statistics and the logits' gradient are two Triton kernels
(`log_prob_kernels.py`) that read each chunk's logits once in the compute dtype; elsewhere
(and as their reference) the PyTorch functions below, over float32 logits.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor


def fused_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, *, temperature: float = 1.0,
                    compute_entropy: bool = False, entropy_grad: bool = False,
                    chunk_size: int = 2048) -> tuple[Tensor, Tensor | None]:
    """hidden (N, H), weight (V, H) (the lm_head weight), targets (N,) -> (log_probs (N,) fp32,
    entropy (N,) fp32 or None); differentiable w.r.t. hidden and weight without ever holding
    (N, V) fp32 logits.

    Equals `log_probs_from_logits` and `entropy_from_logits` (ember/algorithms/entropy.py) of
    the logits `(hidden @ weight.T).float() / temperature`; `chunk_size` tokens' logits are
    held at a time (smaller: less memory, more kernel launches).
    """
    _check_inputs(hidden, weight, targets, temperature, chunk_size)
    log_probs, entropy = _FusedLogProbs.apply(hidden, weight, targets, float(temperature), compute_entropy,
                                              entropy_grad and compute_entropy, chunk_size)
    return log_probs, entropy if compute_entropy else None


def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: log-probs need a temperature > 0 "
                         "(use 1.0 for greedy rollouts)")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: use at least 1 token per chunk")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: expected (tokens, hidden) "
                         "and (vocab, hidden) with the same hidden size (flatten the batch dimensions first)")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)}: expected one target id per hidden row, "
                         f"({hidden.shape[0]},)")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} and weight is {weight.dtype}: cast both to the compute dtype "
                         "(the LM head's matrix product runs in one dtype)")
    if targets.numel():  # one small sync; the kernels would read out of bounds where PyTorch raises deep inside
        lowest, highest = (int(value) for value in torch.aminmax(targets))
        if lowest < 0 or highest >= weight.shape[0]:
            raise ValueError(f"token id {highest if highest >= weight.shape[0] else lowest} is outside the LM head's "
                             f"vocabulary of {weight.shape[0]}: the tokenizer has ids the model has no row for "
                             "(resize the model's embeddings to the tokenizer, or check the data's token ids)")


_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _uses_kernels(hidden: Tensor) -> bool:
    """Whether the chunks' softmax work runs in the Triton kernels (CUDA with Triton importable)."""
    return hidden.is_cuda and _HAS_TRITON


def _chunk_statistics(hidden_chunk: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                      compute_entropy: bool, kernels: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """(log-probs, logsumexp, entropy or None) of one chunk, float32."""
    if kernels:
        from ember.engines.log_prob_kernels import row_statistics

        return row_statistics(hidden_chunk @ weight.T, targets, temperature, compute_entropy)
    logits = _chunk_logits(hidden_chunk, weight, temperature)
    logsumexp = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, targets[:, None]).squeeze(-1) - logsumexp
    return log_probs, logsumexp, _entropy(logits, logsumexp) if compute_entropy else None


def _chunk_logit_gradients(hidden_chunk: Tensor, weight: Tensor, targets: Tensor, logsumexp: Tensor,
                           grad_log_probs: Tensor | None, grad_entropy: tuple[Tensor, Tensor] | None,
                           temperature: float, kernels: bool) -> Tensor:
    """d(loss)/d(raw logits) of one chunk in the compute dtype."""
    if kernels:
        from ember.engines.log_prob_kernels import logit_gradients

        return logit_gradients(hidden_chunk @ weight.T, targets, logsumexp, grad_log_probs, grad_entropy, temperature)
    return _grad_chunk_logits(_chunk_logits(hidden_chunk, weight, temperature), logsumexp, targets, grad_log_probs,
                              grad_entropy, temperature).to(hidden_chunk.dtype)


def _chunk_logits(hidden_chunk: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """float32 logits of one chunk at `temperature`: the product in the inputs' dtype, then upcast."""
    logits = (hidden_chunk @ weight.T).float()
    return logits.div_(temperature) if temperature != 1.0 else logits


class _FusedLogProbs(torch.autograd.Function):
    """The chunked forward and backward of the module docstring."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, compute_entropy: bool,
                entropy_grad: bool, chunk_size: int) -> tuple[Tensor, Tensor | None]:
        tokens = hidden.shape[0]
        targets = targets.long().contiguous()  # the kernels index targets by row (a padded path passes a strided view)
        log_probs = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if compute_entropy else None
        kernels = _uses_kernels(hidden)
        for start in range(0, tokens, chunk_size):
            stop = min(start + chunk_size, tokens)
            chunk_log_probs, chunk_logsumexp, chunk_entropy = _chunk_statistics(
                hidden[start:stop], weight, targets[start:stop], temperature, compute_entropy, kernels)
            log_probs[start:stop], logsumexp[start:stop] = chunk_log_probs, chunk_logsumexp
            if compute_entropy:
                entropy[start:stop] = chunk_entropy
        ctx.temperature, ctx.chunk_size, ctx.entropy_grad, ctx.kernels = temperature, chunk_size, entropy_grad, kernels
        ctx.save_for_backward(hidden, weight, targets, logsumexp, entropy if entropy_grad else None)
        ctx.set_materialize_grads(False)
        if compute_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, targets, logsumexp, entropy = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropy = None
        needs_hidden, needs_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_log_probs is None and grad_entropy is None) or not (needs_hidden or needs_weight):
            return None, None, None, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, hidden.shape[0])
            hidden_chunk = hidden[start:stop]
            grad_logits = _chunk_logit_gradients(
                hidden_chunk, weight, targets[start:stop], logsumexp[start:stop],
                None if grad_log_probs is None else grad_log_probs[start:stop].float().contiguous(),
                None if grad_entropy is None else (grad_entropy[start:stop].float().contiguous(), entropy[start:stop]),
                ctx.temperature, ctx.kernels)
            if needs_hidden:
                grad_hidden[start:stop] = grad_logits @ weight
            if needs_weight:
                grad_weight += (grad_logits.T @ hidden_chunk).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _entropy(logits: Tensor, logsumexp: Tensor) -> Tensor:
    """-Σ p·log p per row of float32 `logits` (overwritten) with their `logsumexp`."""
    log_p = logits.sub_(logsumexp[:, None])
    return -(log_p.exp() * log_p).sum(dim=-1)


def _grad_chunk_logits(logits: Tensor, logsumexp: Tensor, targets: Tensor, grad_log_probs: Tensor | None,
                       grad_entropy: tuple[Tensor, Tensor] | None, temperature: float) -> Tensor:
    """d(loss)/d(raw logits) of one chunk, float32, computed in place over `logits`."""
    log_p = logits.sub_(logsumexp[:, None])
    probabilities = log_p.exp()
    scale = torch.zeros_like(logsumexp) if grad_log_probs is None else -grad_log_probs
    if grad_entropy is not None:
        grad_h, entropy = grad_entropy
        # -p·(log p + H)·g_H, folded with -p·g_lp into p·(scale - g_H·log p)
        scale = scale - grad_h * entropy
        grad = log_p.mul_(-grad_h[:, None]).add_(scale[:, None]).mul_(probabilities)
    else:
        grad = probabilities.mul_(scale[:, None])
    if grad_log_probs is not None:
        grad.scatter_add_(-1, targets[:, None], grad_log_probs[:, None])
    return grad.div_(temperature) if temperature != 1.0 else grad
