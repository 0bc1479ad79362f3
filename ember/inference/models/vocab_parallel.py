"""The embedding and the LM head split by vocabulary rows over a tensor-parallel replica (whole at size 1).

Each rank holds `padded_vocab_size / size` consecutive rows (`models/weight_shards.py` pads the
vocabulary with zero rows to a multiple of the ranks). The embedding looks up the tokens whose
rows this rank holds, zeros for the others, and one all-reduce completes every token's row (one
rank contributes it, the others add exact zeros, so the result is the whole embedding's row bit
for bit). A decode step's draw (`VocabParallelHead.sample`) runs on each rank's own logits, padded
columns left out, and the ranks all-gather its partials (`sampling.vocab_partials`: a few numbers per
row and chunk of the vocabulary, not the logits), which combine into the draw from the whole: the
same token on every rank, and as at one rank. Top-k / top-p, and the prefill, all-gather the logits
themselves (`forward`). Parameters keep the name `weight`, so HF names load and a tied
head can be the embedding's own parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.inference.models.weight_shards import vocab_rows
from ember.inference.request import SamplingParams
from ember.inference.sampling import sample_next_tokens, tokens_from_partials, truncates, vocab_partials
from ember.inference.tensor_parallel import TensorParallel


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows, summed over the replica."""

    def __init__(self, vocab_size: int, hidden_size: int, tensor_parallel: TensorParallel) -> None:
        super().__init__()
        self.tensor_parallel = tensor_parallel
        self.first_row, rows = vocab_rows(vocab_size, tensor_parallel.size, tensor_parallel.rank)
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
        self.first_row, rows = vocab_rows(vocab_size, tensor_parallel.size, tensor_parallel.rank)
        self.columns = max(0, min(rows, vocab_size - self.first_row))  # this rank's rows that are not padding
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, hidden_states: Tensor) -> Tensor:
        """(rows, hidden) in, (rows, vocab_size) logits out, the same on every rank."""
        logits = self.tensor_parallel.all_gather_last_dim(F.linear(hidden_states, self.weight))
        return logits[:, : self.vocab_size]

    def sample(self, hidden_states: Tensor, sampling: SamplingParams, seeds: Tensor,
               positions: Tensor) -> tuple[Tensor, Tensor]:
        """Each row's next token and its rollout log-prob, as `sampling.sample_next_tokens` draws them from the
        whole logits, the same on every rank: under tensor parallelism from every rank's partials."""
        if self.tensor_parallel.size == 1 or truncates(sampling, self.vocab_size):
            return sample_next_tokens(self(hidden_states), sampling, seeds, positions)
        partials = vocab_partials(F.linear(hidden_states, self.weight), sampling, seeds, positions, self.first_row,
                                  self.columns)
        return tokens_from_partials(self.tensor_parallel.all_gather_last_dim(partials))
