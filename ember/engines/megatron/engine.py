"""The Megatron-Core training engine: a GPTModel built by mbridge, behind `TrainEngine`.

The model is split as the role's `megatron` section says (tensor, pipeline, virtual
pipeline, context, expert parallel) and trained with megatron-core's own pieces: its
DistributedDataParallel (gradients reduced in fp32 buckets), its optimizer (fp32 master
weights, ZeRO-1 with `use_distributed_optimizer`), its pipeline schedules and its
distributed checkpoints. Everything the trainer sees is ember's: Batches in, per-token
log-probs out, a loss function under the loss-scaling contract of `engines/base.py`.

Loss scaling: megatron-core divides each micro-batch's loss by the number of micro-batches
and its data-parallel reduction averages gradients over ranks, so the engine multiplies the
loss function's share (already normalised by the mini-batch's global counts) by both;
gradients are then those of the one-rank, one-micro-batch step, as with FSDP2.

At TP = 1 the LM head computes fused log-probs (chunked, no [tokens × vocabulary] logits),
as the FSDP2 engine's `use_fused_kernels`; with tensor parallelism each rank's vocabulary
slice goes through `log_probs.py`'s vocabulary-parallel reductions.

A micro-batch that carries NLA's `injection_positions` has its activation vectors written
over those tokens' embedding output in the actor's and the reference's forwards
(`injection.py`). NLA's reconstructor (role "reconstructor") outputs `hidden_states[L]` at
each sample's last token instead of log-probs, read by a hook, the LM head skipped and the
parameters the prediction does not reach frozen (`reconstructor.py`).

Attention runs on the padded batch with an explicit mask (causal, and no real token
attends padding), so left-padded prompts compute what an unpadded forward computes; with
`use_remove_padding` each micro-batch's real tokens go through the model as one packed row in
megatron-core's THD format instead (`model_inputs.py`), for every role, pipeline schedule, token
budget and tensor-parallel size, and the outputs come back to the [b, R] layout.

Between phases, `param_offload`, `grad_offload` and `optimizer_offload` leave parameters,
gradients and optimizer state in CPU memory (`offload.py`: storages emptied and refilled in
place, since megatron-core's DDP and optimizer hold views into them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ember.data.batch import Batch
from ember.distributed.device import current_device, device_type
from ember.engines.base import DataLayout, LossContext, LossFn, MicroBatchSpec, ModelOutput, TrainEngine
from ember.engines.batching import in_dtype_buckets, join_outputs, loss_context, micro_batches
from ember.engines.fused_log_probs import fused_log_probs
from ember.engines.log_probs import replaced_forward
from ember.engines.megatron.bridge import (build_model_chunks, hf_named_weights, load_bridge,
                                           transformer_engine_available, unwrapped)
from ember.engines.megatron.checkpoint import checkpoint_problem, export_hf, load_checkpoint, save_checkpoint
from ember.engines.megatron.injection import injecting
from ember.engines.megatron.log_probs import vocab_parallel_log_probs
from ember.engines.megatron.model_inputs import ModelInputs, model_inputs
from ember.engines.megatron import packed_rope
from ember.engines.megatron.offload import MegatronOffload
from ember.engines.megatron.options import (MegatronOptions, checked_overrides, field_names, import_megatron,
                                           layout_settings, resolved_for_megatron_core)
from ember.engines.megatron.parallel import initialize_layout
from ember.engines.megatron.reconstructor import (check_layout, cut_model_overrides, freeze_unreached, last_token_index,
                                                  predicting, prediction_module)
from ember.engines.megatron.value_head import attach_value_head
from ember.engines.optim import lr_multiplier
from ember.errors import UserError
from ember.models.loading import resolve_dtype
from ember.profiling import phase

_SCHEDULE_FILE = "lr_schedule.json"
_LOG_PROB_ROLES = ("actor", "ref")  # the roles whose forwards compute log-probs (and take NLA's injection)


class MegatronEngine(TrainEngine):
    """A megatron-core GPTModel for one role; see the module docstring."""

    def __init__(self, options: MegatronOptions):
        import_megatron()
        from megatron.core import parallel_state as mpu
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.transformer import TransformerConfig

        options = resolved_for_megatron_core(options, field_names(TransformerConfig),
                                             field_names(DistributedDataParallelConfig))
        self.options = options
        self.is_critic = options.role == "critic"
        self.is_reconstructor = options.role == "reconstructor"
        self.device = current_device()
        initialize_layout(options.layout, options.seed)
        self.dtype = resolve_dtype(options.param_dtype)
        overrides = checked_overrides(options.override_transformer_config, TransformerConfig,
                                      "megatron.override_transformer_config")
        overrides = {**layout_settings(options, transformer_engine_available()),
                     **({"use_cpu_initialization": True} if device_type() == "cpu" else {}),
                     **overrides}
        hf_overrides = (cut_model_overrides(options.model_path, options.override_model_config, options.truncate_at_layer)
                        if self.is_reconstructor else options.override_model_config)
        self.bridge = load_bridge(options.model_path, self.dtype, overrides, hf_overrides)
        if options.use_remove_padding and not transformer_engine_available():
            packed_rope.install()  # packed rows rotated in one pass, not one sequence at a time
        self.config = self.bridge.config
        chunks = build_model_chunks(self.bridge, options.virtual_pipeline_model_parallel_size)
        for chunk in chunks:
            chunk.to(self.device)
        heads = [chunk for chunk in chunks if chunk.post_process] if self.is_critic else []
        for chunk in heads:
            chunk.output_layer = None  # mbridge loads the backbone; the value head is ember's
        self.bridge.load_weights(chunks, options.model_path)
        for chunk in heads:
            attach_value_head(chunk, self.bridge.hf_config, options.model_path, options.seed)
            chunk.output_layer.to(self.device)
        if self.is_reconstructor:
            self.prediction_module = self._prepare_reconstructor(chunks)
        if options.trains and not torch.cuda.is_available():  # the model builds and loads on a CPU; DDP does not
            raise UserError(f"strategy megatron trains on GPUs only (megatron-core's DistributedDataParallel keeps its "
                            f"buffers on CUDA), and the {options.role} runs on a CPU here: use strategy fsdp2 on a CPU")
        self.chunks = self._wrap(chunks)
        self.dp_size = mpu.get_data_parallel_world_size()
        self.dp_rank = mpu.get_data_parallel_rank()
        self.dp_group = mpu.get_data_parallel_group()
        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.optimizer = self._build_optimizer() if options.trains else None
        self.optimizer_steps = 0  # what the learning-rate schedule counts
        self.offloader = MegatronOffload(params=options.param_offload, grads=options.grad_offload and options.trains,
                                         optimizer=options.optimizer_offload and options.trains)

    def data_layout(self) -> DataLayout:
        """Every rank of a tensor/pipeline/context-parallel group takes its data-parallel rank's
        samples; the first tensor- and context-parallel rank of the last pipeline stage returns them."""
        from megatron.core import parallel_state as mpu

        outputs = (mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
                   and mpu.is_pipeline_last_stage())
        return DataLayout(self.dp_size, self.dp_rank, outputs)

    def _prepare_reconstructor(self, chunks: list[nn.Module]) -> nn.Module:
        """The module whose output the reconstructor predicts from, with the parameters it does not reach
        frozen before DDP wraps the model (`reconstructor.py`)."""
        options = self.options
        module = prediction_module(chunks[0], options.output_layer_index, self.bridge.hf_config)
        check_layout(options.pipeline_model_parallel_size, options.context_parallel_size,
                     self.config.recompute_granularity, module is chunks[0].decoder.final_layernorm)
        freeze_unreached(chunks[0], module)
        return module

    def _wrap(self, chunks: list[nn.Module]) -> list[nn.Module]:
        """Chunks in bf16/fp16 behind Float16Module, and under megatron-core's DDP when they train."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        if self.config.bf16 or self.config.fp16:
            chunks = [Float16Module(self.config, chunk) for chunk in chunks]
        if not self.options.trains:
            return chunks
        ddp_fields = {"grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
                      "use_distributed_optimizer": self.options.use_distributed_optimizer,
                      **checked_overrides(self.options.override_ddp_config, DistributedDataParallelConfig,
                                          "megatron.override_ddp_config")}
        ddp_config = DistributedDataParallelConfig(**ddp_fields)
        wrapped = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=chunk,
                                           disable_bucketing=index > 0) for index, chunk in enumerate(chunks)]
        for chunk in wrapped:
            chunk.broadcast_params()
        return wrapped

    def _build_optimizer(self):
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optim = self.options.optim
        config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.lr * optim.min_lr_ratio, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.clip_grad,
            bf16=self.config.bf16, fp16=self.config.fp16, params_dtype=torch.float32,
            use_distributed_optimizer=self.options.use_distributed_optimizer)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = [chunk.no_sync for chunk in self.chunks] if len(self.chunks) > 1 else \
            self.chunks[0].no_sync
        return get_megatron_optimizer(config, self.chunks)

    # --- computing -------------------------------------------------------------------------

    def _forward_backward(self, micros: list[Batch], loss_fn: LossFn | None, context: LossContext | None,
                          compute_entropy: bool, temperature: float, entropy_grad: bool) -> list[dict]:
        """Runs megatron-core's schedule over `micros`; returns one dict per micro-batch, in their order,
        on the last pipeline stage (the output when forward-only, metrics when training)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        forward_only = loss_fn is None
        count = len(micros)

        def forward_step(data_iterator, model):
            inputs = next(data_iterator)
            micro = inputs.micro
            head = _output_layer(model)
            log_probs = self.options.role in _LOG_PROB_ROLES
            fused = head is not None and self.options.tensor_model_parallel_size == 1 and log_probs
            if self.is_reconstructor:
                last_tokens = last_token_index(micro, packed=inputs.packing is not None)
                head_forward = predicting(head, self.prediction_module, last_tokens, self.config.sequence_parallel)
            else:
                head_forward = _fused_head(head, inputs, temperature, compute_entropy, entropy_grad) if fused \
                    else nullcontext()
            injection = injecting(model, micro, mode=self.options.injection_mode,
                                  packed_length=inputs.packed_length) if log_probs else nullcontext()
            with head_forward, injection:
                output = model(**inputs.arguments)
            return output, partial(self._loss, inputs, loss_fn, context, count, compute_entropy, temperature,
                                   entropy_grad, fused)

        # Sequence parallelism: each tensor-parallel rank holds an equal share of the sequence.
        multiple = self.options.tensor_model_parallel_size if self.config.sequence_parallel else 1
        inputs = [model_inputs(micro.to(self.device), self.options.use_remove_padding, multiple) for micro in micros]
        shapes = [item.arguments["input_ids"].shape for item in inputs]
        # The interleaved schedule (virtual stages) takes one iterator per model chunk, each over every micro-batch.
        data = [iter(inputs) for _ in self.chunks] if len(self.chunks) > 1 else iter(inputs)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data,
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0], num_microbatches=count,
            seq_length=max(shape[1] for shape in shapes), micro_batch_size=max(shape[0] for shape in shapes),
            forward_only=forward_only)

    def _loss(self, inputs: ModelInputs, loss_fn: LossFn | None, context: LossContext | None, count: int,
              compute_entropy: bool, temperature: float, entropy_grad: bool, fused: bool, model_output: Tensor):
        """The schedule's loss function for one micro-batch: (loss to backpropagate, reported dict)."""
        output = self._outputs(inputs, model_output, compute_entropy, temperature, entropy_grad, fused)
        if loss_fn is None:
            return torch.zeros((), device=model_output.device), {"output": output}
        loss, metrics = loss_fn(output, inputs.micro, context)
        # The schedule divides by the micro-batch count; DDP averages over data-parallel ranks.
        return loss * context.dp_size * count, {"loss_share": loss.detach(), **metrics}

    def _outputs(self, inputs: ModelInputs, model_output: Tensor, compute_entropy: bool, temperature: float,
                 entropy_grad: bool, fused: bool) -> ModelOutput:
        """The micro-batch's ModelOutput from what the model returned (batch-first; one row when packed): a
        critic's values [b, s, 1] (the value before response token i sits at P-1+i), a reconstructor's [b, 1, H]
        predictions, the fused head's [b, R, 1 or 2] log-prob (and entropy), or vocabulary-parallel logits
        [b, s, V/TP]; per-token outputs in the micro-batch's [b, R] layout (`ModelInputs.to_response_layout`)."""
        from megatron.core import parallel_state as mpu

        micro, positions = inputs.micro, inputs.prediction_positions
        if self.is_reconstructor:
            return ModelOutput(predictions=model_output[:, 0].float())
        if self.is_critic:
            values = inputs.to_response_layout(model_output[:, positions, 0].float())
            return ModelOutput(values=values * micro.response_mask)
        if fused:
            log_probs, entropy = model_output[..., 0], model_output[..., 1] if compute_entropy else None
        else:
            response_logits = model_output[:, positions] / temperature
            vocab_start = mpu.get_tensor_model_parallel_rank() * model_output.shape[-1]
            log_probs, entropy = vocab_parallel_log_probs(response_logits, inputs.targets, self.tp_group, vocab_start,
                                                          compute_entropy=compute_entropy, entropy_grad=entropy_grad)
        return ModelOutput(log_probs=inputs.to_response_layout(log_probs),
                           entropy=None if entropy is None else inputs.to_response_layout(entropy))

    def forward(self, batch: Batch, micro_batch_size: int | MicroBatchSpec, *, compute_entropy: bool = False,
                temperature: float = 1.0) -> ModelOutput:
        micros, groups = micro_batches(batch, MicroBatchSpec.of(micro_batch_size), self._all_reduce,
                                       self._micro_batch_multiple)
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            results = self._forward_backward(micros, None, None, compute_entropy, temperature, False)
        outputs = self._from_last_stage([result["output"] for result in results])
        return join_outputs(outputs, groups, batch.response_length, batch.input_ids.device)

    def train_mini_batch(self, batch: Batch, loss_fn: LossFn, micro_batch_size: int | MicroBatchSpec, *,
                         compute_entropy: bool = False, temperature: float = 1.0,
                         entropy_grad: bool = False) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("this engine has role 'ref' and no optimizer; build it with role 'actor' to train")
        micros, _ = micro_batches(batch, MicroBatchSpec.of(micro_batch_size), self._all_reduce,
                                  self._micro_batch_multiple)
        context = loss_context(batch, self.dp_size, self._all_reduce)
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        with phase("train/forward_backward"):  # megatron-core's schedule interleaves the two
            results = self._forward_backward(micros, loss_fn, context, compute_entropy, temperature, entropy_grad)
        with phase("train/optimizer_step"):
            lr = self._set_learning_rate()
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                self.optimizer.step()
                self.optimizer_steps += 1
        metrics = self._reduce_metrics(results, len(micros))
        metrics.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped))
        return metrics

    @property
    def _micro_batch_multiple(self) -> int:
        """What the micro-batch count must be a multiple of: the pipeline size under the interleaved schedule."""
        options = self.options
        return options.pipeline_model_parallel_size if options.virtual_pipeline_model_parallel_size else 1

    def _set_learning_rate(self) -> float:
        lr = self.options.optim.lr * lr_multiplier(self.optimizer_steps, self.options.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr

    def _reduce_metrics(self, results: list[dict], count: int) -> dict[str, float]:
        """The loss (summed shares) and the loss function's metrics averaged over micro-batches and
        data-parallel ranks, the same on every rank (sent from the last pipeline stage)."""
        keys = sorted({key for result in results for key in result} - {"loss_share"})
        local = torch.zeros(1 + len(keys), dtype=torch.float64, device=self.device)
        for result in results:
            local[0] += float(result["loss_share"])
            for position, key in enumerate(keys, start=1):
                local[position] += float(result[key]) / count
        keys, local = self._from_last_stage([(keys, local)])[0]
        summed = self._all_reduce(local, dist.ReduceOp.SUM).tolist()
        return {"loss": summed[0], **{key: value / self.dp_size for key, value in zip(keys, summed[1:])}}

    def _from_last_stage(self, objects: list) -> list:
        """`objects` as the last pipeline stage computed them, on every stage (one rank: as given)."""
        from megatron.core import parallel_state as mpu

        if mpu.get_pipeline_model_parallel_world_size() == 1:
            return objects
        # On the CPU: a pickled CUDA tensor would come back on the sender's GPU index in every receiver.
        holder = [_on_cpu(objects) if mpu.is_pipeline_last_stage() else None]
        dist.broadcast_object_list(holder, src=mpu.get_pipeline_model_parallel_last_rank(),
                                   group=mpu.get_pipeline_model_parallel_group())
        return holder[0]

    def _all_reduce(self, tensor: Tensor, op: dist.ReduceOp) -> Tensor:
        tensor = tensor.to(self.device)
        dist.all_reduce(tensor, op=op, group=self.dp_group)
        return tensor.cpu()

    # --- weights out -------------------------------------------------------------------------

    def named_parameters_for_sync(self, bucket_bytes: int = 512 << 20,
                                  trained_only: bool = False) -> Iterator[list[tuple[str, Tensor]]]:
        """Every weight (training changes all of them: LoRA is refused with strategy megatron)."""
        yield from in_dtype_buckets(hf_named_weights(self.bridge, self.chunks), bucket_bytes, self.dtype)

    def module(self) -> nn.Module:
        raise UserError("strategy megatron trains a megatron-core model, which transformers' generate cannot run: "
                        "set actor_rollout_ref.rollout.name=ember (its weights are synced from the Megatron shards)")

    def save(self, path: str) -> None:
        save_checkpoint(path, self.chunks, self.optimizer)
        if dist.get_rank() == 0:
            with open(os.path.join(path, _SCHEDULE_FILE), "w") as handle:
                json.dump({"optimizer_steps": self.optimizer_steps, "layout": self.options.layout}, handle)
        dist.barrier()

    def load(self, path: str) -> None:
        with open(os.path.join(path, _SCHEDULE_FILE)) as handle:
            saved = json.load(handle)
        layout = self.options.layout  # the model-parallel sizes; megatron-core's dp_reshardable state reshards DP
        if self.optimizer is not None and saved.get("layout", layout) != layout:
            changed = ", ".join(f"{key}={saved['layout'].get(key)} (now {value})" for key, value in layout.items()
                                if saved["layout"].get(key) != value)
            raise UserError(f"{path} was saved with {changed}: the optimizer state of a Megatron checkpoint reloads "
                            "under the same tensor, pipeline and expert sizes only (any data-parallel size); resume "
                            "with those sizes, or `ember export` the checkpoint and start from its HF folder")
        self.optimizer_steps = saved["optimizer_steps"]
        load_checkpoint(path, self.chunks, self.optimizer, self.optimizer_steps)

    def checkpoint_problem(self, path: str) -> str | None:
        return checkpoint_problem(path, [_SCHEDULE_FILE])

    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        export_hf(out_dir, self.bridge, self.chunks, self.options.model_path, tokenizer, value_head=self.is_critic)

    # --- memory between phases ---------------------------------------------------------------

    def offload(self) -> None:
        """Parameters, gradients and optimizer state to CPU memory as `param_offload`, `grad_offload`
        and `optimizer_offload` say (storages emptied in place: `offload.py`)."""
        self.offloader.offload(self.chunks, self.optimizer)

    def onload(self) -> None:
        self.offloader.onload()


def _on_cpu(value):
    """`value` (tensors, in lists, tuples and dataclasses such as ModelOutput) with every tensor on the CPU."""
    if isinstance(value, Tensor):
        return value.cpu()
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{item.name: _on_cpu(getattr(value, item.name))
                                             for item in dataclasses.fields(value) if item.init})
    return value


