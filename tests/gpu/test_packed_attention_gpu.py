"""Packed micro-batches on a GPU run PyTorch's flash varlen kernel ("ember_varlen"): in bf16 their outputs
are as close to a float32 forward as padded sdpa's and their update points where padded sdpa's does, and
a packed batch's `max_length` lets the kernel cover its longest sequence."""

import pytest
import torch
from integration.fsdp_engine_worker import engine_options, make_batch, make_model_dir

from ember.data.batch import Batch
from ember.data.packing import pack_batch
from ember.engines.fsdp.engine import FSDPEngine
from ember.engines.varlen_attention import NAME, varlen_available

pytestmark = pytest.mark.gpu

SPREAD_FRACTION = 0.05  # bf16 outputs must lie within this fraction of the reference values' range


def full(parameter: torch.Tensor) -> torch.Tensor:
    tensor = parameter.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def log_prob_and_entropy_loss(output, batch, context):
    token_loss = -output.log_probs - 0.01 * output.entropy
    return (token_loss * batch.response_mask).sum() / context.num_tokens, {}


@pytest.mark.skipif(not varlen_available(), reason="this PyTorch has no torch.nn.attention.varlen")
def test_packed_varlen_outputs_and_update_match_padded_sdpa(tmp_path):
    """bf16 log-probs and entropies, packed and padded, against a float32 padded forward, within a
    twentieth of the spread of the reference values: a random tiny model's entropies all lie within
    about 0.014 of log(128), so a fixed tolerance of a few hundredths would pass a constant."""
    model_dir = make_model_dir("qwen2", str(tmp_path / "model"))
    batch = make_batch(seed=3, samples=8)
    engines = {packed: FSDPEngine(engine_options(model_dir, param_dtype="bfloat16", use_remove_padding=packed))
               for packed in (False, True)}
    assert engines[True].model.config._attn_implementation == NAME
    outputs = {packed: engine.forward(batch, 4, compute_entropy=True) for packed, engine in engines.items()}
    reference = FSDPEngine(engine_options(model_dir)).forward(batch, 4, compute_entropy=True)
    mask = batch.response_mask.bool().to(reference.log_probs.device)
    for field in ("log_probs", "entropy"):
        expected = getattr(reference, field)[mask]
        tolerance = SPREAD_FRACTION * float(expected.max() - expected.min())
        for packed, output in outputs.items():
            label = f"{field}, {'packed' if packed else 'padded'}"
            torch.testing.assert_close(getattr(output, field)[mask], expected, atol=tolerance, rtol=0,
                                       msg=lambda text, label=label: f"{label}: {text}")
    before = {name: full(p).clone() for name, p in engines[True].model.named_parameters()}
    deltas = {}
    for packed, engine in engines.items():
        engine.train_mini_batch(batch, log_prob_and_entropy_loss, 4, compute_entropy=True, entropy_grad=True)
        deltas[packed] = torch.cat([(full(p) - before[name]).flatten()
                                    for name, p in engine.model.named_parameters()])
    cosine = torch.nn.functional.cosine_similarity(deltas[True], deltas[False], dim=0)
    assert cosine > 0.99, f"packed update points elsewhere than the padded one (cosine {cosine:.4f})"


@pytest.mark.skipif(not varlen_available(), reason="this PyTorch has no torch.nn.attention.varlen")
def test_grouped_query_heads_match_sdpa_per_sequence():
    """7 query heads per key/value head (Qwen2.5-0.5B's grouping) through ember_varlen, whichever way this
    PyTorch takes them (enable_gqa, grouped heads passed through, or repeated): outputs and the
    gradients of queries, keys and values equal causal sdpa run on each sequence alone."""
    from ember.engines.varlen_attention import register, varlen_attention_forward

    register()
    torch.manual_seed(0)
    lengths = [5, 130, 64, 1]
    shapes = {"query": (1, 14, sum(lengths), 64), "key": (1, 2, sum(lengths), 64), "value": (1, 2, sum(lengths), 64)}
    inputs = {name: torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for name, shape in shapes.items()}
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    module = torch.nn.Module().eval()
    packed, _ = varlen_attention_forward(module, *inputs.values(), None, cu_seq_lens_q=cu, max_length_q=max(lengths))
    packed_grads = torch.autograd.grad(packed.float().square().sum(), list(inputs.values()))

    pieces = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        q, k, v = (tensor[:, :, start:end] for tensor in inputs.values())
        pieces.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    expected = torch.cat(pieces, dim=2).transpose(1, 2)  # (1, T, heads, dim), as the attention returns
    expected_grads = torch.autograd.grad(expected.float().square().sum(), list(inputs.values()))
    torch.testing.assert_close(packed, expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(packed_grads, expected_grads):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.skipif(not varlen_available(), reason="this PyTorch has no torch.nn.attention.varlen")
def test_a_packed_batchs_max_length_covers_its_longest_sequence():
    """The flash varlen kernel is launched over ceil(max_length / block) row blocks per sequence, so a
    packed batch whose `max_length` fell short of its longest sequence would leave that sequence's last
    rows uncomputed. Here the longest of four samples has 129 tokens (one past any power-of-two block
    up to 128) and goes through ember_varlen with `pack_batch`'s own keywords: outputs and gradients equal
    causal sdpa on each sequence alone. Values have mean 1, so uncomputed rows (zeros or stale memory)
    cannot pass for the outputs, which are averages of values near 1."""
    from ember.engines.varlen_attention import register, varlen_attention_forward

    register()
    prompt_lengths, response_lengths = [3, 100, 40, 1], [2, 29, 24, 1]
    batch = Batch.from_rollout([list(range(3, 3 + n)) for n in prompt_lengths],
                               [list(range(3, 3 + n)) for n in response_lengths], pad_token_id=0)
    packed = pack_batch(batch)
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    assert packed.cu_seqlens.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    attention_kwargs = {key: value.cuda() if isinstance(value, torch.Tensor) else value
                        for key, value in packed.attention_kwargs().items()}
    total = sum(lengths)
    torch.manual_seed(0)
    inputs = {"query": torch.randn(1, 14, total, 64, device="cuda", dtype=torch.bfloat16),
              "key": torch.randn(1, 2, total, 64, device="cuda", dtype=torch.bfloat16),
              "value": torch.randn(1, 2, total, 64, device="cuda", dtype=torch.bfloat16) * 0.5 + 1.0}
    inputs = {name: tensor.requires_grad_() for name, tensor in inputs.items()}
    module = torch.nn.Module().eval()
    output, _ = varlen_attention_forward(module, *inputs.values(), None, **attention_kwargs)
    grads = torch.autograd.grad(output.float().square().sum(), list(inputs.values()))

    pieces = []
    for start, end in zip(packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist()):
        q, k, v = (tensor[:, :, start:end] for tensor in inputs.values())
        pieces.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    expected = torch.cat(pieces, dim=2).transpose(1, 2)
    expected_grads = torch.autograd.grad(expected.float().square().sum(), list(inputs.values()))
    torch.testing.assert_close(output, expected, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
