"""The fused, chunked log-prob and entropy equal the unfused reference (full float32 logits),
in value and in gradient, and keep nothing of size tokens × vocab for backward."""

import pytest
import torch

from ember.algorithms.entropy import entropy_from_logits
from ember.engines.fused_log_probs import fused_log_probs

TOKENS, HIDDEN, VOCAB = 37, 16, 96  # 37 is prime: most chunk sizes leave a short last chunk


def _inputs(dtype=torch.float32, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(TOKENS, HIDDEN, generator=generator)).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    # Fixed incoming gradients of both outputs, so each term of the backward is weighted differently.
    grad_log_probs = torch.randn(TOKENS, generator=generator)
    grad_entropy = torch.randn(TOKENS, generator=generator)
    return hidden, weight, targets, grad_log_probs, grad_entropy


def _reference(hidden, weight, targets, temperature, compute_entropy, entropy_grad):
    """The unfused path: full float32 logits, log_softmax, and ember's entropy."""
    logits = (hidden @ weight.T).float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    entropy = None
    if compute_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return log_probs, entropy


def _values_and_grads(function, hidden, weight, targets, grad_log_probs, grad_entropy, **options):
    hidden, weight = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    log_probs, entropy = function(hidden, weight, targets, **options)
    loss = (log_probs * grad_log_probs).sum()
    if entropy is not None and entropy.requires_grad:
        loss = loss + (entropy * grad_entropy).sum()
    loss.backward()
    return log_probs.detach(), None if entropy is None else entropy.detach(), hidden.grad, weight.grad


def _fused(hidden, weight, targets, *, temperature, compute_entropy, entropy_grad, chunk_size=8):
    return fused_log_probs(hidden, weight, targets, temperature=temperature, compute_entropy=compute_entropy,
                           entropy_grad=entropy_grad, chunk_size=chunk_size)


def _assert_all_close(actual, expected, atol, rtol):
    for name, got, want in zip(("log_probs", "entropy", "grad_hidden", "grad_weight"), actual, expected):
        if want is None:
            assert got is None, name
            continue
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_size", [1, 5, 37, 64])  # 5 leaves a remainder; 37 is one chunk; 64 > tokens
def test_log_probs_and_gradients_equal_unfused_reference(temperature, chunk_size):
    inputs = _inputs(scale=0.5)  # logits of a few units: a softmax far from uniform
    options = dict(temperature=temperature, compute_entropy=False, entropy_grad=False)
    fused = _values_and_grads(_fused, *inputs, chunk_size=chunk_size, **options)
    reference = _values_and_grads(_reference, *inputs, **options)
    assert fused[1] is None
    _assert_all_close(fused, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_entropy_and_its_gradient_equal_unfused_reference(temperature, entropy_grad):
    inputs = _inputs(scale=0.5)
    options = dict(temperature=temperature, compute_entropy=True, entropy_grad=entropy_grad)
    fused = _values_and_grads(_fused, *inputs, chunk_size=6, **options)
    reference = _values_and_grads(_reference, *inputs, **options)
    _assert_all_close(fused, reference, atol=1e-5, rtol=1e-5)


def test_entropy_gradient_alone():
    """Only the entropy in the loss (no log-prob term): the backward must still produce its gradient."""
    hidden, weight, targets, _, grad_entropy = _inputs(scale=0.5)
    zero = torch.zeros(TOKENS)
    options = dict(temperature=1.3, compute_entropy=True, entropy_grad=True)
    fused = _values_and_grads(_fused, hidden, weight, targets, zero, grad_entropy, **options)
    reference = _values_and_grads(_reference, hidden, weight, targets, zero, grad_entropy, **options)
    assert fused[2].abs().sum() > 0
    _assert_all_close(fused, reference, atol=1e-5, rtol=1e-5)


def test_entropy_without_entropy_grad_carries_no_gradient():
    hidden, weight, targets, *_ = _inputs()
    log_probs, entropy = fused_log_probs(hidden, weight, targets, compute_entropy=True, chunk_size=8)
    assert log_probs.requires_grad and not entropy.requires_grad
    _, bonus = fused_log_probs(hidden, weight, targets, compute_entropy=True, entropy_grad=True, chunk_size=8)
    assert bonus.requires_grad
    torch.testing.assert_close(entropy, bonus.detach())


def _relative_error(got, want):
    """‖got - want‖ / ‖want‖: bf16 rounds each element by up to 2⁻⁸ of its size, so a sum of
    rounded products may differ a lot where it nearly cancels; the whole tensor's error may not."""
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_bf16_inputs_match_fp32_reference_within_bf16_tolerance():
    hidden, weight, targets, grad_log_probs, grad_entropy = _inputs(scale=0.5)
    options = dict(temperature=0.8, compute_entropy=True, entropy_grad=True)
    fused = _values_and_grads(_fused, hidden.bfloat16(), weight.bfloat16(), targets, grad_log_probs,
                              grad_entropy, chunk_size=7, **options)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == torch.float32
    assert fused[2].dtype == torch.bfloat16 and fused[3].dtype == torch.bfloat16
    reference = _values_and_grads(_reference, hidden, weight, targets, grad_log_probs, grad_entropy, **options)
    _assert_all_close(fused[:2], reference[:2], atol=5e-2, rtol=2e-2)
    for got, want in zip(fused[2:], reference[2:]):
        assert _relative_error(got, want) < 2e-2
    # The same computation unfused in bf16 (logits of a bf16 product, upcast): the values are
    # the same float32 arithmetic; the gradients differ by bf16 rounding of the products only.
    unfused_bf16 = _values_and_grads(_reference, hidden.bfloat16(), weight.bfloat16(), targets, grad_log_probs,
                                     grad_entropy, **options)
    _assert_all_close(fused[:2], unfused_bf16[:2], atol=1e-5, rtol=1e-5)
    for got, want in zip(fused[2:], unfused_bf16[2:]):
        assert _relative_error(got, want) < 1e-2


def test_backward_keeps_nothing_of_size_tokens_by_vocab():
    hidden, weight, targets, *_ = _inputs()

    def saved_shapes(function):
        shapes = []

        def pack(tensor):
            shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            log_probs, entropy = function(hidden, weight, targets, temperature=0.9, compute_entropy=True,
                                          entropy_grad=True)
        (log_probs.sum() + entropy.sum()).backward()
        return shapes

    # The hook sees what the unfused path keeps: its (N, V) logits, so the check below can fail.
    assert (TOKENS, VOCAB) in saved_shapes(_reference)
    fused_shapes = saved_shapes(_fused)
    assert fused_shapes and (TOKENS, VOCAB) not in fused_shapes
    assert all(shape[-1] != VOCAB for shape in fused_shapes)
    assert max(torch.Size(shape).numel() for shape in fused_shapes) <= max(TOKENS, VOCAB) * HIDDEN


def test_invalid_arguments_fail_with_what_to_change():
    hidden, weight, targets, *_ = _inputs()
    with pytest.raises(ValueError, match="temperature > 0"):
        fused_log_probs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_log_probs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="same hidden size"):
        fused_log_probs(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="one target id per hidden row"):
        fused_log_probs(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="cast both"):
        fused_log_probs(hidden, weight.bfloat16(), targets)
    too_large = targets.clone()
    too_large[3] = weight.shape[0]
    with pytest.raises(ValueError, match=f"token id {weight.shape[0]} is outside the LM head's vocabulary"):
        fused_log_probs(hidden, weight, too_large)
    with pytest.raises(ValueError, match="token id -1 is outside"):
        fused_log_probs(hidden, weight, targets - targets - 1)
