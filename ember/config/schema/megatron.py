"""Megatron-Core parallelism and memory settings of one role (actor, reference or critic).

World size = TP × PP × CP × DP for the dense layers and ETP × EP × PP × expert-DP for the
MoE layers; `ember/config/validate.py` checks that these divide the GPUs of the run.
"""

from dataclasses import dataclass
from typing import Any

from ember.config.schema.base import DType, field_


@dataclass
class MegatronConfig:
    """Parallel layout and offloading of a role trained with strategy megatron."""

    tensor_model_parallel_size: int = field_(
        1, "tensor parallel (TP) size: each layer's matrices are split over this many GPUs")
    pipeline_model_parallel_size: int = field_(1, "pipeline parallel (PP) size: the layers are split into this many stages")
    virtual_pipeline_model_parallel_size: int | None = field_(
        None, "virtual stages per PP rank for the interleaved schedule; null = not interleaved (needs PP > 1)")
    context_parallel_size: int = field_(1, "context parallel (CP) size: each sequence is split over this many GPUs")
    expert_model_parallel_size: int = field_(
        1, "expert parallel (EP) size: the experts of a MoE layer are spread over this many GPUs")
    expert_tensor_parallel_size: int | None = field_(
        None, "tensor parallel size inside each expert; null = tensor_model_parallel_size")
    sequence_parallel: bool = field_(
        True, "shard activations along the sequence in tensor-parallel regions (has effect only when TP > 1)")
    use_distributed_optimizer: bool = field_(True, "shard the optimizer state over data-parallel ranks (ZeRO-1)")
    use_dist_checkpointing: bool = field_(
        False, "load the initial weights from the Megatron checkpoint at dist_checkpointing_path instead of the HF model")
    dist_checkpointing_path: str | None = field_(
        None, "Megatron distributed checkpoint read when use_dist_checkpointing is true")
    param_dtype: DType = field_("bfloat16", "dtype of the parameters in forward and backward")
    param_offload: bool = field_(False, "keep parameters in CPU memory while the role is idle")
    grad_offload: bool = field_(False, "keep gradients in CPU memory while the role is idle")
    optimizer_offload: bool = field_(False, "keep optimizer state in CPU memory while the role is idle")
    seed: int = field_(42, "seed of Megatron's model-parallel random-number tracker")
    use_mbridge: bool = field_(
        False, "verl's switch for converting HF checkpoints with mbridge; ember always converts with mbridge, so both "
               "values mean the same")
    override_model_config: dict[str, Any] = field_(
        {}, "fields replacing those of the HF model config the Megatron model is built from (the NLA fork's "
        "Megatron files: {model_config: {use_cache: false}}), set on the HF config before conversion")
    override_transformer_config: dict[str, Any] = field_(
        {}, "extra Megatron TransformerConfig fields (e.g. recompute_method, recompute_num_layers), passed as given")
    override_ddp_config: dict[str, Any] = field_({}, "extra Megatron DistributedDataParallelConfig fields, passed as given")
    override_mcore_model_config: dict[str, Any] = field_(
        {}, "extra arguments of megatron-core's model constructor (verl's key); not applied yet: a non-empty value "
            "stops a real run")
