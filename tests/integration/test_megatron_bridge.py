"""The Megatron engine's pieces that run on a CPU: HF weights into megatron-core models and back
through mbridge (local layer spec, one gloo rank; dense and MoE models), and the errors a user can act on.

megatron-core's forward needs CUDA (its attention asks for the current CUDA device), so
log-probs, updates and checkpoints are tested in tests/gpu/test_megatron_engine_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ember.engines.megatron.options import MegatronOptions, checked_overrides
from ember.errors import UserError
from fixtures import make_tiny_model_dir

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

from ember.engines.megatron.bridge import (build_model_chunks, hf_named_weights, load_bridge,  # noqa: E402
                                           transformer_engine_name, transformer_engine_names)
from ember.engines.megatron.parallel import initialize_layout  # noqa: E402

CPU_BUILD = dict(use_cpu_initialization=True, perform_initialization=False)


@pytest.fixture(scope="module")
def one_rank():
    initialize_layout(MegatronOptions(model_path="unused").layout, seed=1)


@pytest.fixture
def moe_builds_on_cpu(monkeypatch):
    """megatron-core's all-to-all token dispatcher (mbridge's choice for MoE models) makes a CUDA stream when the
    first MoE layer is built, unless one exists: a stand-in lets a CPU build the model (its forward needs CUDA
    anyway). The dispatcher has no parameters, so the weights built are the engine's."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())


# A tied model first: mbridge edits its name tables for tied embeddings, and the untied models
# after it must not inherit that edit. Qwen2-MoE has a shared expert with a sigmoid gate; Qwen3-MoE
# has none and normalises queries and keys.
@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("qwen2", False), ("llama", False), ("qwen3", False),
                                       ("qwen2_moe", False), ("qwen3_moe", False)])
def test_hf_weights_go_into_megatron_core_and_come_back_unchanged(one_rank, moe_builds_on_cpu, tmp_path, arch, tied):
    model_dir = make_tiny_model_dir(tmp_path, arch, tie_word_embeddings=tied)
    bridge = load_bridge(str(model_dir), torch.float32, CPU_BUILD)
    chunks = build_model_chunks(bridge, vpp_size=None)
    names = {name for name, _ in chunks[0].named_parameters()}
    assert "decoder.layers.0.input_layernorm.weight" in names  # megatron-core's local spec
    if arch.endswith("_moe"):  # megatron-core's MoE layer, its experts a loop of MLPs (SequentialMLP)
        assert {"decoder.layers.1.mlp.router.weight",
                "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"} <= names
    bridge.load_weights(chunks, str(model_dir))

    exported = dict(hf_named_weights(bridge, chunks))
    original = load_file(model_dir / "model.safetensors")  # the checkpoint's names (transformers 5 fuses experts)
    expected_names = set(original) - ({"lm_head.weight"} if tied else set())
    assert set(exported) == expected_names
    for name in expected_names:
        torch.testing.assert_close(exported[name], original[name], rtol=0, atol=0, msg=name)


def test_moe_routing_and_shared_expert_gate_follow_the_hf_config(one_rank, moe_builds_on_cpu, tmp_path):
    """Qwen2-MoE's `norm_topk_prob` (renormalised top-k probabilities) is megatron-core's softmax after top-k, and its
    shared expert keeps its sigmoid gate; without Transformer Engine the experts are SequentialMLP, not the legacy
    GroupedMLP (which needs the grouped_gemm package); the routers' load-balancing loss stays off (mbridge's choice
    for RL)."""
    for norm_topk_prob in (False, True):
        model_dir = make_tiny_model_dir(tmp_path / str(norm_topk_prob), "qwen2_moe", norm_topk_prob=norm_topk_prob)
        config = load_bridge(str(model_dir), torch.float32, CPU_BUILD).config
        assert config.moe_router_pre_softmax is not norm_topk_prob
        assert config.moe_shared_expert_gate and not config.moe_shared_expert_overlap
        assert config.num_moe_experts == 4 and config.moe_router_topk == 2 and config.moe_ffn_hidden_size == 32
        assert config.moe_router_load_balancing_type == "none"
    assert not config.moe_grouped_gemm and not config.persist_layer_norm  # no Transformer Engine here
    overridden = load_bridge(str(model_dir), torch.float32, {**CPU_BUILD, "moe_router_pre_softmax": True}).config
    assert overridden.moe_router_pre_softmax  # override_transformer_config wins


def test_a_moe_model_with_dense_layers_is_refused_by_name(one_rank, tmp_path):
    model_dir = make_tiny_model_dir(tmp_path, "qwen2_moe", mlp_only_layers=[1])
    with pytest.raises(UserError, match=r"mlp_only_layers=\[1\].*use strategy fsdp"):
        load_bridge(str(model_dir), torch.float32, CPU_BUILD)


