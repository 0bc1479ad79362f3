"""LLMEngine: ember's generation engine: token-id prompts in, sampled token ids and log-probs out.

It ties the parts together: the `Scheduler` picks each step's work (continuous batching),
the `BlockManager` hands out KV-cache blocks, the `ModelRunner` prefills new prompts and
the `DecodeRunner` runs windows of decode steps on the device (CUDA graphs on a GPU), both
with ember's own model over the paged cache; `sample_next_tokens` picks the tokens.
`generate` loops until every sample has finished (a stop token, or max_new_tokens); an agent loop
instead `submit`s prompts and calls `step` itself, adding requests between steps.

`load_weights` copies new weights into the model in place, or shares the given tensors as
its storage (the training engine's live weights at one rank); with `quantization="fp8"` the
decoder's projections are quantised in place instead (`models/fp8.py`), and the KV cache, sized
from the memory left after the weights load, gets the room they no longer take.
`free_kv_cache` / `allocate_kv_cache` give the cache memory back and take it again
(the rollout's sleep and wake).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from torch import Tensor
from transformers import PretrainedConfig

from ember.distributed.device import empty_cache
from ember.inference.attention import kernels_support_head_dim
from ember.inference.block_manager import BlockManager
from ember.inference.config import EngineConfig
from ember.inference.decode_runner import DecodeRunner, DecodeWindow
from ember.inference.kv_cache import (KVCache, activation_reserve_bytes, kv_block_bytes, kv_blocks_to_allocate,
                                     num_kv_blocks_for_memory)
from ember.inference.model_runner import ModelRunner
from ember.inference.models import build_model, load_hf_config, load_weights, read_safetensors
from ember.inference.request import INJECTION_MODES, Injection, SamplingParams
from ember.inference.sampling import sample_next_tokens, sequence_seed
from ember.inference.scheduler import ScheduledStep, Scheduler, slots_for_window
from ember.inference.sequence import Sequence, SequenceStatus
from ember.inference.tensor_parallel import replica_group
from ember.profiling import phase


GRAPHS_KEPT_OVER_SLEEP_BYTES = 1 << 30
"""Captured decode graphs whose memory pool is at most this stay through `free_kv_cache` (sleep)."""
KV_CACHE_KEPT_OVER_SLEEP_FRACTION = 0.05
"""A KV cache of at most this fraction of the accelerator's memory stays through `free_kv_cache` (sleep)."""


def keeps_kv_cache_over_sleep(cache_bytes: int, device_total_bytes: int) -> bool:
    """Whether sleep keeps a KV cache of `cache_bytes`: a small cache (a short-answer task's, sized by
    `kv_blocks_to_allocate`) is worth less to training than freeing it costs every step (the
    allocator's cache emptied at sleep and at wake, the cache allocated and zeroed again)."""
    return cache_bytes <= KV_CACHE_KEPT_OVER_SLEEP_FRACTION * device_total_bytes


def first_stop(tokens: list[int], count: int, stop_token_ids: set[int]) -> int | None:
    """Index of the first stop token among the first `count` `tokens`, or None; a window without any stop
    token (nearly every one) costs one set operation."""
    if not stop_token_ids or stop_token_ids.isdisjoint(tokens):
        return None
    return next((index for index, token in enumerate(tokens[:count]) if token in stop_token_ids), None)


