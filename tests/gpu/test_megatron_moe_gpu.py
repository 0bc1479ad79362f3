"""The Megatron engine on a tiny Qwen2-MoE at TP = PP = EP = 1 on one GPU, against the FSDP2 engine and transformers
on the same HF weights.

megatron-core computes the MoE layers with its own MoELayer: a router choosing 2 of 4 experts per token, the tokens
sent to the experts by its all-to-all dispatcher (the experts a loop of MLPs without Transformer Engine, one grouped
module with it) and Qwen2-MoE's shared expert scaled by its sigmoid gate. mbridge's mapping of the weights is checked
exactly on CPU (tests/integration/test_megatron_bridge.py); these tests check what megatron-core computes with them:

- in bf16, as test_megatron_engine_gpu.py's dense comparison: log-probs, entropy and one update on the
  gradient-revealing optimizer equal the FSDP2 engine's to bf16 rounding (0.05 nats), and the exported HF folder
  (every tensor of the checkpoint, under its name) loads in transformers with the engine's log-probs;
- in fp32, where the comparison can be tight: at the default initialisation (std 0.02) the MoE parts barely move
  log-probs (renormalising the top-2 probabilities or not, or dropping the shared expert's gate, moves them by under
  0.01 nats, inside bf16's tolerance), so this model is initialised at std 0.07, where each moves them by over 0.1
  nats; with `norm_topk_prob` off (Qwen1.5-MoE's softmax before top-k) and on (the renormalised top-k), log-probs
  equal transformers', the update equals the FSDP2 engine's, and the export loads with the updated log-probs, all
  to 1e-3 nats.

Seen on one H100 (megatron-core 0.19.2 without Transformer Engine, torch 2.11): in bf16 the log-probs differ by at
most 0.002 nats before the update and 0.004 after it (which moves them by 1.2); in fp32 by 1e-6, while megatron-core's
router with the other softmax order moves them by 0.15 and without the shared expert's gate by 0.75.

The routers' load-balancing loss is off in both engines (the FSDP2 engine adds HF's only under
`output_router_logits`, mbridge builds megatron-core's routers with `moe_router_load_balancing_type="none"`), and
each test checks that, so the two losses are the same function.
"""

from pathlib import Path

import pytest
import torch
from integration.fsdp_engine_worker import GRADIENT_REVEALING_OPTIM, engine_options, make_batch, mean_log_prob_loss
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from ember.data.batch import Batch
from ember.engines.fsdp.engine import FSDPEngine
from ember.models.tiny import tiny_model_config

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.gpu

from ember.engines.megatron.bridge import unwrapped  # noqa: E402
from ember.engines.megatron.engine import MegatronEngine  # noqa: E402
from ember.engines.megatron.options import MegatronOptions  # noqa: E402
from gpu.test_megatron_engine_gpu import assert_log_probs_and_one_update_match  # noqa: E402

TOLERANCE = 0.05  # bf16, as test_megatron_engine_gpu.py
FP32_TOLERANCE = 1e-3
LARGE_INIT_STD = 0.07


def save_tiny_moe(out_dir: Path, **overrides) -> str:
    """A tiny Qwen2-MoE (vocab 128, hidden 64, 2 layers, 4 experts of width 32, top 2, a gated shared expert of
    width 64) as fp32 HF weights; `overrides` set config fields."""
    config = tiny_model_config("qwen2_moe", vocab_size=128, **overrides)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return str(out_dir)


def megatron_engine(model_dir: str, param_dtype: str) -> MegatronEngine:
    return MegatronEngine(MegatronOptions(model_path=model_dir, param_dtype=param_dtype,
                                          optim=GRADIENT_REVEALING_OPTIM))


