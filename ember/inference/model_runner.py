"""ModelRunner: runs a prefill step: the new prompts' tokens through the model, next-token logits out.

Each group's tokens are computed once (into the first sample's blocks), then the partial
last block is copied to the other samples' own blocks; the logits rows repeat per sample,
so each sample draws its own first token. The result has one logits row per sequence of
`ScheduledStep.sequences`. Decode steps run in `decode_runner.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ember.inference.attention import AttentionInputs
from ember.inference.block_manager import BlockManager
from ember.inference.kv_cache import KVCache
from ember.inference.models.decoder import DecoderForCausalLM
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
        """Next-token logits (sequences, vocab), one row per sequence of `step.sequences`."""
        leaders = [group[0] for group in step.groups]
        token_ids = [token for leader in leaders for token in leader.token_ids]
        positions = [position for leader in leaders for position in range(len(leader))]
        slots = [self.block_manager.slot(leader, position) for leader in leaders for position in range(len(leader))]
        block_width = max(len(leader.block_table) for leader in leaders)
        inputs = AttentionInputs(
            slot_mapping=self._tensor(slots),
            query_lengths=self._tensor([len(leader) for leader in leaders]),
            context_lengths=self._tensor([len(leader) for leader in leaders]),
            block_tables=self._tensor([leader.block_table + [0] * (block_width - len(leader.block_table)) for leader in leaders]),
            block_size=self.block_manager.block_size,
            is_decode=False,
        )
        self.prefill_tokens_computed += len(token_ids)
        hidden = self.model(self._tensor(token_ids), self._tensor(positions), self.kv_cache.layers, inputs)
        last_rows = torch.cumsum(inputs.query_lengths, 0) - 1
        logits = self.model.logits(hidden[last_rows])
        self.kv_cache.copy_blocks(step.block_copies)
        group_sizes = self._tensor([len(group) for group in step.groups])
        return logits.repeat_interleave(group_sizes, dim=0)

    def _tensor(self, values: list) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
