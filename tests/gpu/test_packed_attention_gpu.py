"""Packed micro-batches on a GPU run PyTorch's flash varlen kernel ("ember_varlen") and match padded sdpa in bf16."""

import pytest
import torch
from integration.fsdp_engine_worker import engine_options, make_batch, make_model_dir

from ember.engines.fsdp.engine import FSDPEngine
from ember.engines.varlen_attention import NAME, varlen_available

pytestmark = pytest.mark.gpu


def full(parameter: torch.Tensor) -> torch.Tensor:
    tensor = parameter.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def log_prob_and_entropy_loss(output, batch, context):
    token_loss = -output.log_probs - 0.01 * output.entropy
    return (token_loss * batch.response_mask).sum() / context.num_tokens, {}


@pytest.mark.skipif(not varlen_available(), reason="this PyTorch has no torch.nn.attention.varlen")
def test_packed_varlen_outputs_and_update_match_padded_sdpa(tmp_path):
    model_dir = make_model_dir("qwen2", str(tmp_path / "model"))
    batch = make_batch(seed=3, samples=8)
    engines = {packed: FSDPEngine(engine_options(model_dir, param_dtype="bfloat16", use_remove_padding=packed))
               for packed in (False, True)}
    assert engines[True].model.config._attn_implementation == NAME
    outputs = {packed: engine.forward(batch, 4, compute_entropy=True) for packed, engine in engines.items()}
    mask = batch.response_mask.bool().to(outputs[True].log_probs.device)
    for field in ("log_probs", "entropy"):
        packed, padded = getattr(outputs[True], field)[mask], getattr(outputs[False], field)[mask]
        torch.testing.assert_close(packed, padded, atol=3e-2, rtol=3e-2)
    before = {name: full(p).clone() for name, p in engines[True].model.named_parameters()}
    deltas = {}
    for packed, engine in engines.items():
        engine.train_mini_batch(batch, log_prob_and_entropy_loss, 4, compute_entropy=True, entropy_grad=True)
        deltas[packed] = torch.cat([(full(p) - before[name]).flatten()
                                    for name, p in engine.model.named_parameters()])
    cosine = torch.nn.functional.cosine_similarity(deltas[True], deltas[False], dim=0)
    assert cosine > 0.99, f"packed update points elsewhere than the padded one (cosine {cosine:.4f})"
