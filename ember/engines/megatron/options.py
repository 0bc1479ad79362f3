"""What the Megatron engine needs, resolved from a role's `megatron` section.

Kept free of megatron-core imports, so that a config can be checked (and a missing
megatron-core reported) before anything heavy loads. `transformer_overrides` is where every
`override_transformer_config` field is checked against megatron-core's `TransformerConfig`:
an unknown field stops the run naming it, instead of being dropped.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from ember.engines.optim import OptimOptions
from ember.errors import UserError

logger = logging.getLogger(__name__)

ROLES = ("actor", "critic", "ref", "reconstructor")
INSTALL_HINT = ("pip install 'ember[megatron]' (megatron-core ≥ 0.16, mbridge, einops, psutil; Transformer Engine is "
                "optional: without it ember uses megatron-core's local layer spec)")


class MegatronUnavailable(UserError):
    """strategy megatron was asked for and megatron-core (or mbridge) cannot be imported."""


@dataclass(frozen=True)
class MegatronOptions:
    """One role's Megatron engine: the model, its parallel layout, precision and optimizer."""

    model_path: str
    """Hugging Face checkpoint directory to start from (converted by mbridge)."""
    role: str = "actor"
    """"actor", "critic" and "reconstructor" (NLA's critic: a hidden state at each sample's last token) train;
    "ref" only computes log-probs."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = True
    """Shard activations along the sequence in tensor-parallel regions (acts only when TP > 1)."""
    use_distributed_optimizer: bool = True
    param_dtype: str = "bfloat16"
    """dtype of forward and backward (bf16/fp16 keep fp32 master weights in the optimizer)."""
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    seed: int = 42
    """Seed of megatron-core's model-parallel random-number tracker."""
    use_remove_padding: bool = False
    """Run each micro-batch on its real tokens only, in one row (megatron-core's THD format, `model_inputs.py`)."""
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    """TransformerConfig fields set as given (recompute_method, recompute_granularity, ...)."""
    override_ddp_config: dict[str, Any] = field(default_factory=dict)
    """DistributedDataParallelConfig fields set as given."""
    override_model_config: dict[str, Any] = field(default_factory=dict)
    """HF config fields set before conversion (`{model_config: {...}}`, the NLA fork's form, or flat)."""
    optim: OptimOptions = field(default_factory=OptimOptions)
    injection_mode: str = "replace"
    """NLA: how a batch's activation vectors enter the actor's embedding output (`megatron/injection.py`)."""
    output_layer_index: int | None = None
    """NLA reconstructor: the `hidden_states` index it predicts from (None or -1: the last)."""
    truncate_at_layer: int | None = None
    """NLA reconstructor: build and load only the first this many decoder layers (None: all)."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"engine role {self.role!r}: choose one of {ROLES}")

    @property
    def trains(self) -> bool:
        return self.role != "ref"

    @property
    def layout(self) -> dict[str, int | None]:
        """The parallel sizes as megatron-core's `initialize_model_parallel` names them."""
        return dict(tensor_model_parallel_size=self.tensor_model_parallel_size,
                    pipeline_model_parallel_size=self.pipeline_model_parallel_size,
                    virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
                    context_parallel_size=self.context_parallel_size,
                    expert_model_parallel_size=self.expert_model_parallel_size,
                    expert_tensor_parallel_size=self.expert_tensor_parallel_size)