def test_local_spec_names_map_to_the_transformer_engine_names_mbridge_knows():
    assert transformer_engine_name("decoder.layers.3.input_layernorm.weight") == \
        "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert transformer_engine_name("decoder.layers.3.pre_mlp_layernorm.weight") == \
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight"
    assert transformer_engine_name("decoder.layers.3.mlp.linear_fc1.weight") == "decoder.layers.3.mlp.linear_fc1.weight"
    # A MoE layer: the norm before its router keeps its name; each expert's is the grouped module's, indexed
    # globally (this rank's first expert is expert 4 under expert parallelism).
    assert transformer_engine_name("decoder.layers.3.pre_mlp_layernorm.weight", dense_mlp=False) == \
        "decoder.layers.3.pre_mlp_layernorm.weight"
    assert transformer_engine_name("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight",
                                   first_expert=4) == "decoder.layers.3.mlp.experts.linear_fc2.weight5"
    names = {"decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.2.pre_mlp_layernorm.weight",
             "decoder.layers.0.mlp.linear_fc1.weight": "decoder.layers.2.mlp.linear_fc1.weight",
             "decoder.layers.1.pre_mlp_layernorm.weight": "decoder.layers.3.pre_mlp_layernorm.weight",
             "decoder.layers.1.mlp.router.weight": "decoder.layers.3.mlp.router.weight"}
    assert transformer_engine_names(names) == {**names,
                                               "decoder.layers.0.pre_mlp_layernorm.weight":
                                                   "decoder.layers.2.mlp.linear_fc1.layer_norm_weight"}


def test_a_model_type_mbridge_does_not_know_is_named(one_rank, tmp_path):
    model_dir = make_tiny_model_dir(tmp_path, "mistral")
    config = (model_dir / "config.json").read_text().replace('"mistral"', '"ember-unknown"')
    (model_dir / "config.json").write_text(config)
    with pytest.raises(Exception) as error:
        load_bridge(str(model_dir), torch.float32, CPU_BUILD)
    assert "ember-unknown" in str(error.value)


def test_an_unknown_transformer_config_field_is_named_with_close_names():
    from megatron.core.transformer import TransformerConfig

    assert checked_overrides({"recompute_method": "uniform"}, TransformerConfig, "key") == {"recompute_method": "uniform"}
    with pytest.raises(UserError, match=r"override_transformer_config: .* no field recompute_metod \(did you mean "
                                        r"recompute_method"):
        checked_overrides({"recompute_metod": "uniform"}, TransformerConfig,
                          "actor_rollout_ref.actor.megatron.override_transformer_config")


