"""ember's own model implementations for its generation engine: the Llama family and Qwen's MoE models."""

from ember.inference.models.decoder import (
    DENSE_MODEL_TYPES,
    MOE_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    DecoderForCausalLM,
    DecoderSpec,
)
from ember.inference.models.moe import SparseMoeBlock, route_tokens
from ember.inference.models.weights import build_model, load_hf_config, load_weights, read_safetensors

__all__ = [
    "DENSE_MODEL_TYPES",
    "MOE_MODEL_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "DecoderForCausalLM",
    "DecoderSpec",
    "SparseMoeBlock",
    "build_model",
    "load_hf_config",
    "load_weights",
    "read_safetensors",
    "route_tokens",
]
