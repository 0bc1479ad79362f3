"""Rotary position embeddings as Llama, Qwen and Mistral apply them, including Llama 3's frequency scaling.

The rotation pairs dimension i with i + head_dim/2 of each head (the "rotate half"
layout of Hugging Face checkpoints, not interleaved pairs). Frequencies come from the HF
config's `rope_parameters` (rope_theta, and rope_type "llama3" with its factors when the
checkpoint has them); angles are computed in float32 for every position once.

`rotate_and_cache` also stores the step's keys and values in the paged cache: on CUDA one
Triton kernel does both (`kernels/rope_cache.py`), elsewhere the compiled rotation and two
index copies.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ember.inference.attention import kernels_support_head_dim, write_kv_cache
from ember.inference.models.layers import rotate_queries_keys

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_inverse_frequencies(head_dim: int, rope_parameters: dict) -> Tensor:
    """Inverse frequency of each rotated pair (head_dim/2,), float32, scaled as `rope_parameters` asks."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported by ember's engine (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
            f"generate with actor_rollout_ref.rollout.name=hf for this model"
        )
    base = rope_parameters["rope_theta"]
    inverse = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "llama3":
        inverse = llama3_scaled_frequencies(inverse, rope_parameters)
    return inverse


def llama3_scaled_frequencies(inverse: Tensor, rope_parameters: dict) -> Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short kept, those between interpolated."""
    factor = rope_parameters["factor"]
    low_freq_factor = rope_parameters["low_freq_factor"]
    high_freq_factor = rope_parameters["high_freq_factor"]
    original_context = rope_parameters["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inverse
    low_freq_wavelength = original_context / low_freq_factor
    high_freq_wavelength = original_context / high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inverse / factor, inverse)
    smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(between, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Cosine and sine tables for positions 0 .. max_positions-1; rotates queries and keys by position.

    The tables stay float32 whatever the model's dtype; `reset_tables` computes them on the
    module's device (needed after building on the meta device and `to_empty`).
    """

    def __init__(self, head_dim: int, max_positions: int, rope_parameters: dict) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.rope_parameters = dict(rope_parameters)
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """Fill the cos and sin tables, float32, on the device they live on."""
        if self.cos.is_meta:
            return
        device = self.cos.device
        inverse = rope_inverse_frequencies(self.head_dim, self.rope_parameters).to(device)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inverse)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def forward(self, positions: Tensor, queries: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate (tokens, heads, head_dim) queries and keys by each token's position (tokens,)."""
        return rotate_queries_keys(queries, keys, self.cos, self.sin, positions)

    def rotate_and_cache(
        self, positions: Tensor, queries: Tensor, keys: Tensor, values: Tensor, kv_cache: tuple[Tensor, Tensor],
        slot_mapping: Tensor,
    ) -> Tensor:
        """Rotate queries and keys by position, write the keys and values (tokens, kv_heads, head_dim) to their
        cache slots; returns the rotated queries (tokens, heads, head_dim)."""
        key_cache, value_cache = kv_cache
        if queries.is_cuda and kernels_support_head_dim(self.head_dim) and keys.dtype == key_cache.dtype:
            from ember.inference.kernels.rope_cache import rope_and_cache

            return rope_and_cache(queries, keys, values, self.cos, self.sin, positions, key_cache, value_cache, slot_mapping)
        queries, keys = self(positions, queries, keys)
        write_kv_cache(keys, values, key_cache, value_cache, slot_mapping)
        return queries