class LLMEngine:
    """Batched generation with a paged KV cache for one decoder model (dense or MoE)."""

    def __init__(
        self, hf_config: PretrainedConfig, named_tensors: Iterable[tuple[str, Tensor]], config: EngineConfig
    ) -> None:
        """hf_config: the model's HF config; named_tensors: every weight, in the checkpoint's names."""
        self.config = config
        self.device = torch.device(config.device)
        # A decode window may run a finished sequence a few positions past max_model_len.
        fuse = config.fuse_projections if config.fuse_projections is not None else self.device.type == "cuda"
        self.tensor_parallel = replica_group(config.tensor_parallel_size)
        self.model = build_model(hf_config, config.max_model_len + config.decode_window, config.dtype, self.device, fuse,
                                 self.tensor_parallel, config.quantization)
        load_weights(self.model, named_tensors, require_all=True)
        empty_cache()  # the KV sizing below counts what the allocator keeps cached (quantising's fp32 transients,
        # a trainer's build beside this engine) as in use
        max_blocks_per_sequence = config.blocks_for(config.max_model_len + config.decode_window)
        # every rank of a split replica schedules alike, so all hold as many blocks as the fullest can
        self.num_kv_blocks = self.tensor_parallel.agree_on_minimum(
            config.num_kv_blocks or self._default_num_kv_blocks(max_blocks_per_sequence), self.device)
        if self.num_kv_blocks * config.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache has room for {self.num_kv_blocks * config.block_size} tokens, less than one sequence "
                f"of max_model_len={config.max_model_len}: raise gpu_memory_utilization or lower max_model_len"
            )
        self.kv_cache = KVCache(
            num_layers=hf_config.num_hidden_layers,
            num_blocks=self.num_kv_blocks + 1,  # the last is the trash block padding rows write to
            block_size=config.block_size,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=config.dtype,
            device=self.device,
        )
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager)
        self.decoder = DecodeRunner(
            self.model,
            self.kv_cache,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_blocks_per_sequence=max_blocks_per_sequence,
            trash_block=self.num_kv_blocks,
            use_cuda_graphs=config.use_cuda_graphs and self._graph_safe(),
        )
        self._queued: DecodeWindow | None = None
        """The decode window queued on the device behind the last one read: the next step's (see `step`)."""

    def _graph_safe(self) -> bool:
        """Whether a decode step can be captured: attention must run in the Triton kernel (the gathered
        path reads the whole block table), and MoE layers' grouped matmuls stay on the device only in
        bf16 on sm90+. At rollout TP > 1 the step's NCCL all-reduces and all-gathers are captured too."""
        if self.device.type != "cuda":
            return True
        if not kernels_support_head_dim(self.model.head_dim):
            return False
        if not any(self.model.spec.sparse_layers):
            return True
        return self.config.dtype == torch.bfloat16 and torch.cuda.get_device_capability(self.device) >= (9, 0)

    @classmethod
    def from_pretrained(cls, path: str | Path, config: EngineConfig) -> LLMEngine:
        """An engine for the HF model directory `path` (config.json and safetensors weights)."""
        return cls(load_hf_config(path), read_safetensors(path), config)

    def _default_num_kv_blocks(self, max_blocks_per_sequence: int) -> int:
        """Blocks for max_num_seqs full-length sequences (`kv_blocks_to_allocate`), fewer on an accelerator
        if only fewer fit under gpu_memory_utilization."""
        most_in_use = self.config.max_num_seqs, max_blocks_per_sequence
        if self.device.type == "cpu":
            return kv_blocks_to_allocate(*most_in_use)
        free_bytes, total_bytes = torch.accelerator.get_memory_info(self.device)
        block_bytes = kv_block_bytes(
            self.model.config.num_hidden_layers,
            self.config.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.config.dtype,
        )
        hf_config = self.model.config
        intermediate = getattr(hf_config, "intermediate_size", 0) or 0
        if any(self.model.spec.sparse_layers):  # every token runs top-k experts (plus a shared one)
            routed = hf_config.num_experts_per_tok * hf_config.moe_intermediate_size
            intermediate = max(intermediate, routed + (getattr(hf_config, "shared_expert_intermediate_size", 0) or 0))
        reserved = activation_reserve_bytes(
            hf_config.hidden_size, intermediate, hf_config.vocab_size,
            self.config.max_num_batched_tokens, self.config.max_num_seqs, self.config.dtype,
        )
        own_bytes = sum(tensor.nbytes for tensor in (*self.model.parameters(), *self.model.buffers()))
        fit = num_kv_blocks_for_memory(total_bytes, free_bytes, self.config.gpu_memory_utilization, block_bytes, reserved,
                                       own_bytes)
        return kv_blocks_to_allocate(*most_in_use, fit_in_memory=fit - 1)  # the trash block comes on top

    @property
    def prefill_tokens_computed(self) -> int:
        """Prompt tokens the model has run over in prefill steps since the engine was built."""
        return self.runner.prefill_tokens_computed

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 injections: Seq[Injection | None] | None = None) -> list[Sequence]:
        """Generate `sampling.n` samples per prompt; finished sequences, sample i of prompt p at p * n + i.

        `injections` (NLA): per prompt, a vector written over one prompt token's input embedding
        whenever that prompt is prefilled (the n samples share the prefill and the vector)."""
        if not self.kv_cache.is_allocated:
            raise RuntimeError("LLMEngine.generate called after free_kv_cache: call allocate_kv_cache first")
        sequences = self._admit(prompts, sampling, self._checked_injections(prompts, injections))
        while self.has_unfinished():
            self.step(sampling)
        return sequences

    def submit(self, token_ids: list[int], seeds: list[int], max_new_tokens: int, first_sequence_id: int = 0,
               injection: Injection | None = None, hold_kv: bool = False) -> list[Sequence]:
        """Queue one prompt for len(`seeds`) samples (prefilled once together), each drawing from its own seed;
        they are generated by the following `step` calls. With `hold_kv` each sample keeps its KV blocks when
        it finishes, for `continue_turn` (an agent loop's turns)."""
        self._check_fits(token_ids, max_new_tokens, "a prompt")
        group = [Sequence(sequence_id=first_sequence_id + sample, prompt_length=len(token_ids), token_ids=list(token_ids),
                          seed=seed, max_new_tokens=max_new_tokens, injection=injection, hold_kv=hold_kv)
                 for sample, seed in enumerate(seeds)]
        self.scheduler.add_group(group)
        return group

    def continue_turn(self, sequence_id: int, token_ids: list[int], seed: int, max_new_tokens: int) -> Sequence:
        """Queue the next turn of the finished `hold_kv` sample `sequence_id`: `token_ids` is its whole context
        (the held turn's tokens, then the new ones, e.g. a tool's answer), prefilled from the held turn's end over
        the keys and values its blocks hold, or whole if they were given back meanwhile. Holds its blocks again."""
        self._check_fits(token_ids, max_new_tokens, "a turn's context")
        sequence = Sequence(sequence_id=sequence_id, prompt_length=len(token_ids), token_ids=list(token_ids), seed=seed,
                            max_new_tokens=max_new_tokens, hold_kv=True)
        self.scheduler.continue_held(sequence)
        return sequence

    def release_kv(self, sequence_id: int | None = None) -> None:
        """Give back the KV blocks a finished `hold_kv` sample holds (every one's with None)."""
        self.scheduler.release_held(sequence_id)

    def has_unfinished(self) -> bool:
        """Whether a submitted sequence is still waiting or generating."""
        return not self.scheduler.is_finished()

    def step(self, sampling: SamplingParams) -> list[Sequence]:
        """One engine step (a prefill, or a window of decode steps) sampled with `sampling` (its n, seed and
        max_new_tokens are the submitted sequences' own); the sequences that finished in it.

        A decode window's tokens are read only after the next window is queued behind it on the device (when
        nothing waits to be prefilled and the same sequences run on), so the device decodes while the host takes
        in the tokens; that queued window is the next step's. Its rows of sequences that finished meanwhile are
        discarded."""
        if not self.kv_cache.is_allocated:
            raise RuntimeError("LLMEngine.step called after free_kv_cache: call allocate_kv_cache first")
        stop_token_ids = set() if sampling.ignore_eos else set(sampling.stop_token_ids)
        if self._queued is not None and self._queued.sampling != sampling:
            self._drop_queued()  # queued for other sampling settings: its tokens are drawn again
        window, self._queued = self._queued, None
        if window is None:
            step = self.scheduler.schedule(lookahead=self.config.decode_window)
            if step.is_prefill:
                with phase("engine/prefill"):
                    tokens, log_probs = self._prefill(step, sampling)
                return self._accept(step.sequences, tokens, log_probs, stop_token_ids)
            running = step.decode_sequences
            with phase("engine/decode"):
                window = self.decoder.launch(running, self._window_steps(running), sampling)
        with phase("engine/decode"):
            self._queued = self._queue_next(window, sampling)
            tokens, log_probs = window.result()
        finished = self._accept(window.sequences, tokens, log_probs, stop_token_ids)
        if self._queued is not None and all(s.status is SequenceStatus.FINISHED for s in self._queued.sequences):
            self._queued = None  # every sequence it decodes stopped in this window
        return finished

    def _queue_next(self, window: DecodeWindow, sampling: SamplingParams) -> DecodeWindow | None:
        """The window after `window` (launched, not read), queued behind it on the device for the sequences that
        still run and have tokens left after it; None where the next step may be something else: prompts wait to
        be prefilled, a sequence would be preempted, or the rows' graph is not captured yet."""
        scheduler = self.scheduler
        if not self.config.overlap_decode or scheduler.waiting or scheduler.partial is not None:
            return None
        if len(scheduler.running) != sum(s.status is SequenceStatus.RUNNING for s in window.sequences):
            return None  # a running sequence is not in this window
        going_on = [s for s in window.sequences if s.status is SequenceStatus.RUNNING
                    and s.max_new_tokens - s.num_generated > window.steps]
        if not going_on or not self.decoder.can_continue(len(going_on), sampling):
            return None
        steps = self._window_steps(going_on, ahead=window.steps)
        for sequence in going_on:
            if not self.block_manager.try_append(sequence, slots_for_window(sequence, steps, ahead=window.steps)):
                return None  # the blocks taken stay with their sequences: its next window needs them anyway
        return self.decoder.launch(going_on, steps, sampling, continuing=True)

    def _window_steps(self, sequences: list[Sequence], ahead: int = 0) -> int:
        """Decode steps of a window for `sequences`, after `ahead` tokens a window before it samples: at most
        `decode_window`, and no more than the most any of them has left."""
        return min(self.config.decode_window, max(s.max_new_tokens - s.num_generated for s in sequences) - ahead)

    def _drop_queued(self) -> None:
        """Forget the queued window (its rows are written whole next time), once the device has finished it."""
        if self._queued is not None:
            self._queued.result()
            self._queued = None

    def _prefill(self, step: ScheduledStep, sampling: SamplingParams) -> tuple[list[list[int]], list[list[float]]]:
        """Prefill the step's prompts and draw each sequence's next token: one token and log-prob per sequence."""
        logits = self.runner.prefill(step)
        stepped = step.sequences
        if not stepped:  # a chunk of a longer prompt: nothing to sample yet
            return [], []
        seeds = torch.tensor([sequence.seed for sequence in stepped], device=self.device)
        positions = torch.tensor([len(sequence) for sequence in stepped], device=self.device)
        tokens, log_probs = sample_next_tokens(logits, sampling, seeds, positions)
        return [[token] for token in tokens.tolist()], [[log_prob] for log_prob in log_probs.tolist()]

    def _accept(
        self, sequences: list[Sequence], tokens: list[list[int]], log_probs: list[list[float]], stop_token_ids: set[int]
    ) -> list[Sequence]:
        """Append each sequence's new tokens up to its first stop token or its token budget, finishing it there;
        the sequences finished."""
        finished = []
        for sequence, new_tokens, new_log_probs in zip(sequences, tokens, log_probs, strict=True):
            if sequence.status is SequenceStatus.FINISHED:
                continue  # a queued window's row of a sequence that stopped in the window before
            budget = sequence.max_new_tokens - sequence.num_generated
            kept, reason = min(len(new_tokens), budget), "length"
            stop = first_stop(new_tokens, kept, stop_token_ids)
            if stop is not None:
                kept, reason = stop + 1, "stop"
            if kept < len(new_tokens):
                new_tokens, new_log_probs = new_tokens[:kept], new_log_probs[:kept]
            sequence.extend(new_tokens, new_log_probs)
            if reason == "stop" or kept == budget:
                self.scheduler.finish(sequence, reason)
                finished.append(sequence)
        return finished

    def _checked_injections(self, prompts: list[list[int]],
                            injections: Seq[Injection | None] | None) -> list[Injection | None]:
        """One injection (or None) per prompt, each checked against its prompt and the model's hidden size."""
        if injections is None:
            return [None] * len(prompts)
        if len(injections) != len(prompts):
            raise ValueError(f"{len(injections)} injections for {len(prompts)} prompts: give one (or None) per prompt")
        hidden = self.model.config.hidden_size
        for index, (prompt, injection) in enumerate(zip(prompts, injections)):
            if injection is None:
                continue
            if not 0 <= injection.position < len(prompt):
                raise ValueError(f"prompt {index}: injection position {injection.position} is outside its "
                                 f"{len(prompt)} tokens")
            if tuple(injection.vector.shape) != (hidden,):
                raise ValueError(f"prompt {index}: an injected vector of shape {tuple(injection.vector.shape)}; the "
                                 f"model's hidden size is {hidden}")
            if injection.mode not in INJECTION_MODES:
                raise ValueError(f"prompt {index}: injection mode {injection.mode!r}: use one of {INJECTION_MODES}")
        return list(injections)

    def _check_fits(self, prompt: list[int], max_new_tokens: int, label: str) -> None:
        if not prompt:
            raise ValueError(f"{label} is empty: every prompt needs at least one token (e.g. BOS)")
        if len(prompt) + max_new_tokens > self.config.max_model_len:
            raise ValueError(
                f"{label} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
                f"max_model_len={self.config.max_model_len}: raise max_model_len or shorten the prompt")

    def request_seed(self, seed: int | None) -> int | None:
        """The seed a call's sequence seeds derive from (`sampling.sequence_seed`): `seed`; without one, at tensor
        parallel size > 1, one random seed the replica's ranks agree on (each rank drawing its own would draw other
        tokens on each rank); None at size 1 (each sequence draws its own)."""
        if seed is None and self.tensor_parallel.size > 1:
            return self.tensor_parallel.agree_on_minimum(int(torch.randint(0, 1 << 62, ())), self.device)
        return seed

    def _admit(self, prompts: list[list[int]], sampling: SamplingParams,
               injections: list[Injection | None]) -> list[Sequence]:
        """Check that every prompt fits, then queue each as one group of `sampling.n` seeded samples."""
        for prompt_index, prompt in enumerate(prompts):
            self._check_fits(prompt, sampling.max_new_tokens, f"prompt {prompt_index}")
        request_seed = self.request_seed(sampling.seed)
        sequences = []
        for prompt_index, prompt in enumerate(prompts):
            seeds = [sequence_seed(request_seed, (sampling.first_prompt_index + prompt_index) * sampling.n + sample)
                     for sample in range(sampling.n)]
            sequences += self.submit(prompt, seeds, sampling.max_new_tokens, prompt_index * sampling.n,
                                     injections[prompt_index])
        return sequences

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], share: bool = False) -> None:
        """New weights (checkpoint names; any subset) copied into the model in place, or, with `share`,
        taken as the model's own storage where shape, dtype and device match (no copy). Under tensor
        parallelism each tensor may be whole or already this rank's part; each rank keeps its part
        (`models/weight_shards.py`), so a whole model never needs to be sent at once: send it in buckets."""
        self._drop_queued()
        if load_weights(self.model, named_tensors, require_all=False, share=share):
            self.decoder.drop_graphs()  # captured graphs read the old weights' memory

    def free_kv_cache(self) -> None:
        """Release the KV cache's memory (between rollouts); `generate` is refused until `allocate_kv_cache`.
        On an accelerator a cache of at most KV_CACHE_KEPT_OVER_SLEEP_FRACTION of its memory is kept
        (`keeps_kv_cache_over_sleep`), and with it every captured graph.
        Captured graphs are kept when their memory pool is at most GRAPHS_KEPT_OVER_SLEEP_BYTES (it stays
        reserved through training): they replay only after the cache is allocated again, and only if it
        came back at the same address. Larger pools go with the cache, as the graphs' memory is then
        worth more to training than their capture time."""
        if not self.scheduler.is_finished():
            raise RuntimeError("free_kv_cache called while sequences are generating")
        self.scheduler.release_held()
        if self.device.type != "cpu" and keeps_kv_cache_over_sleep(
                self.kv_cache.nbytes, torch.accelerator.get_memory_info(self.device)[1]):
            return
        if self.decoder.graph_pool_bytes > GRAPHS_KEPT_OVER_SLEEP_BYTES:
            self.decoder.drop_graphs()
        self.kv_cache.free()
        empty_cache()

    def allocate_kv_cache(self) -> None:
        """Take the KV cache's memory again after `free_kv_cache`; graphs captured over its old
        address are dropped if it moved (re-captured on first use)."""
        if not self.kv_cache.is_allocated:
            empty_cache()  # what training left cached goes back first, so the cache can return where it was
        try:
            self.kv_cache.allocate()
        except torch.OutOfMemoryError as error:
            free = torch.accelerator.get_memory_info(self.device)[0] if self.device.type != "cpu" else 0
            raise RuntimeError(
                f"the KV cache ({self.kv_cache.nbytes / 2**30:.1f} GiB, sized when the engine was built) no longer fits "
                f"at wake-up: {free / 2**30:.1f} GiB is free on {self.device} (training holds more than it did then, "
                "e.g. the optimizer's state made at the first update): lower "
                "actor_rollout_ref.rollout.gpu_memory_utilization, or offload the actor between phases "
                "(fsdp_config.param_offload / optimizer_offload)") from error
        if self.decoder.kv_address not in (None, self.kv_cache.address):
            self.decoder.drop_graphs()