def test_ddp_fields_and_dtype_names_in_override_transformer_config_reach_megatron_core_as_it_takes_them(caplog):
    """NLA's Megatron recipe writes DDP fields, `params_dtype: bfloat16` and a layer count beside selective
    recompute under override_transformer_config; each reaches megatron-core where it acts, and DDP settings
    ember cannot honour stop the run."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from ember.engines.megatron.options import field_names, resolved_for_megatron_core

    def resolve(transformer=None, ddp=None, **options):
        return resolved_for_megatron_core(
            MegatronOptions(model_path="unused", override_transformer_config=transformer or {},
                            override_ddp_config=ddp or {}, **options),
            field_names(TransformerConfig), field_names(DistributedDataParallelConfig))

    given = {"bf16": True, "params_dtype": "bfloat16", "pipeline_dtype": "bf16", "recompute_granularity": "selective",
             "recompute_method": "block", "recompute_num_layers": 1, "use_distributed_optimizer": True,
             "overlap_grad_reduce": False, "overlap_param_gather": False}
    with caplog.at_level("WARNING"):
        resolved = resolve(given, {"overlap_param_gather": False, "bucket_size": 1 << 20})
    assert "recompute_num_layers=1 is dropped" in caplog.text
    assert resolved.override_ddp_config == {"overlap_grad_reduce": False, "overlap_param_gather": False,
                                            "bucket_size": 1 << 20}  # the optimizer switch stays the role's
    transformer = checked_overrides(resolved.override_transformer_config, TransformerConfig, "key")
    assert transformer == {"bf16": True, "params_dtype": torch.bfloat16, "pipeline_dtype": torch.bfloat16,
                           "recompute_granularity": "selective", "recompute_method": "block"}
    TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, **transformer)  # megatron-core takes it

    with pytest.raises(UserError, match="use_distributed_optimizer=False in megatron's override_transformer_config "
                                        "or override_ddp_config contradicts megatron.use_distributed_optimizer=True"):
        resolve({"use_distributed_optimizer": False})
    with pytest.raises(UserError, match="contradicts megatron.use_distributed_optimizer=False"):
        resolve(ddp={"use_distributed_optimizer": True}, use_distributed_optimizer=False)
    with pytest.raises(UserError, match="override_transformer_config.overlap_grad_reduce=True contradicts "
                                        "megatron.override_ddp_config.overlap_grad_reduce=False; give it once"):
        resolve({"overlap_grad_reduce": True}, {"overlap_grad_reduce": False})
    with pytest.raises(UserError, match="overlap_param_gather=true defers the parameters' all-gather"):
        resolve({"overlap_param_gather": True})
    with pytest.raises(UserError, match="key.params_dtype: unknown dtype 'bfloat61'"):
        checked_overrides({"params_dtype": "bfloat61"}, TransformerConfig, "key")


def test_a_second_layout_in_one_process_is_refused(one_rank):
    layout = dict(MegatronOptions(model_path="unused").layout, tensor_model_parallel_size=2)
    with pytest.raises(UserError, match="different parallel layouts"):
        initialize_layout(layout, seed=1)


@pytest.mark.parametrize("tied", [True, False])
def test_a_critic_keeps_the_backbone_takes_a_saved_value_head_and_exports_a_value_model(one_rank, tmp_path, tied):
    from transformers import AutoModelForTokenClassification

    from ember.engines.megatron.checkpoint import _export_value_model
    from ember.engines.megatron.value_head import attach_value_head
    from ember.models.value_model import value_model_config

    model_dir = make_tiny_model_dir(tmp_path, "qwen2", tie_word_embeddings=tied)
    critic_dir = tmp_path / "critic"
    config = value_model_config(AutoModelForCausalLM.from_pretrained(model_dir).config)
    torch.manual_seed(3)
    saved = AutoModelForTokenClassification.from_pretrained(model_dir, config=config)
    with torch.no_grad():
        saved.score.bias.fill_(0.25)  # a trained head's bias, not the zero it starts at
    saved.save_pretrained(critic_dir)

    bridge = load_bridge(str(critic_dir), torch.float32, CPU_BUILD)
    (chunk,) = build_model_chunks(bridge, vpp_size=None)
    chunk.output_layer = None
    bridge.load_weights([chunk], str(critic_dir))
    attach_value_head(chunk, bridge.hf_config, str(critic_dir), seed=0)
    torch.testing.assert_close(chunk.output_layer.weight, saved.score.weight, rtol=0, atol=0)
    torch.testing.assert_close(chunk.output_layer.bias, saved.score.bias, rtol=0, atol=0)

    _export_value_model(str(tmp_path / "export"), bridge, [chunk])
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "export")
    assert exported.config.num_labels == 1
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_a_critic_from_a_causal_lm_starts_its_head_as_transformers_would(one_rank, tmp_path):
    from ember.engines.megatron.value_head import attach_value_head

    model_dir = make_tiny_model_dir(tmp_path, "llama")
    bridge = load_bridge(str(model_dir), torch.float32, CPU_BUILD)
    (chunk,) = build_model_chunks(bridge, vpp_size=None)
    chunk.output_layer = None
    bridge.load_weights([chunk], str(model_dir))
    attach_value_head(chunk, bridge.hf_config, str(model_dir), seed=0)
    weight = chunk.output_layer.weight
    assert weight.shape == (1, bridge.hf_config.hidden_size)
    assert 0.5 * bridge.hf_config.initializer_range < weight.std().item() < 2 * bridge.hf_config.initializer_range


def test_the_layout_is_built_again_in_a_new_process_group(one_rank):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    layout = MegatronOptions(model_path="unused").layout
    before = mpu.get_data_parallel_group()
    dist.destroy_process_group()  # what a library caller does between two runs in one process
    initialize_layout(layout, seed=1)
    after = mpu.get_data_parallel_group()
    assert after is not before and dist.get_world_size(after) == 1



def test_a_missing_psutil_is_named_with_the_install_line(monkeypatch):
    """megatron-core's checkpoint writer needs psutil and, without it, leaves a multi-rank save waiting forever."""
    import sys

    from ember.engines.megatron.options import MegatronUnavailable, import_megatron

    monkeypatch.setitem(sys.modules, "psutil", None)
    with pytest.raises(MegatronUnavailable, match=r"needs megatron-core, mbridge and psutil .*pip install 'ember\[megatron\]'"):
        import_megatron()
