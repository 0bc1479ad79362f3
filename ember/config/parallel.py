"""GPU counts and data-parallel sizes implied by a configuration (pure functions).

Data-parallel size is what batch sizes must divide into: the GPUs of the run divided by the
model-parallel group (TP × PP × CP for Megatron, the Ulysses sequence-parallel size for FSDP).
"""

from __future__ import annotations

import math

from ember.config.schema.megatron import MegatronConfig
from ember.config.schema.trainer import RunConfig


def world_size(trainer: RunConfig) -> int:
    """GPUs (processes) of the whole run."""
    return trainer.nnodes * trainer.n_gpus_per_node


def model_parallel_size(strategy: str, megatron: MegatronConfig | None, ulysses_sequence_parallel_size: int) -> int:
    """GPUs that hold one copy of the model's batch: TP × PP × CP (megatron) or the Ulysses size (FSDP)."""
    if strategy == "megatron" and megatron is not None:
        return megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size * megatron.context_parallel_size
    return ulysses_sequence_parallel_size


def data_parallel_size(world: int, strategy: str, megatron: MegatronConfig | None, ulysses_sequence_parallel_size: int) -> int:
    """Data-parallel ranks of a role; 0 when the model-parallel group does not divide `world`."""
    group = model_parallel_size(strategy, megatron, ulysses_sequence_parallel_size)
    if group <= 0 or world % group:
        return 0
    return world // group


def nearest_divisors(number: int, near: int, count: int = 3) -> list[int]:
    """The `count` divisors of `number` closest to `near`, ascending: the sizes a message suggests."""
    small = [candidate for candidate in range(1, math.isqrt(number) + 1) if number % candidate == 0]
    found = set(small) | {number // candidate for candidate in small}
    return sorted(sorted(found, key=lambda candidate: (abs(candidate - near), candidate))[:count])


UNEVEN_PIPELINE_FIELDS = {"num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                          "pipeline_model_parallel_layout"}
"""TransformerConfig fields that give pipeline stages unequal layer counts (megatron-core checks those itself)."""


def megatron_size_errors(key: str, megatron: MegatronConfig, heads: int, kv_heads: int, layers: int,
                         experts: int | None) -> list[str]:
    """Each Megatron size of the section at `key` that the model's shape does not allow, with the sizes that
    would: tensor parallelism splits attention heads and key-value heads, the pipeline (with its virtual
    stages) splits decoder layers evenly unless `override_transformer_config` sets uneven stages, expert
    parallelism splits the routed experts."""
    errors = []
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    for count, what in ((heads, "attention heads"), (kv_heads, "key-value heads (grouped-query attention)")):
        if count % tp:
            errors.append(f"{key}.tensor_model_parallel_size={tp} does not divide the model's {count} {what}; "
                          f"sizes that do: {', '.join(map(str, nearest_divisors(count, tp)))}")
    stages = pp * (megatron.virtual_pipeline_model_parallel_size or 1)
    uneven = set(megatron.override_transformer_config or {}) & UNEVEN_PIPELINE_FIELDS
    if layers % stages and not uneven:
        split = f"={pp}" + (f" × virtual_pipeline_model_parallel_size={megatron.virtual_pipeline_model_parallel_size}"
                            if megatron.virtual_pipeline_model_parallel_size else "")
        errors.append(f"{key}.pipeline_model_parallel_size{split} = {stages} stages do not divide the model's {layers} "
                      f"decoder layers; stage counts that do: {', '.join(map(str, nearest_divisors(layers, stages)))}")
    ep = megatron.expert_model_parallel_size
    if experts and experts % ep:
        errors.append(f"{key}.expert_model_parallel_size={ep} does not divide the model's {experts} experts; sizes "
                      f"that do: {', '.join(map(str, nearest_divisors(experts, ep)))}")
    elif not experts and ep > 1:
        errors.append(f"{key}.expert_model_parallel_size={ep}: the model has no experts (not a MoE model); set it to 1")
    return errors
