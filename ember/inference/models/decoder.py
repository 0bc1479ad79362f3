"""ember's own decoder forward for Llama 2/3, SmolLM2, Qwen2/2.5, Qwen3, Mistral, Qwen2-MoE and Qwen3-MoE.

These models differ in a few switches, read from the HF config by `DecoderSpec`: bias on
the q/k/v (and o) projections, RMSNorm of each query and key head (Qwen3), sliding-window
layers, which layers have a sparse mixture-of-experts MLP (`moe.py`). Modules carry the
checkpoint's parameter names (`model.layers.0.self_attn.q_proj.weight`, ...), so HF weights
and the training engine's tensors load by name.

The forward works on flat tokens (all sequences of a step concatenated, no padding) with
their positions, and reads and writes the paged KV cache through `ember.inference.attention`.

`fuse_projections` (on CUDA by default, `EngineConfig.fuse_projections`) computes q/k/v and
gate/up as one matrix product each: a decode step is launch-bound, so fewer, larger kernels
are faster. The checkpoint's names stay; their parameters become views of the fused weights.
With FP8 generation (`fp8.py`) the same projections are `Fp8Linear`s, fused the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from ember.inference.attention import AttentionInputs, paged_attention
from ember.inference.models.fp8 import linear
from ember.inference.models.layers import MLP, RMSNorm, fuse_linears, output_projection
from ember.inference.models.moe import SparseMoeBlock
from ember.inference.models.rope import RotaryEmbedding
from ember.inference.models.vocab_parallel import VocabParallelEmbedding, VocabParallelHead
from ember.inference.models.weight_shards import WeightShards
from ember.inference.request import SamplingParams
from ember.inference.tensor_parallel import TensorParallel

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES


@dataclass(frozen=True)
class DecoderSpec:
    """The architecture switches of one checkpoint, read from its HF config."""

    qkv_bias: bool
    """q, k and v projections have a bias (Qwen2; Llama/Qwen3 with attention_bias)."""
    output_bias: bool
    """The attention output projection has a bias (Llama/Qwen3 with attention_bias)."""
    mlp_bias: bool
    """The MLP projections have biases (Llama with mlp_bias)."""
    query_key_norm: bool
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    sliding_windows: tuple[int | None, ...]
    """Per layer: attention window in tokens, or None for full causal attention."""
    sparse_layers: tuple[bool, ...]
    """Per layer: the MLP is a sparse mixture of experts (MoE models, by decoder_sparse_step and mlp_only_layers)."""
    shared_expert: bool
    """Sparse MLPs add a shared expert scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> DecoderSpec:
        model_type = config.model_type
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"model_type {model_type!r} is not supported by ember's engine (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); use actor_rollout_ref.rollout.name=hf for this model"
            )
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r}: ember's engine implements silu only")
        attention_bias = getattr(config, "attention_bias", False)
        layers = range(config.num_hidden_layers)
        if model_type in ("mistral", "qwen3_moe"):  # one window for every layer, None when unused
            windows = tuple(config.sliding_window for _ in layers)
        else:
            layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
            windows = tuple(config.sliding_window if kind == "sliding_attention" else None for kind in layer_types)
        sparse_layers = tuple(
            model_type in MOE_MODEL_TYPES
            and config.num_experts > 0
            and index not in config.mlp_only_layers
            and (index + 1) % config.decoder_sparse_step == 0
            for index in layers
        )
        return cls(
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and config.qkv_bias) or attention_bias,
            output_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=getattr(config, "mlp_bias", False),
            query_key_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_windows=windows,
            sparse_layers=sparse_layers,
            shared_expert=model_type == "qwen2_moe",
        )


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding,
                 tensor_parallel: TensorParallel) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // tensor_parallel.size  # this rank's heads
        self.num_kv_heads = tensor_parallel.local_kv_heads(config.num_key_value_heads)
        self.head_dim = head_dim_of(config)
        self.sliding_window = spec.sliding_windows[layer_index]
        self.rotary = rotary
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = output_projection(self.num_heads * self.head_dim, hidden, spec.output_bias,
                                        split=tensor_parallel.size > 1)
        if spec.query_key_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.query_key_norm = spec.query_key_norm
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("qkv_weight_scale", None, persistent=False)

    def fuse_projections(self) -> list[str]:
        """Compute q, k and v in one matrix product from now on; returns the parameters that became views."""
        self.qkv_weight, self.qkv_bias, self.qkv_weight_scale, views = fuse_linears(self, ("q_proj", "k_proj", "v_proj"))
        return views

    def _project(self, states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (tokens, heads, head_dim), keys and values (tokens, kv_heads, head_dim) of `states`."""
        if self.qkv_weight is None:
            queries, keys, values = self.q_proj(states), self.k_proj(states), self.v_proj(states)
        else:
            kv_width = self.num_kv_heads * self.head_dim
            projected = linear(states, self.qkv_weight, self.qkv_bias, self.qkv_weight_scale)
            queries, keys, values = projected.split([self.num_heads * self.head_dim, kv_width, kv_width], dim=-1)
        return (queries.unflatten(-1, (self.num_heads, self.head_dim)), keys.unflatten(-1, (self.num_kv_heads, self.head_dim)),
                values.unflatten(-1, (self.num_kv_heads, self.head_dim)))

    def forward(self, states: Tensor, positions: Tensor, kv_cache: tuple[Tensor, Tensor], inputs: AttentionInputs) -> Tensor:
        queries, keys, values = self._project(states)
        if self.query_key_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        key_cache, value_cache = kv_cache
        queries = self.rotary.rotate_and_cache(positions, queries, keys, values, kv_cache, inputs.slot_mapping)
        attended = paged_attention(queries, key_cache, value_cache, inputs, self.head_dim**-0.5, self.sliding_window)
        return self.o_proj(attended.flatten(1).to(states.dtype))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks, each added to the residual stream (under tensor parallelism
    each block's partial output summed over the replica's ranks first)."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding,
                 tensor_parallel: TensorParallel) -> None:
        super().__init__()
        self.tensor_parallel = tensor_parallel
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, spec, layer_index, rotary, tensor_parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if spec.sparse_layers[layer_index]:
            self.mlp = SparseMoeBlock(config, spec.shared_expert, tensor_parallel.size)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size // tensor_parallel.size, spec.mlp_bias,
                           split=tensor_parallel.size > 1)

    def forward(
        self, states: Tensor, residual: Tensor | None, positions: Tensor, kv_cache: tuple[Tensor, Tensor],
        inputs: AttentionInputs,
    ) -> tuple[Tensor, Tensor]:
        """(this layer's MLP output, the residual stream before it): the next layer (or the final norm) adds them."""
        if residual is None:
            residual, normed = states, self.input_layernorm(states)
        else:
            normed, residual = self.input_layernorm.add_and_norm(states, residual)
        attended = self.tensor_parallel.sum_partials(self.self_attn(normed, positions, kv_cache, inputs))
        normed, residual = self.post_attention_layernorm.add_and_norm(attended, residual)
        return self.tensor_parallel.sum_partials(self.mlp(normed)), residual


class DecoderBody(nn.Module):
    """Embedding, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, max_positions: int,
                 tensor_parallel: TensorParallel) -> None:
        super().__init__()
        rotary = RotaryEmbedding(head_dim_of(config), max_positions, config.rope_parameters)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tensor_parallel)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, index, rotary, tensor_parallel)
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = rotary


@dataclass(frozen=True)
class EmbeddingEdits:
    """NLA's injected vectors for one forward: rows of the flat token list whose embedding output is
    replaced by (or, where `additive`, added to) the vector of the same index."""

    rows: Tensor  # [k] long
    vectors: Tensor  # [k, hidden]
    additive: Tensor  # [k] bool

    def apply(self, states: Tensor) -> Tensor:
        vectors = self.vectors.to(states.dtype)
        current = states[self.rows]
        states[self.rows] = torch.where(self.additive[:, None], current + vectors, vectors)
        return states


class DecoderForCausalLM(nn.Module):
    """A decoder-only LM (dense or MoE): flat token ids and positions in, hidden states out; `logits` for chosen rows."""

    def __init__(self, config: PretrainedConfig, max_positions: int,
                 tensor_parallel: TensorParallel = TensorParallel()) -> None:
        """config: the checkpoint's HF config; max_positions: longest sequence the RoPE tables cover;
        tensor_parallel: the replica this rank's part belongs to (`ember/inference/tensor_parallel.py`)."""
        super().__init__()
        self.config = config
        self.spec = DecoderSpec.from_hf_config(config)
        self.tensor_parallel = tensor_parallel
        tensor_parallel.check_divides(config.num_attention_heads, config.num_key_value_heads,
                                      split_widths(config, self.spec))
        self.weight_shards = WeightShards(tensor_parallel.size, tensor_parallel.rank, config.num_key_value_heads,
                                          config.vocab_size)
        """How this rank cuts whole weights as they load (`weight_shards.py`)."""
        self.model = DecoderBody(config, self.spec, max_positions, tensor_parallel)
        self.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, tensor_parallel)
        self.tie_weights()
        self.fused_parameters: frozenset[str] = frozenset()
        """Parameters that are views of a fused weight (`fuse_projections`): filled in place, never rebound."""

    def fuse_projections(self) -> None:
        """q/k/v and gate/up (dense MLPs and shared experts) each one matrix product from now on."""
        fused = set()
        for name, module in self.named_modules():
            if isinstance(module, (Attention, MLP)):
                fused.update(f"{name}.{parameter}" for parameter in module.fuse_projections())
        self.fused_parameters = frozenset(fused)

    def tie_weights(self) -> None:
        """Make the output projection the embedding itself when the config ties them (again after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_kv_heads(self) -> int:
        """Key-value heads this rank holds (and caches)."""
        return self.tensor_parallel.local_kv_heads(self.config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    def forward(
        self, token_ids: Tensor, positions: Tensor, kv_cache: list[tuple[Tensor, Tensor]], inputs: AttentionInputs,
        injected: EmbeddingEdits | None = None,
    ) -> Tensor:
        """Final hidden states (tokens, hidden) of the step's flat tokens; writes their keys and values to the cache.
        `injected` rewrites some tokens' embedding outputs first (NLA, prefill only; under tensor parallelism
        after the embedding's all-reduce, so every rank writes the vector over the whole embedding)."""
        states, residual = self.model.embed_tokens(token_ids), None
        if injected is not None:
            states = injected.apply(states)
        for layer, layer_cache in zip(self.model.layers, kv_cache, strict=True):
            states, residual = layer(states, residual, positions, layer_cache, inputs)
        return self.model.norm.add_and_norm(states, residual)[0]

    def logits(self, hidden_states: Tensor) -> Tensor:
        """Next-token logits (rows, vocab) in the model's dtype (sampling reads them in float32); under tensor
        parallelism gathered from every rank's vocabulary rows, the same whole logits on every rank."""
        return self.lm_head(hidden_states)

    def sample(self, hidden_states: Tensor, sampling: SamplingParams, seeds: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's next token and its rollout log-prob (`VocabParallelHead.sample`: under tensor parallelism
        without gathering the logits)."""
        return self.lm_head.sample(hidden_states, sampling, seeds, positions)


def split_widths(config: PretrainedConfig, spec: DecoderSpec) -> dict[str, int]:
    """The MLP widths tensor parallelism splits, by what they are: the dense MLP's where a layer is dense,
    each expert's and the shared expert's where one is sparse."""
    widths = {}
    if not all(spec.sparse_layers):
        widths["MLP width (intermediate_size)"] = config.intermediate_size
    if any(spec.sparse_layers):
        widths["expert MLP width (moe_intermediate_size)"] = config.moe_intermediate_size
        if spec.shared_expert:
            widths["shared expert width (shared_expert_intermediate_size)"] = config.shared_expert_intermediate_size
    return widths


def head_dim_of(config: PretrainedConfig) -> int:
    """Per-head size: the config's head_dim, or hidden_size / heads where the config has none (Qwen2)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
