"""Hugging Face checkpoints into megatron-core models and back, through mbridge.

mbridge maps a HF config to a `TransformerConfig` and HF tensor names to megatron-core's
(splitting and merging tensor-parallel shards). ember adds three things around it:

- the layer spec: Transformer Engine's when it is installed, megatron-core's local spec
  otherwise (mbridge asks for Transformer Engine unconditionally), with its core attention on
  PyTorch's SDPA kernels (`attention.py`); which one ran is logged;
- the local spec's names: its norms are modules of their own (`input_layernorm`,
  `pre_mlp_layernorm`) where Transformer Engine fuses them into the next linear layer
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`), so they are renamed to
  the fused names before mbridge maps them;
- transformers 5 configs keep the RoPE base under `rope_parameters`; mbridge reads
  `rope_theta`, so it is copied there.

Models are built on the process's device by ember (mbridge's own builder moves them to
CUDA unconditionally), which is also what lets the CPU tests build and convert them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ember.engines.megatron.attention import sdpa_core_attention_class
from ember.engines.megatron.value_head import SCORE_BIAS, SCORE_WEIGHT, ValueHead

logger = logging.getLogger(__name__)

_LOCAL_TO_FUSED_NORM_NAMES = (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
)


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def fused_norm_name(name: str) -> str:
    """The Transformer Engine spec's name of a local-spec parameter (other names unchanged)."""
    for local, fused in _LOCAL_TO_FUSED_NORM_NAMES:
        if name.endswith(local):
            return name[: -len(local)] + fused
    return name


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
    bridge = _ember_bridge_class(_MODEL_REGISTRY[hf_config.model_type], use_te)(hf_config, dtype=dtype)
    bridge.set_extra_args(**transformer_overrides)
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
            spec = get_gpt_decoder_block_spec(self.config, use_transformer_engine=use_te, vp_stage=vp_stage)
            if not use_te:
                core_attention = sdpa_core_attention_class()
                for layer in spec.layer_specs:
                    layer.submodules.self_attention.submodules.core_attention = core_attention
            return spec

        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
            return super()._weight_name_mapping_mcore_to_hf(fused_norm_name(mcore_weights_name))

        def _weight_to_mcore_format(self, mcore_weights_name, hf_weights):
            return super()._weight_to_mcore_format(fused_norm_name(mcore_weights_name), hf_weights)

        def _weight_to_hf_format(self, mcore_weights_name, mcore_weights):
            return super()._weight_to_hf_format(fused_norm_name(mcore_weights_name), mcore_weights)

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