def megatron_options(model_path: str, role: str, megatron_cfg, optim: OptimOptions | None,
                     use_remove_padding: bool = False, injection_mode: str = "replace",
                     output_layer_index: int | None = None, truncate_at_layer: int | None = None) -> MegatronOptions:
    """MegatronOptions from a role's `megatron` config section (ember/config/schema/megatron.py), its model
    section's `use_remove_padding` and, in an NLA run, `nla.injection.mode` (actor, reference) or the
    reconstructor's layer index and cut."""
    return MegatronOptions(
        model_path=model_path, role=role,
        tensor_model_parallel_size=megatron_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=megatron_cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=megatron_cfg.virtual_pipeline_model_parallel_size,
        context_parallel_size=megatron_cfg.context_parallel_size,
        expert_model_parallel_size=megatron_cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=megatron_cfg.expert_tensor_parallel_size,
        sequence_parallel=megatron_cfg.sequence_parallel,
        use_distributed_optimizer=megatron_cfg.use_distributed_optimizer,
        param_dtype=megatron_cfg.param_dtype, param_offload=megatron_cfg.param_offload,
        grad_offload=megatron_cfg.grad_offload, optimizer_offload=megatron_cfg.optimizer_offload,
        seed=megatron_cfg.seed, use_remove_padding=use_remove_padding,
        override_transformer_config=dict(megatron_cfg.override_transformer_config or {}),
        override_ddp_config=dict(megatron_cfg.override_ddp_config or {}),
        override_model_config=dict(megatron_cfg.override_model_config or {}),
        optim=optim or OptimOptions(), injection_mode=injection_mode, output_layer_index=output_layer_index,
        truncate_at_layer=truncate_at_layer)


def field_names(config_class: type) -> set[str]:
    """The field names of the dataclass `config_class`."""
    return {item.name for item in dataclasses.fields(config_class)}


