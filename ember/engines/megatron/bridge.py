"""Hugging Face checkpoints into megatron-core models and back, through mbridge.

mbridge maps a HF config to a `TransformerConfig` and HF tensor names to megatron-core's
(splitting and merging tensor-parallel shards). ember adds these things around it:

- the layer spec: Transformer Engine's when it is installed, megatron-core's local spec
  otherwise (mbridge asks for Transformer Engine unconditionally), with its core attention on
  PyTorch's SDPA kernels (`attention.py`); which one ran is logged;
- the local spec's names, renamed to Transformer Engine's before mbridge maps them: its norms
  are modules of their own (`input_layernorm`, `pre_mlp_layernorm`) where Transformer Engine
  fuses them into the next linear layer (`linear_qkv.layer_norm_weight`,
  `linear_fc1.layer_norm_weight`), except before a MoE layer's router, where both specs keep
  `pre_mlp_layernorm`; its experts are a loop of MLPs (`experts.local_experts.{i}.linear_fc1`,
  SequentialMLP) where Transformer Engine's are one grouped module (`experts.linear_fc1.weight{i}`);
- settings mbridge gets wrong or that cannot run here (`ember_settings`: MoE routing and
  shared-expert gate, the local spec's experts and norms);
- transformers 5 configs keep the RoPE base under `rope_parameters`; mbridge reads
  `rope_theta`, so it is copied there.

Models are built on the process's device by ember (mbridge's own builder moves them to
CUDA unconditionally), which is also what lets the CPU tests build and convert them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ember.engines.megatron.attention import sdpa_core_attention_class
from ember.engines.megatron.value_head import SCORE_BIAS, SCORE_WEIGHT, ValueHead

logger = logging.getLogger(__name__)

_INPUT_NORM = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
_PRE_MLP_NORM = ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
_DENSE_MLP = "mlp.linear_fc1.weight"
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def transformer_engine_name(name: str, dense_mlp: bool = True, first_expert: int = 0) -> str:
    """The Transformer Engine spec's name of a local-spec parameter, the one mbridge's tables know
    (other names unchanged). `dense_mlp`: whether the parameter's layer has a dense MLP, whose
    `linear_fc1` takes the pre-MLP norm (a MoE layer's norm stays `pre_mlp_layernorm`);
    `first_expert`: the global index of this rank's first expert (expert parallelism)."""
    local, fused = _INPUT_NORM
    if name.endswith(local):
        return name[: -len(local)] + fused
    local, fused = _PRE_MLP_NORM
    if name.endswith(local):
        return name[: -len(local)] + fused if dense_mlp else name
    expert = _LOCAL_EXPERT.search(name)
    if expert:
        index, linear = expert.groups()
        return f"{name[: expert.start()]}.mlp.experts.{linear}.weight{first_expert + int(index)}"
    return name


def transformer_engine_names(names: dict[str, str], first_expert: int = 0) -> dict[str, str]:
    """`names` (a chunk's local → global parameter names) with every global name as
    `transformer_engine_name` gives it; a layer is dense when it has `mlp.linear_fc1.weight`."""
    dense_layers = {name.removesuffix(_DENSE_MLP) for name in names.values() if name.endswith(_DENSE_MLP)}
    return {local: transformer_engine_name(name, dense_mlp=name.removesuffix(_PRE_MLP_NORM[0]) in dense_layers,
                                           first_expert=first_expert)
            for local, name in names.items()}


def ember_settings(hf_config, moe: bool, use_te: bool) -> dict:
    """TransformerConfig fields where mbridge's own choice is wrong or cannot run here, set
    beneath the user's `override_transformer_config`.

    - Without Transformer Engine, no persistent layer-norm kernel (`persist_layer_norm`, which
      mbridge turns on for MoE models): the local spec's torch norm refuses it.

    MoE models (`moe`: mbridge's config has experts) only:

    - Qwen2-MoE's and Qwen3-MoE's routers renormalise their top-k probabilities when
      `norm_topk_prob` is set: megatron-core's softmax after top-k (`moe_router_pre_softmax`
      off) is exactly that, its softmax before top-k is the unnormalised form. mbridge ties the
      choice to the model type instead (Qwen2-MoE pre-softmax, Qwen3-MoE not).
    - Qwen2-MoE scales its shared expert by sigmoid(`shared_expert_gate`); mbridge maps the
      gate's weight but leaves megatron-core's gate (`moe_shared_expert_gate`) off, which drops it.
    - The shared expert runs before the router on the main stream (`moe_shared_expert_overlap`
      off): the overlap, which mbridge turns on, creates a CUDA stream when the model is built
      and only hides expert-parallel all-to-all communication.
    - Without Transformer Engine the experts are SequentialMLP (`moe_grouped_gemm` off):
      the local spec's grouped experts are megatron-core's legacy GroupedMLP, which needs the
      grouped_gemm package and whose weights mbridge cannot name.
    """
    settings = {} if use_te else {"persist_layer_norm": False}
    if not moe:
        return settings
    settings["moe_shared_expert_overlap"] = False
    if hf_config.model_type in ("qwen2_moe", "qwen3_moe"):
        settings["moe_router_pre_softmax"] = not hf_config.norm_topk_prob
    if hf_config.model_type == "qwen2_moe":
        settings["moe_shared_expert_gate"] = True
    if not use_te:
        settings["moe_grouped_gemm"] = False
    return settings


def load_bridge(model_path: str, dtype: torch.dtype, transformer_overrides: dict, hf_overrides: dict | None = None):
    """An mbridge bridge for the HF model at `model_path`, set up for the current parallel state.

    `transformer_overrides` are TransformerConfig fields set on top of mbridge's mapping;
    `hf_overrides` are HF config fields set before it (`{model_config: {...}}` or flat).
    """
    import mbridge  # noqa: F401  (registers the model bridges)
    from mbridge.core.bridge import _MODEL_REGISTRY
    from transformers import AutoConfig

    from ember.errors import UserError

    hf_config = AutoConfig.from_pretrained(model_path)
    hf_overrides = hf_overrides or {}
    for key, value in (hf_overrides.get("model_config", hf_overrides) or {}).items():
        setattr(hf_config, key, value)
    if getattr(hf_config, "rope_theta", None) is None and getattr(hf_config, "rope_parameters", None):
        hf_config.rope_theta = hf_config.rope_parameters["rope_theta"]
    if hf_config.model_type not in _MODEL_REGISTRY:
        raise UserError(f"{model_path}: mbridge cannot convert model type {hf_config.model_type!r} to megatron-core; "
                        f"it knows {', '.join(sorted(_MODEL_REGISTRY))} (or use strategy fsdp)")
    use_te = transformer_engine_available()
    logger.info("megatron: %s layer spec", "Transformer Engine" if use_te else "megatron-core local with SDPA attention (no Transformer Engine)")
    dense_layers, sparse_step = getattr(hf_config, "mlp_only_layers", None), getattr(hf_config, "decoder_sparse_step", 1)
    if dense_layers or sparse_step != 1:
        raise UserError(f"{model_path}: a MoE model with dense layers among its MoE layers (mlp_only_layers="
                        f"{dense_layers}, decoder_sparse_step={sparse_step}) is not converted by mbridge, which makes "
                        "every layer MoE; use strategy fsdp")
    bridge = _ember_bridge_class(_MODEL_REGISTRY[hf_config.model_type], use_te)(hf_config, dtype=dtype)
    moe = bool(bridge.config.num_moe_experts)
    bridge.set_extra_args(**{**ember_settings(hf_config, moe, use_te), **transformer_overrides})
    if moe and bridge.mpu.tp_size > 1 and not transformer_overrides.get("sequence_parallel"):
        # megatron-core's MoE layer refuses to train split over tensor-parallel ranks without it (at the first update)
        raise UserError(f"megatron: a MoE model at tensor_model_parallel_size={bridge.mpu.tp_size} needs sequence "
                        "parallelism (megatron-core's MoE layer), which "
                        + ("sequence_parallel: false turns off; set it to true" if use_te else
                           "needs Transformer Engine; install transformer-engine") +
                        ", or set tensor_model_parallel_size: 1 (and scale with expert parallelism)")
    if not use_te and moe and bridge.mpu.etp_size != bridge.mpu.tp_size:
        # mbridge sends expert weights over the expert-tensor-parallel group only under their
        # Transformer Engine names; the local spec's go over the tensor-parallel group.
        raise UserError(f"megatron: without Transformer Engine a MoE model's experts are split like the dense layers: "
                        f"set expert_tensor_parallel_size to tensor_model_parallel_size ({bridge.mpu.tp_size}) or "
                        f"null, not {bridge.mpu.etp_size}, or install Transformer Engine")
    return bridge


def _ember_bridge_class(bridge_class: type, use_te: bool) -> type:
    """`bridge_class` with ember's layer-spec choice and local-spec names.

    mbridge's bridges edit their name tables in place for tied embeddings (on the class, so
    one tied model would change every later untied one in the process); here each instance
    edits its own copies.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    class EmberBridge(bridge_class):
        def __init__(self, *args, **kwargs):
            for table in ("_DIRECT_MAPPING", "_ATTENTION_MAPPING", "_MLP_MAPPING", "_OTHER_MAPPING"):
                if hasattr(bridge_class, table):
                    setattr(self, table, dict(getattr(bridge_class, table)))
            super().__init__(*args, **kwargs)

        def _get_transformer_layer_spec(self, vp_stage=None):
            self.has_vp_stage = True  # megatron-core >= 0.16 takes vp_stage; mbridge's own override sets this flag
            spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=use_te, vp_stage=vp_stage)
            if not use_te:
                core_attention = sdpa_core_attention_class()
                for layer in spec.layer_specs:
                    layer.submodules.self_attention.submodules.core_attention = core_attention
            return spec

        def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True) -> dict[str, str]:
            # Every global name mbridge maps (to HF names, across expert-parallel ranks) comes from here.
            names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep)
            experts = self.config.num_moe_experts
            first_expert = self.mpu.ep_rank * (experts // self.mpu.ep_size) if experts and consider_ep else 0
            return transformer_engine_names(names, first_expert)

    return EmberBridge


def build_model_chunks(bridge, vpp_size: int | None) -> list[nn.Module]:
    """The GPTModel chunks this rank holds (one per virtual pipeline stage), with HF-initialised
    weights still to be loaded (`bridge.load_weights`)."""
    from megatron.core import parallel_state as mpu

    provider = bridge._model_provider([])
    stages = vpp_size or 1
    chunks = []
    for stage in range(stages):
        pre_process = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage) if vpp_size else \
            mpu.is_pipeline_first_stage()
        post_process = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage) if vpp_size else \
            mpu.is_pipeline_last_stage()
        chunk = provider(pre_process=pre_process, post_process=post_process,
                         **({"vp_stage": stage} if vpp_size else {}))
        chunks.append(chunk)
    return chunks


def hf_named_weights(bridge, chunks: list[nn.Module]) -> Iterator[tuple[str, Tensor]]:
    """Every full weight under its HF name (tensor-, pipeline- and expert-parallel shards
    gathered); every rank must consume the whole iterator (gathers are collectives). A value
    head (a critic's) is not an LM weight mbridge knows: `value_head.py` names it."""
    with without_value_heads(chunks) as heads:
        yield from bridge.export_weights(chunks)
    for head in heads:
        yield SCORE_WEIGHT, head.weight.detach()
        yield SCORE_BIAS, head.bias.detach()


@contextmanager
def without_value_heads(chunks: list[nn.Module]) -> Iterator[list[nn.Module]]:
    """The chunks without their value heads for the block (mbridge maps LM weights only); yields
    the heads taken out, put back after."""
    taken = []
    for chunk in chunks:
        model = unwrapped(chunk)
        if isinstance(getattr(model, "output_layer", None), ValueHead):
            taken.append((model, model.output_layer))
            model.output_layer = None
    try:
        yield [head for _, head in taken]
    finally:
        for model, head in taken:
            model.output_layer = head


def unwrapped(chunk: nn.Module) -> nn.Module:
    """The GPTModel inside megatron-core's DDP and Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
