"""`use_liger` on a GPU: liger-kernel's RMSNorm, SwiGLU and RoPE replace the model's own, and the engine's
bf16 log-probs and update stay those of the unpatched model (within bf16's spread)."""

import importlib.util

import pytest
import torch
from integration.fsdp_engine_worker import engine_options, make_batch, make_model_dir, mean_log_prob_loss

from ember.engines.fsdp.engine import FSDPEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel not installed")]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_liger_kernels_replace_the_layers_and_keep_log_probs_and_the_update(arch, tmp_path):
    model_dir = make_model_dir(arch, str(tmp_path / "model"))
    batch = make_batch(seed=5, samples=8)
    engines = {liger: FSDPEngine(engine_options(model_dir, param_dtype="bfloat16", use_remove_padding=True,
                                                use_liger=liger)) for liger in (False, True)}
    patched = engines[True].module().model  # liger-kernel rebinds each instance's forward to its own
    forwards = {name: module.forward.__func__.__module__ for name, module in
                (("norm", patched.norm), ("mlp", patched.layers[0].mlp))}
    assert all(owner.startswith("liger_kernel") for owner in forwards.values()), forwards
    assert not engines[False].module().model.norm.forward.__func__.__module__.startswith("liger_kernel")
    outputs = {liger: engine.forward(batch, 4).log_probs for liger, engine in engines.items()}
    mask = batch.response_mask.bool()
    torch.testing.assert_close(outputs[True][mask], outputs[False][mask], atol=3e-2, rtol=0)
    losses = {liger: engine.train_mini_batch(batch, mean_log_prob_loss, 4)["loss"] for liger, engine in engines.items()}
    assert losses[True] == pytest.approx(losses[False], abs=3e-2)
    after = {liger: engine.forward(batch, 4).log_probs for liger, engine in engines.items()}
    assert (after[True][mask] - outputs[True][mask]).mean() > 0  # the update raised the log-probs, as without liger
    torch.testing.assert_close(after[True][mask], after[False][mask], atol=5e-2, rtol=0)
