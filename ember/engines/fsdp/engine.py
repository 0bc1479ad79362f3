"""The FSDP2 training engine: one HF model sharded over all ranks, behind `TrainEngine`.

Every rank holds 1/N of the parameters, gradients and optimizer state (FSDP2 over a 1-D
mesh of all ranks, which is also the data-parallel group). A process without torchrun
variables is a one-rank world and runs the very same code. Roles: "actor" (log-probs,
trains), "critic" (values from a scalar head, trains), "ref" (log-probs only), "reconstructor"
(NLA's critic: a hidden state read at each sample's last token, trains). A batch that carries
NLA activation vectors and injection positions has them injected in the actor's and the
reference's forwards (`engines/injection.py`).

Every rank must make the same calls with batches split into the same number of
micro-batches, because each forward and backward gathers and reduces shards collectively.
With a fixed micro-batch size the engine checks that count across ranks and stops with an
error rather than hang; with a token budget it plans every rank with the largest count any
rank needs, and trims each micro-batch of the padding columns none of its samples use.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ember.data.batch import Batch
from ember.distributed.determinism import enable_full_determinism
from ember.distributed.device import current_device, device_type, init_distributed, world_size
from ember.engines.base import LossFn, MicroBatchSpec, ModelOutput, TrainEngine
from ember.engines.batching import in_buckets, in_dtype_buckets, join_outputs, loss_context, micro_batches
from ember.engines.expert_load import ExpertLoad, load_metrics
from ember.engines.fsdp.checkpoint import checkpoint_problem, export_hf_model, load_checkpoint, save_checkpoint
from ember.engines.fsdp.gather import gathered_buckets
from ember.engines.fsdp.model_init import build_sharded_model
from ember.engines.fsdp.offload import CPU, move_optimizer_state, move_parameters
from ember.engines.host_copies import HostCopies
from ember.engines.injection import injecting
from ember.engines.log_probs import compute_response_log_probs
from ember.engines.lora import (LoraOptions, adapters_disabled, is_adapter_name, layer_tensor_names, lora_scales,
                                merged_layers, write_adapter_folder)
from ember.engines.optim import OptimOptions, build_lr_scheduler, build_optimizer
from ember.engines.varlen_attention import packed_attention_implementation
from ember.models.loading import resolve_dtype
from ember.models.reconstructor import compute_reconstruction, trained_parameters
from ember.models.value_model import compute_response_values
from ember.profiling import phase

ROLES = ("actor", "critic", "ref", "reconstructor")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """What the FSDP engine needs: the model, its role, precision, sharding and optimizer."""

    model_path: str
    """Hugging Face checkpoint directory (or hub id) to start from; a causal LM, or a value model for a critic."""
    role: str = "actor"
    """"actor" and "critic" train; "ref" only computes log-probs (no optimizer); "reconstructor" is
    NLA's critic: the model's hidden state at one layer, at each sample's last token."""
    model_dtype: str = "float32"
    """dtype the sharded parameters are stored and updated in (the master weights)."""
    param_dtype: str = "bfloat16"
    """dtype forward and backward compute in (FSDP mixed precision); equal to model_dtype disables casting."""
    reduce_dtype: str = "float32"
    """dtype gradients are reduced across ranks in."""
    attn_implementation: str = "sdpa"
    """Hugging Face attention kernel: "sdpa", "eager", "flash_attention_2", ..."""
    enable_gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward to save memory."""
    use_remove_padding: bool = False
    """Run each micro-batch on its real tokens only, packed in one row (ember/data/packing.py)."""
    use_fused_kernels: bool = False
    """Log-probs and entropy from the last hidden states, chunked, without fp32 logits (actor and ref)."""
    reshard_after_forward: bool = True
    """Free gathered layer weights after forward (re-gather in backward): less memory, more communication."""
    param_offload: bool = False
    """`offload()` moves the parameter shards to CPU memory."""
    optimizer_offload: bool = False
    """`offload()` moves the optimizer state to CPU memory."""
    offload_policy: bool = False
    """FSDP2's CPUOffloadPolicy: shards, gradients and the optimizer step stay in CPU memory at all
    times (each layer is copied to the accelerator to compute); param/optimizer_offload then have
    nothing left to move."""
    full_determinism: bool = False
    """Deterministic kernels for this process (`fsdp_config.full_determinism`, distributed/determinism.py)."""
    use_liger: bool = False
    """liger-kernel's Triton RMSNorm, SwiGLU and RoPE in place of the model's own (`parallelize.apply_liger_kernels`,
    verl's `model.use_liger`) on an accelerator; ignored on CPU (the kernels are Triton's)."""
    compile_layers: bool = False
    """torch.compile each decoder layer's forward (`parallelize.compile_decoder_layers`) on an accelerator;
    ignored on CPU (compiling there costs more than it saves)."""
    override_config: dict = field(default_factory=dict)
    """Fields that replace those of the model's HF config (`model.override_config`, as verl): e.g.
    `output_router_logits: true` adds a MoE model's router load-balancing loss, weighted by its
    `router_aux_loss_coef`, to the actor's loss."""
    trust_remote_code: bool = False
    """Let code shipped with the checkpoint run (`model.trust_remote_code`, as transformers means it)."""
    injection_mode: str = "replace"
    """NLA: how a batch's activation vectors enter the actor's input embeddings (`engines/injection.py`)."""
    output_layer_index: int | None = None
    """NLA reconstructor: the `hidden_states` index it predicts from (None or -1: the last)."""
    truncate_at_layer: int | None = None
    """NLA reconstructor: keep only the first this many decoder layers (None: all)."""
    seed: int = 42
    """Seed for anything initialised rather than loaded (a critic's value head, LoRA's A matrices)."""
    lora: LoraOptions | None = None
    """LoRA (`engines/lora.py`): PEFT's adapters added before sharding, the base frozen; None trains every weight."""
    optim: OptimOptions = field(default_factory=OptimOptions)
    """Optimizer and learning-rate schedule (ignored for "ref")."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"engine role {self.role!r}: choose one of {ROLES}")
        if self.lora is not None and self.role in ("critic", "reconstructor"):
            raise ValueError(f"LoRA is for the policy (actor, ref); a {self.role} trains all its weights")
        if self.use_fused_kernels and self.role in ("critic", "reconstructor"):
            raise ValueError("use_fused_kernels computes log-probs from the LM head, which a critic has not; "
                             "set it for the actor and reference only")
        for name in ("model_dtype", "param_dtype", "reduce_dtype"):
            resolve_dtype(getattr(self, name))
        if self.offload_policy and device_type() == "cpu":
            raise ValueError("fsdp_config.offload_policy keeps an accelerator's parameters in CPU memory, but this run "
                             "computes on the CPU already: set offload_policy=false")

    @property
    def trains(self) -> bool:
        """Whether this role has an optimizer."""
        return self.role != "ref"


class FSDPEngine(TrainEngine):
    """A model sharded with FSDP2; see the module docstring."""

    def __init__(self, options: EngineOptions):
        init_distributed()
        self.options = options
        self.device = current_device()
        self.dp_size = world_size()
        self.dp_rank = dist.get_rank()
        mesh = init_device_mesh(device_type(), (self.dp_size,), mesh_dim_names=("dp",))
        if options.full_determinism:
            enable_full_determinism(options.seed)
        torch.manual_seed(options.seed)
        self.model = build_sharded_model(
            options.model_path, mesh, self.device, value_head=options.role == "critic",
            model_dtype=options.model_dtype, param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype,
            attn_implementation=packed_attention_implementation(
                options.attn_implementation, options.use_remove_padding, self.device, resolve_dtype(options.param_dtype)),
            gradient_checkpointing=options.enable_gradient_checkpointing,
            # At world size 1 resharding frees nothing worth re-gathering for in backward, except under
            # the offload policy: there the gathered layers are the only copies on the device.
            reshard_after_forward=(options.reshard_after_forward and self.dp_size > 1) or options.offload_policy,
            offload_policy=options.offload_policy,
            compile_layers=options.compile_layers and self.device.type != "cpu",
            liger=options.use_liger and self.device.type != "cpu",
            # At one rank with the weights on the device a unit per layer shards nothing and costs
            # host time around every layer: the root may be the only unit there (if the model is
            # small enough, `parallelize.root_unit_fits`). Not under any offload (memory is what the
            # user is short of), nor for NLA's reconstructor: its loss reads a layer's output, never
            # the root's, and FSDP2 starts a unit's backward (and the gradients' reduction) from hooks
            # on that unit's outputs.
            shard_layers=(self.dp_size > 1 or options.offload_policy or options.param_offload
                          or options.optimizer_offload or options.role == "reconstructor"),
            keep_layers=options.truncate_at_layer if options.role == "reconstructor" else None,
            overrides=options.override_config, trust_remote_code=options.trust_remote_code, lora=options.lora)
        self.lora_scales = lora_scales(self.model) if options.lora is not None else {}
        """Each LoRA layer's module name and scale (empty without LoRA)."""
        config = self.model.config
        self.router_aux_coef = (float(config.router_aux_loss_coef) if options.role == "actor"
                                and getattr(config, "output_router_logits", False) else 0.0)
        """Weight of the routers' load-balancing loss in the actor's loss (0: not added, HF's default)."""
        experts = getattr(self.model.config, "_experts_implementation", None)
        if getattr(self.model.config, "num_experts", None) and experts:  # a MoE model: say how its experts run
            logger.info("%s: MoE experts run as %s%s", options.role, experts,
                        "" if experts == "grouped_mm" else " (a loop over experts: grouped_mm was not available)")
        self.expert_load = ExpertLoad(self.model)
        trained = (trained_parameters(self.model, options.output_layer_index) if options.role == "reconstructor"
                   else [parameter for parameter in self.model.parameters() if parameter.requires_grad])
        self.optimizer = build_optimizer(trained, options.optim) if options.trains else None
        self.lr_scheduler = build_lr_scheduler(self.optimizer, options.optim) if options.trains else None
        self.host_copies = HostCopies()  # where offload() puts shards and optimizer state (pinned on CUDA)

    # --- computing -------------------------------------------------------------------------

    def _model_output(self, batch: Batch, compute_entropy: bool, temperature: float,
                      entropy_grad: bool = False, aux_losses: list[Tensor] | None = None) -> ModelOutput:
        packed = self.options.use_remove_padding
        if self.options.role == "critic":
            return ModelOutput(values=compute_response_values(self.model, batch, packed=packed))
        if self.options.role == "reconstructor":
            return ModelOutput(predictions=compute_reconstruction(self.model, batch, self.options.output_layer_index,
                                                                  packed=packed))
        with injecting(self.model, batch, packed=packed, mode=self.options.injection_mode):
            log_probs, entropy = compute_response_log_probs(self.model, batch, temperature=temperature,
                                                            compute_entropy=compute_entropy, entropy_grad=entropy_grad,
                                                            packed=packed, fused=self.options.use_fused_kernels,
                                                            aux_losses=aux_losses)
        return ModelOutput(log_probs=log_probs, entropy=entropy)

    def forward(self, batch: Batch, micro_batch_size: int | MicroBatchSpec, *, compute_entropy: bool = False,
                temperature: float = 1.0) -> ModelOutput:
        micros, groups = micro_batches(batch, MicroBatchSpec.of(micro_batch_size), self._all_reduce)
        self.model.eval()
        with torch.no_grad():
            outputs = [self._model_output(micro.to(self.device), compute_entropy, temperature) for micro in micros]
        return join_outputs(outputs, groups, batch.response_length, batch.input_ids.device)

    def train_mini_batch(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int | MicroBatchSpec, *,
                         compute_entropy: bool = False, temperature: float = 1.0,
                         entropy_grad: bool = False) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("this engine has role 'ref' and no optimizer; "
                               "build it with role 'actor' or 'critic' to train")
        micros, _ = micro_batches(batch, MicroBatchSpec.of(micro_batch_size), self._all_reduce)
        context = loss_context(batch, self.dp_size, self._all_reduce)
        self.model.train()
        # Totals stay on the device until the end: a host sync per micro-batch would stall
        # the launch queue, and a small model's update is bound by kernel launches.
        loss_share_total = torch.zeros((), device=self.device)
        metric_totals: dict[str, Tensor | float] = {}
        if self.expert_load.is_moe:
            self.expert_load.reset(self.device)
        for micro in micros:
            micro = micro.to(self.device)
            aux_losses: list[Tensor] = []
            with phase("train/forward"), self._recording_expert_load(micro):
                output = self._model_output(micro, compute_entropy, temperature, entropy_grad, aux_losses)
                loss, metrics = loss_fn(output, micro, context)
            if self.router_aux_coef and aux_losses:  # a share of the mean over every micro-batch of every rank
                aux = aux_losses[0].to(loss.device)
                loss = loss + self.router_aux_coef * aux / (len(micros) * context.dp_size)
                metrics = {**metrics, "moe/aux_loss": aux.detach()}
            # FSDP averages gradients over ranks; the shares are normalised by global counts.
            with phase("train/backward"):
                (loss * context.dp_size).backward()
            loss_share_total += loss.detach()
            for key, value in metrics.items():
                value = value.detach() if isinstance(value, Tensor) else value
                metric_totals[key] = metric_totals.get(key, 0.0) + value

        with phase("train/optimizer_step"):
            grad_norm = self._clip_gradients()
            lr = self.lr_scheduler.get_last_lr()[0]
            skipped = not math.isfinite(grad_norm)
            if not skipped:  # a skipped update does not advance the schedule either
                self.optimizer.step()
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

        keys = sorted(metric_totals)
        local = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=self.device)
                             for value in [loss_share_total] + [metric_totals[key] / len(micros) for key in keys]])
        summed = self._all_reduce(local, dist.ReduceOp.SUM).tolist()
        result = {"loss": summed[0]}
        result.update({key: value / self.dp_size for key, value in zip(keys, summed[1:])})
        result.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped))
        if self.expert_load.is_moe:
            result.update(load_metrics(self._all_reduce(self.expert_load.counts, dist.ReduceOp.SUM)))
        return result

    def _recording_expert_load(self, micro: Batch):
        """Expert-load counting of a MoE model's training forward (nothing for a dense one)."""
        if not self.expert_load.is_moe:
            return contextlib.nullcontext()
        packed = self.options.use_remove_padding
        return self.expert_load.recording(None if packed else micro.attention_mask.reshape(-1).bool())

    def _clip_gradients(self) -> float:
        """Global L2 norm of the gradients (over all shards), clipping them to `clip_grad` if finite."""
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        total_norm = self._full_tensor(torch.nn.utils.get_total_norm([p.grad for p in parameters]))
        clip = self.options.optim.clip_grad
        if clip > 0 and torch.isfinite(total_norm):
            torch.nn.utils.clip_grads_with_norm_(parameters, clip, total_norm)
        return total_norm.item()

    def _full_tensor(self, tensor: Tensor) -> Tensor:
        """The whole of a sharded tensor, gathered on the engine's device (CPU-offloaded shards are
        copied there first: the collectives run on the accelerator); a plain tensor as it is. At one
        rank the local shard is the whole tensor: taken as it is, without DTensor's per-tensor
        redistribution (host time that dominates a small model's weight sync)."""
        if not isinstance(tensor, DTensor):
            return tensor
        if tensor.device != self.device:
            tensor = tensor.to(self.device)
        return tensor.to_local() if self.dp_size == 1 else tensor.full_tensor()

    def _all_reduce(self, tensor: Tensor, op: dist.ReduceOp) -> Tensor:
        tensor = tensor.to(self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.cpu()

    # --- weights out -------------------------------------------------------------------------

    @property
    def syncs_live_parameters(self) -> bool:
        """Whether `named_parameters_for_sync` yields the parameters themselves, at addresses that
        stay put (one rank, stored dtype = compute dtype, no parameter offload): a rollout engine
        may then share them instead of copying."""
        options = self.options
        return (self.dp_size == 1 and not options.param_offload and not options.offload_policy and not self.lora_scales
                and resolve_dtype(options.model_dtype) == resolve_dtype(options.param_dtype))

    @property
    def trains_every_weight(self) -> bool:
        return not self.lora_scales

    def named_parameters_for_sync(self, bucket_bytes: int = 512 << 20,
                                  trained_only: bool = False) -> Iterator[list[tuple[str, Tensor]]]:
        """Full weights in the compute dtype (`param_dtype`), tied weights once, under HF names.

        Where no gather or cast is needed (one rank, compute dtype = stored dtype) the
        tensors are the live parameters themselves (`syncs_live_parameters`): copy what must
        outlive the next update. Over several ranks each bucket is one all-gather (`gather.py`).
        With LoRA, each adapted layer's merged weight (`_lora_sync_buckets`), and with
        `trained_only` nothing else (the other weights never change).
        """
        dtype = resolve_dtype(self.options.param_dtype)
        if self.lora_scales:
            yield from self._lora_sync_buckets(bucket_bytes, dtype, trained_only)
            return
        if self.dp_size > 1:  # one all-gather per bucket, already in the compute dtype (gather.py)
            yield from gathered_buckets(self.model.named_parameters(), bucket_bytes, dtype, self.device)
            return
        named = ((name, self._sync_tensor(parameter)) for name, parameter in self.model.named_parameters())
        yield from in_dtype_buckets(named, bucket_bytes, dtype)

    def _lora_sync_buckets(self, bucket_bytes: int, dtype: torch.dtype,
                           trained_only: bool) -> Iterator[list[tuple[str, Tensor]]]:
        """The weights a LoRA model generates with: each adapted layer's base weight, A and B gathered in fp32
        (one all-gather per bucket over several ranks) and merged into a new tensor (`lora.merged_layers`),
        never into the trained module; with `trained_only` only those layers, else every weight."""
        adapted = {name for module in self.lora_scales for name in layer_tensor_names(module)}
        named = [(name, parameter) for name, parameter in self.model.named_parameters()
                 if name in adapted or not trained_only]
        if self.dp_size > 1:
            gathered = gathered_buckets(named, bucket_bytes, torch.float32, self.device)
        else:
            gathered = in_buckets(((name, self._sync_tensor(parameter)) for name, parameter in named), bucket_bytes)
        yield from merged_layers(gathered, self.lora_scales, dtype)

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[FSDPEngine]:
        """Forwards in the block compute the base model, without the LoRA adapters (`lora.adapters_disabled`)."""
        if not self.lora_scales:
            yield self
            return
        with adapters_disabled(self.model):
            yield self

    @torch.no_grad()
    def _sync_tensor(self, parameter: Tensor) -> Tensor:
        """A parameter's full tensor, detached (without grad mode: DTensor's detach is host time per tensor)."""
        return self._full_tensor(parameter).detach()

    def module(self) -> nn.Module:
        """The FSDP2 module; its parameters are DTensors, and at world size 1 `.to_local()` is the full weight."""
        return self.model

    def save(self, path: str) -> None:
        """With LoRA the model's part of the checkpoint is the adapter alone (the base is the model folder's)."""
        save_checkpoint(path, self.model, self.optimizer, self.lr_scheduler, adapter_only=bool(self.lora_scales))

    def load(self, path: str) -> None:
        load_checkpoint(path, self.model, self.optimizer, self.lr_scheduler, adapter_only=bool(self.lora_scales))

    def checkpoint_problem(self, path: str) -> str | None:
        return checkpoint_problem(path, with_optimizer=self.optimizer is not None)

    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        export_hf_model(out_dir, self.model, value_head=self.options.role == "critic",
                        dtype=self.options.model_dtype, attn_implementation=self.options.attn_implementation,
                        tokenizer=tokenizer, lora_scales=self.lora_scales)

    def export_lora_adapter(self, out_dir: str) -> None:
        """PEFT's adapter folder of the trained adapter, loadable with `PeftModel.from_pretrained(base, out_dir)`
        onto the model at `model_path`; every rank calls (the adapter is gathered), rank 0 writes."""
        if not self.lora_scales:
            raise ValueError("this engine trains no LoRA adapter (lora_rank=0); export the model with export_hf")
        adapter = {name: self._sync_tensor(parameter).cpu() for name, parameter in self.model.named_parameters()
                   if is_adapter_name(name)}
        if self.dp_rank == 0:
            write_adapter_folder(out_dir, adapter, self.model, self.options.model_path)
        dist.barrier()

    # --- memory between phases ---------------------------------------------------------------

    def offload(self) -> None:
        if self.options.offload_policy:  # everything FSDP2 holds is in CPU memory already
            return
        if self.options.param_offload:
            move_parameters(self.model, CPU, host=self.host_copies)
        if self.options.optimizer_offload and self.optimizer is not None:
            move_optimizer_state(self.optimizer, CPU, host=self.host_copies)

    def onload(self) -> None:
        if self.options.offload_policy:
            return
        if self.options.param_offload:
            move_parameters(self.model, self.device)
        if self.options.optimizer_offload and self.optimizer is not None:
            move_optimizer_state(self.optimizer, self.device)
