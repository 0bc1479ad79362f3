"""The Megatron critic's value head: a scalar per position in place of the LM head.

megatron-core's GPTModel ends in a vocabulary-sized output layer; a critic replaces it with
one linear unit with a bias over the hidden size (replicated on tensor-parallel ranks, the
hidden states gathered first under sequence parallelism), called as GPTModel calls its
output layer. It is the HF value model's `score` (`AutoModelForTokenClassification` with one
label, what the FSDP2 critic saves): read from a value-model checkpoint, else initialised
as transformers initialises it (weight normal with the config's `initializer_range`, bias
zero), so both backends start a critic alike and their exports load in each other.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

SCORE_WEIGHT, SCORE_BIAS = "score.weight", "score.bias"


class ValueHead(nn.Module):
    """hidden [s, b, H] -> values [s, b, 1], in GPTModel's output-layer call signature."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return nn.functional.linear(hidden, self.weight, self.bias), None  # a tied embedding `weight` is not the head's


def attach_value_head(chunk: nn.Module, hf_config, model_path: str, seed: int) -> None:
    """Replace the last stage's LM head of `chunk` with a value head, loaded or initialised."""
    config = chunk.config
    head = ValueHead(config.hidden_size, config.sequence_parallel, config.params_dtype)
    saved = _saved_score(model_path)
    with torch.no_grad():
        if SCORE_WEIGHT in saved:
            head.weight.copy_(saved[SCORE_WEIGHT].to(head.weight.dtype))
            if SCORE_BIAS in saved:
                head.bias.copy_(saved[SCORE_BIAS].to(head.bias.dtype))
        else:
            generator = torch.Generator().manual_seed(seed)
            std = getattr(hf_config, "initializer_range", 0.02)
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
    chunk.output_layer = head
    chunk.share_embeddings_and_output_weights = False  # the embedding stays the embedding


def _saved_score(model_path: str) -> dict[str, Tensor]:
    """The value head's tensors of a saved value model at `model_path` (none: a causal LM)."""
    from safetensors import safe_open

    found = {}
    for name in sorted(os.listdir(model_path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, name), framework="pt") as handle:
                found.update({key: handle.get_tensor(key) for key in (SCORE_WEIGHT, SCORE_BIAS) if key in handle.keys()})
    return found
