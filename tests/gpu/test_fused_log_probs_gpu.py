"""The fused log-prob path's Triton kernels on CUDA against its PyTorch path on the same GPU:
log-probs, entropy and both gradients, with and without an entropy gradient, in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from ember.engines import fused_log_probs as fused

pytestmark = pytest.mark.gpu


def run(hidden, weight, targets, kernels: bool, monkeypatch, entropy_grad: bool):
    monkeypatch.setattr(fused, "_uses_kernels", lambda tensor: kernels)
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_probs, entropy = fused.fused_log_probs(hidden, weight, targets, temperature=0.8, compute_entropy=True,
                                               entropy_grad=entropy_grad, chunk_size=1024)
    loss = (log_probs * torch.linspace(-1, 1, len(targets), device="cuda")).sum()
    if entropy_grad:
        loss = loss + 0.3 * entropy.sum()
    loss.backward()
    return log_probs, entropy, hidden.grad, weight.grad


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_equal_the_pytorch_path(dtype, entropy_grad, monkeypatch):
    torch.manual_seed(0)
    tokens, hidden_size, vocab = 2500, 896, 151936
    hidden = torch.randn(tokens, hidden_size, device="cuda").to(dtype)
    weight = (torch.randn(vocab, hidden_size, device="cuda") * hidden_size**-0.5 * 4).to(dtype)
    # a strided view, as the padded path's targets can be (a column of input_ids)
    targets = torch.randint(0, vocab, (tokens, 3), device="cuda")[:, 1]
    expected = run(hidden, weight, targets, False, monkeypatch, entropy_grad)
    actual = run(hidden, weight, targets, True, monkeypatch, entropy_grad)
    names = ("log_probs", "entropy", "grad_hidden", "grad_weight")
    for name, got, want in zip(names, actual, expected):
        # the kernels sum in another order (fp32) and round the logits' gradient once, to the compute dtype
        tolerance = 1e-4 if name in ("log_probs", "entropy") else (2e-2 if dtype == torch.bfloat16 else 1e-4)
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance, msg=name)


def test_kernel_entropy_keeps_its_precision_for_large_peaked_logits():
    """Entropy from the row statistics within 1e-5 of float64 where the logits sit far from 0 (a row with
    logits around 2000 and one peaked token): taken as lse - Σp·z it loses about 2e-4 there."""
    from ember.engines.log_prob_kernels import row_statistics

    torch.manual_seed(0)
    logits = torch.randn(64, 151936, device="cuda") * 0.05 + 2000.0
    logits[::2, 11] += 30.0
    targets = torch.randint(0, logits.shape[1], (64,), device="cuda")
    _, logsumexp, entropy = row_statistics(logits, targets, temperature=0.7, compute_entropy=True)
    scaled = logits.double() / 0.7
    log_p = scaled - scaled.logsumexp(dim=-1, keepdim=True)
    torch.testing.assert_close(entropy.double(), -(log_p.exp() * log_p).sum(dim=-1), atol=1e-5, rtol=0)
