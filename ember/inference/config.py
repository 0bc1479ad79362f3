"""EngineConfig: the sizes that bound ember's generation engine (slots, tokens per step, KV cache).

The one thing to know: the KV cache is a fixed pool of `num_kv_blocks` blocks of
`block_size` tokens each, shared by all sequences. On an accelerator its size follows from
`gpu_memory_utilization` and the free memory; on CPU give `num_kv_blocks`, or leave it
None for enough blocks to hold `max_num_seqs` sequences of `max_model_len` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.inference.models.fp8 import QUANTIZATIONS


@dataclass(frozen=True)
class EngineConfig:
    """How much the engine may hold and process at once; names follow rollout.* in the config."""

    max_model_len: int = 4096
    """Longest sequence (prompt + response) in tokens; a longer request is refused."""
    max_num_seqs: int = 256
    """Most sequences decoded at once (the continuous-batching slots)."""
    max_num_batched_tokens: int = 8192
    """Most prompt tokens one prefill step processes (a longer prompt is prefilled in chunks)."""
    enable_chunked_prefill: bool = True
    """Split a prompt that does not fit the step's token budget over several steps; off, the
    budget must hold max_model_len tokens."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """KV-cache blocks; None = enough for max_num_seqs sequences of max_model_len (the most that can be in use),
    or what fits under gpu_memory_utilization on an accelerator if that is less."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the accelerator's total memory the engine may fill with its own weights and KV cache (as in vLLM:
    a colocated trainer's memory does not count, except that the cache never takes more than is free)."""
    dtype: torch.dtype = torch.bfloat16
    """Dtype of the weights and the KV cache."""
    device: str = "cpu"
    """Device the model and the KV cache live on ("cpu", "cuda", "cuda:1", ...)."""
    decode_window: int = 16
    """Decode steps run on the device between two scheduling rounds (a finished slot is refilled after the window)."""
    overlap_decode: bool = True
    """Queue each decode window behind the one running before reading that one's tokens, so the host's work
    between windows (taking in the tokens, scheduling) overlaps the device's; off, the device waits for it."""
    use_cuda_graphs: bool = True
    """On CUDA, replay each decode step as a captured graph (rollout.enforce_eager=false); ignored elsewhere."""
    tensor_parallel_size: int = 1
    """Ranks one model replica is split over (rollout.tensor_model_parallel_size): consecutive ranks of the
    process group, each holding its share of the heads and MLP width (`ember/inference/tensor_parallel.py`)."""
    fuse_projections: bool | None = None
    """Compute q/k/v and gate/up as one matrix product each (fewer kernels per step); None = on CUDA only.
    Fused weights are the engine's own: a training engine's live tensors fill them by copy, not by sharing."""
    quantization: str | None = None
    """"fp8": the decoder's projections held in FP8 e4m3 with per-output-channel scales, quantised as they load
    and at every weight sync, inputs quantised per token (rollout.quantization, `models/fp8.py`); None: in `dtype`."""

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "decode_window",
                     "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine {name}={getattr(self, name)}: set it to at least 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"engine max_num_batched_tokens={self.max_num_batched_tokens} is below max_model_len="
                f"{self.max_model_len}: without chunked prefill a sequence is prefilled in one step, so raise "
                f"max_num_batched_tokens (rollout.max_num_batched_tokens), lower max_model_len or enable chunked prefill"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"engine num_kv_blocks={self.num_kv_blocks} x block_size={self.block_size} cannot hold one "
                f"sequence of max_model_len={self.max_model_len} tokens: raise num_kv_blocks"
            )
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"engine quantization={self.quantization!r}: use one of {QUANTIZATIONS} or None")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"engine gpu_memory_utilization={self.gpu_memory_utilization}: set a fraction in (0, 1]"
            )

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)