def checked_overrides(overrides: dict[str, Any], config_class: type, key: str) -> dict[str, Any]:
    """`overrides` when every name is a field of the dataclass `config_class`, with dtype names made dtypes
    (`dtypes_resolved`); else a UserError naming the unknown fields, the key they came from and a few close
    field names."""
    known = field_names(config_class)
    unknown = sorted(set(overrides) - known)
    if unknown:
        import difflib

        hints = {name: difflib.get_close_matches(name, known, n=3) for name in unknown}
        described = "; ".join(f"{name}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                              for name, close in hints.items())
        raise UserError(f"{key}: megatron-core's {config_class.__name__} has no field {described}; "
                        "remove it or correct its name")
    return dtypes_resolved(overrides, config_class, key)


def resolved_for_megatron_core(options: MegatronOptions, transformer_fields: set[str], ddp_fields: set[str],
                               ) -> MegatronOptions:
    """`options` with two spellings run files carry (NLA's Megatron recipe has both) put the way megatron-core
    takes them, and DDP settings ember cannot honour refused:
    - `override_transformer_config` names that are DistributedDataParallelConfig fields and not
      TransformerConfig ones (`overlap_grad_reduce`, `overlap_param_gather`, `use_distributed_optimizer`) move
      to `override_ddp_config`; a field given in both with different values stops the run naming both.
    - `use_distributed_optimizer`, in either spelling, must agree with the role's `megatron.use_distributed_optimizer`
      (the optimizer is built from that switch; a DDP config that disagreed would reduce-scatter gradients a
      whole-model optimizer then steps on).
    - `overlap_param_gather: true` is refused: it defers the parameters' all-gather to the next forward, and
      ember reads the parameters right after the optimizer step (weight sync, save, export).
    - `recompute_num_layers` beside `recompute_granularity: selective` is dropped with a warning: selective
      recompute covers every layer and megatron-core refuses the pair."""
    transformer = dict(options.override_transformer_config)
    moved = {name: transformer.pop(name) for name in list(transformer)
             if name in ddp_fields and name not in transformer_fields}
    given = dict(options.override_ddp_config)
    for name in sorted(set(moved) & set(given)):
        if moved[name] != given[name]:
            raise UserError(f"megatron.override_transformer_config.{name}={moved[name]} contradicts "
                            f"megatron.override_ddp_config.{name}={given[name]}; give it once")
    ddp = {**moved, **given}
    distributed = ddp.pop("use_distributed_optimizer", options.use_distributed_optimizer)
    if bool(distributed) != options.use_distributed_optimizer:
        raise UserError(f"use_distributed_optimizer={distributed} in megatron's override_transformer_config or "
                        f"override_ddp_config contradicts megatron.use_distributed_optimizer="
                        f"{options.use_distributed_optimizer}; give it once, as megatron.use_distributed_optimizer")
    if ddp.get("overlap_param_gather"):
        raise UserError("megatron overlap_param_gather=true defers the parameters' all-gather to the next forward, but "
                        "ember reads them right after each optimizer step (weight sync to the rollout, checkpoints, "
                        "export); set it to false")
    if transformer.get("recompute_granularity") == "selective" and transformer.get("recompute_num_layers") is not None:
        if _first_rank():
            logger.warning("%s: megatron.override_transformer_config.recompute_num_layers=%s is dropped: "
                           "recompute_granularity=selective recomputes part of every layer, and megatron-core refuses "
                           "a layer count with it; remove the key (or use recompute_granularity=full)", options.role,
                           transformer["recompute_num_layers"])
        transformer.pop("recompute_num_layers")
    return dataclasses.replace(options, override_transformer_config=transformer, override_ddp_config=ddp)


def layout_settings(options: MegatronOptions, transformer_engine: bool) -> dict[str, Any]:
    """TransformerConfig fields the parallel layout implies, beneath the user's `override_transformer_config`:
    - `sequence_parallel` as the role asks, at tensor-parallel size > 1 and only with Transformer Engine's
      layer spec (the local spec's norm refuses it; sequence parallelism saves activation memory and
      changes no result, so without Transformer Engine it is turned off with a warning);
    - `variable_seq_lengths` at pipeline size > 1: micro-batches differ in width and sample count (token
      budgets, trimmed padding, a short last one), so the stages exchange each one's shape first."""
    tensor_parallel = options.tensor_model_parallel_size > 1
    sequence_parallel = options.sequence_parallel and tensor_parallel
    if sequence_parallel and not transformer_engine:
        if _first_rank():
            logger.warning("%s: megatron.sequence_parallel=true is turned off: megatron-core's local layer spec (used "
                           "without Transformer Engine) has no sequence-parallel norm; install transformer-engine to "
                           "shard activations along the sequence, or set sequence_parallel: false", options.role)
        sequence_parallel = False
    return {"sequence_parallel": sequence_parallel,
            **({"variable_seq_lengths": True} if options.pipeline_model_parallel_size > 1 else {})}


def dtypes_resolved(overrides: dict[str, Any], config_class: type, key: str) -> dict[str, Any]:
    """`overrides` with each value of a torch.dtype field given as a name ("bfloat16", "bf16", "fp32", ...; YAML
    files such as NLA's Megatron recipe write `params_dtype: bfloat16`) turned into the dtype."""
    from ember.models.loading import resolve_dtype

    resolved = dict(overrides)
    for item in dataclasses.fields(config_class):
        value = resolved.get(item.name)
        if isinstance(value, str) and "torch.dtype" in str(item.type):  # torch.dtype, Optional[torch.dtype]
            try:
                resolved[item.name] = resolve_dtype(value)
            except ValueError as error:
                raise UserError(f"{key}.{item.name}: {error}") from None
    return resolved


def _first_rank() -> bool:
    """Where a warning every rank would repeat is logged (`distributed.device.rank`, imported late: this module
    loads no torch)."""
    from ember.distributed.device import rank

    return rank() == 0


def import_megatron():
    """megatron.core, or a MegatronUnavailable saying how to install it."""
    try:
        import mbridge  # noqa: F401
        import megatron.core
        import psutil  # noqa: F401  (megatron-core's checkpoint writer needs it, and hangs the run without it)
    except ImportError as error:
        raise MegatronUnavailable(f"strategy megatron needs megatron-core, mbridge and psutil ({error}); "
                                  f"{INSTALL_HINT}") from None
    return megatron.core