def _output_layer(chunk: nn.Module) -> nn.Module | None:
    """The LM head of a model chunk inside its wrappers; None on a stage without one."""
    chunk = unwrapped(chunk)
    return getattr(chunk, "output_layer", None) if getattr(chunk, "post_process", False) else None


def _fused_head(head: nn.Module, inputs: ModelInputs, temperature: float, compute_entropy: bool, entropy_grad: bool):
    """For one forward, the LM head computes the response tokens' log-probs (and entropy) from the
    hidden states chunk by chunk (`engines/fused_log_probs.py`) instead of logits: the [tokens ×
    vocabulary] logits of the whole sequence never exist. At TP = 1 the head holds the whole
    vocabulary, so the fused computation is exact; the weight's gradient reaches DDP as usual."""
    positions = inputs.prediction_positions
    targets = inputs.targets.transpose(0, 1)  # sequence-first as megatron-core's hidden states: [R, b] or [N, 1]

    def log_probs_instead_of_logits(hidden: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        hidden = hidden[positions]  # [R, b, H] or [N, 1, H]
        log_probs, entropy = fused_log_probs(
            hidden.reshape(-1, hidden.shape[-1]), head.weight if weight is None else weight, targets.reshape(-1),
            temperature=temperature, compute_entropy=compute_entropy, entropy_grad=entropy_grad)
        stacked = torch.stack([log_probs] if entropy is None else [log_probs, entropy], dim=-1)
        return stacked.reshape(*targets.shape, -1), None

    return replaced_forward(head, log_probs_instead_of_logits)
