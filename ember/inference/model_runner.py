"""ModelRunner: runs a prefill step: the new prompts' tokens through the model, next-token logits out.

Each group's tokens are computed once (into the first sample's blocks), in one step or in
chunks over several (chunked prefill: a chunk attends to the group's tokens cached by the
earlier chunks); once the last chunk is in, the partial last block is copied to the other
samples' own blocks and the logits rows repeat per sample, so each sample draws its own
first token. Decode steps run in `decode_runner.py`.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ember.inference.attention import AttentionInputs
from ember.inference.block_manager import BlockManager
from ember.inference.kv_cache import KVCache
from ember.inference.models.decoder import DecoderForCausalLM, EmbeddingEdits
from ember.inference.scheduler import ScheduledStep


class ModelRunner:
    """Runs the engine model on prefill steps over the paged KV cache."""

    def __init__(self, model: DecoderForCausalLM, kv_cache: KVCache, block_manager: BlockManager) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.device = kv_cache.device
        self.prefill_tokens_computed = 0
        """Prompt tokens run through the model by prefill steps (the n samples of a prompt count once)."""

    @torch.inference_mode()
    def prefill(self, step: ScheduledStep) -> Tensor:
        """Next-token logits (sequences, vocab), one row per sequence of `step.sequences` (the groups
        whose prompt this step completes; a chunk that stops short of its group's end samples nothing)."""
        chunks = step.chunks
        leaders = [chunk.group[0] for chunk in chunks]
        token_ids = [token for chunk in chunks for token in chunk.group[0].token_ids[chunk.start : chunk.start + chunk.length]]
        positions = [position for chunk in chunks for position in range(chunk.start, chunk.start + chunk.length)]
        slots = [
            self.block_manager.slot(chunk.group[0], position)
            for chunk in chunks
            for position in range(chunk.start, chunk.start + chunk.length)
        ]
        block_width = max(len(leader.block_table) for leader in leaders)
        lengths = [chunk.length for chunk in chunks]
        inputs = AttentionInputs(
            slot_mapping=self._tensor(slots),
            query_lengths=self._tensor(lengths),
            context_lengths=self._tensor([chunk.start + chunk.length for chunk in chunks]),
            block_tables=self._tensor([leader.block_table + [0] * (block_width - len(leader.block_table)) for leader in leaders]),
            block_size=self.block_manager.block_size,
            is_decode=False,
            host_query_lengths=lengths,
            fresh=all(chunk.start == 0 for chunk in chunks),
        )
        self.prefill_tokens_computed += len(token_ids)
        hidden = self.model(self._tensor(token_ids), self._tensor(positions), self.kv_cache.layers, inputs,
                            injected=self._injected(chunks))
        self.kv_cache.copy_blocks(step.block_copies)
        chunk_ends = itertools.accumulate(chunk.length for chunk in chunks)
        last_rows = [end - 1 for chunk, end in zip(chunks, chunk_ends) if chunk.completes]
        logits = self.model.logits(hidden[self._tensor(last_rows)])
        group_sizes = self._tensor([len(chunk.group) for chunk in chunks if chunk.completes])
        return logits.repeat_interleave(group_sizes, dim=0)

    def _injected(self, chunks) -> EmbeddingEdits | None:
        """The step's NLA injections: the flat token row of each group's injected prompt token in this step."""
        rows, injections, offset = [], [], 0
        for chunk in chunks:
            injection = chunk.group[0].injection
            if injection is not None and chunk.start <= injection.position < chunk.start + chunk.length:
                rows.append(offset + injection.position - chunk.start)
                injections.append(injection)
            offset += chunk.length
        if not rows:
            return None
        return EmbeddingEdits(rows=self._tensor(rows),
                              vectors=torch.stack([injection.vector for injection in injections]).to(self.device),
                              additive=torch.tensor([injection.mode == "add" for injection in injections],
                                                    device=self.device))

    def _tensor(self, values: list) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
