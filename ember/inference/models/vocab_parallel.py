"""The embedding and the LM head split by vocabulary rows over a tensor-parallel replica (whole at size 1).

Each rank holds `padded_vocab_size / size` consecutive rows (`models/weight_shards.py` pads the
vocabulary with zero rows to a multiple of the ranks). The embedding looks up the tokens whose
rows this rank holds, zeros for the others, and one all-reduce completes every token's row (one
rank contributes it, the others add exact zeros, so the result is the whole embedding's row bit
for bit). The head's partial logits are all-gathered over the vocabulary and the padded columns
cut off, so the sampler sees exactly the logits of the whole head: the same tokens are drawn on
every rank, and as at one rank. Parameters keep the name `weight`, so HF names load and a tied
head can be the embedding's own parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.inference.models.weight_shards import padded_vocab_size
from ember.inference.tensor_parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows, summed over the replica."""

    def __init__(self, vocab_size: int, hidden_size: int, tensor_parallel: TensorParallel) -> None:
        super().__init__()
        self.tensor_parallel = tensor_parallel
        rows = padded_vocab_size(vocab_size, tensor_parallel.size) // tensor_parallel.size
        self.first_row = tensor_parallel.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, token_ids: Tensor) -> Tensor:
        """(tokens,) ids in, (tokens, hidden) embeddings out, the same on every rank."""
        if self.tensor_parallel.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.first_row
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        states = F.embedding(local.masked_fill(elsewhere, 0), self.weight).masked_fill(elsewhere[:, None], 0)
        return self.tensor_parallel.all_reduce(states)


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows; logits all-gathered to the whole vocabulary."""

    def __init__(self, hidden_size: int, vocab_size: int, tensor_parallel: TensorParallel) -> None:
        super().__init__()
        self.tensor_parallel = tensor_parallel
        self.vocab_size = vocab_size
        rows = padded_vocab_size(vocab_size, tensor_parallel.size) // tensor_parallel.size
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, hidden_states: Tensor) -> Tensor:
        """(rows, hidden) in, (rows, vocab_size) logits out, the same on every rank."""
        logits = self.tensor_parallel.all_gather_last_dim(F.linear(hidden_states, self.weight))
        return logits[:, : self.vocab_size]