def transformers_log_probs(model_dir: str, batch: Batch, dtype: torch.dtype) -> torch.Tensor:
    """Response log-probs of the HF folder `model_dir` in transformers, on the GPU."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids.cuda(), attention_mask=batch.attention_mask.cuda(),
                       position_ids=batch.position_ids.cuda()).logits
    log_probs = torch.log_softmax(logits[:, batch.response_prediction_positions].float(), -1)
    return log_probs.gather(-1, batch.responses.cuda().unsqueeze(-1)).squeeze(-1).cpu()


def tensor_names(model_dir: str) -> set[str]:
    names = set()
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


def assert_router_aux_loss_off(fsdp: FSDPEngine, megatron: MegatronEngine) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    assert fsdp.router_aux_coef == 0.0
    routers = [module for chunk in megatron.chunks for module in unwrapped(chunk).modules()
               if isinstance(module, TopKRouter)]
    assert len(routers) == 2  # one MoE layer per decoder layer
    assert not any(router.is_aux_loss_enabled() for router in routers)
    assert megatron.config.moe_z_loss_coeff is None


def assert_export_loads_with(engine: MegatronEngine, model_dir: str, out_dir: str, batch: Batch,
                             log_probs: torch.Tensor, dtype: torch.dtype, tolerance: float) -> None:
    """The engine's HF export holds every tensor of the checkpoint it started from and, in transformers, gives
    `log_probs` (the engine's own)."""
    engine.export_hf(out_dir)
    assert tensor_names(out_dir) == tensor_names(model_dir)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(transformers_log_probs(out_dir, batch, dtype)[mask], log_probs[mask],
                               atol=tolerance, rtol=0)


def test_moe_log_probs_and_one_update_match_the_fsdp_engine_and_the_export_loads_in_transformers(tmp_path):
    model_dir = save_tiny_moe(tmp_path / "model")
    batch = make_batch(samples=8)
    fsdp = FSDPEngine(engine_options(model_dir, param_dtype="bfloat16", optim=GRADIENT_REVEALING_OPTIM))
    megatron = megatron_engine(model_dir, "bfloat16")
    assert_router_aux_loss_off(fsdp, megatron)
    after_megatron = assert_log_probs_and_one_update_match(fsdp, megatron, batch)

    assert_export_loads_with(megatron, model_dir, str(tmp_path / "hf"), batch, after_megatron, torch.bfloat16,
                             TOLERANCE)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_routing_and_shared_expert_gate_match_transformers_and_fsdp_in_fp32(tmp_path, norm_topk_prob):
    model_dir = save_tiny_moe(tmp_path / "model", initializer_range=LARGE_INIT_STD, norm_topk_prob=norm_topk_prob)
    batch = make_batch(samples=8)
    mask = batch.response_mask.bool()
    megatron = megatron_engine(model_dir, "float32")
    assert megatron.config.moe_router_pre_softmax is not norm_topk_prob and megatron.config.moe_shared_expert_gate

    got = megatron.forward(batch, micro_batch_size=4).log_probs
    expected = transformers_log_probs(model_dir, batch, torch.float32)
    torch.testing.assert_close(got[mask], expected[mask], atol=FP32_TOLERANCE, rtol=0)

    fsdp = FSDPEngine(engine_options(model_dir, optim=GRADIENT_REVEALING_OPTIM))  # fp32 compute
    assert_router_aux_loss_off(fsdp, megatron)
    fsdp_metrics = fsdp.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    megatron_metrics = megatron.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    assert megatron_metrics["loss"] == pytest.approx(fsdp_metrics["loss"], abs=FP32_TOLERANCE)
    assert megatron_metrics["grad_norm"] == pytest.approx(fsdp_metrics["grad_norm"], rel=FP32_TOLERANCE)
    after_fsdp = fsdp.forward(batch, micro_batch_size=4).log_probs
    after_megatron = megatron.forward(batch, micro_batch_size=4).log_probs
    assert (after_megatron[mask] - got[mask]).abs().max() > 10 * TOLERANCE  # the update moved it
    torch.testing.assert_close(after_megatron[mask], after_fsdp[mask], atol=FP32_TOLERANCE, rtol=0)

    assert_export_loads_with(megatron, model_dir, str(tmp_path / "hf"), batch, after_megatron, torch.float32,
                             FP32_TOLERANCE)
