"""NLA's injection under Megatron's sequence parallelism: each tensor-parallel rank rewrites the tokens of its
own slice of the sequence, so that every injected token is written once, with its own sample's vector."""

import sys
import types

import pytest
import torch

from ember.engines.injection import rewrite_embeddings
from ember.engines.megatron.injection import _sequence_slice


def with_tp_rank(monkeypatch, rank: int, world: int) -> None:
    """megatron-core's parallel_state, as far as the slice reads it, for one tensor-parallel rank."""
    state = types.SimpleNamespace(get_tensor_model_parallel_world_size=lambda: world,
                                  get_tensor_model_parallel_rank=lambda: rank)
    core = types.ModuleType("megatron.core")
    core.parallel_state = state
    monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
    monkeypatch.setitem(sys.modules, "megatron.core", core)


def rewritten_by_slices(monkeypatch, embeddings, mask, vectors, mode, world):
    """The embeddings as each of `world` sequence-parallel ranks rewrites its own slice, joined again."""
    part = embeddings.shape[1] // world
    pieces = []
    for rank in range(world):
        with_tp_rank(monkeypatch, rank, world)
        local_mask, local_vectors = _sequence_slice(mask, vectors, part)
        pieces.append(rewrite_embeddings(embeddings[:, rank * part:(rank + 1) * part], local_mask, local_vectors, mode))
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_slices_of_all_ranks_rewrite_what_the_whole_sequence_rewrites(monkeypatch, world):
    samples, length, hidden = 5, 12, 4
    mask = torch.zeros(samples, length, dtype=torch.bool)
    for sample, position in enumerate([0, 5, -1, 11, 7]):  # sample 2 injects nothing
        if position >= 0:
            mask[sample, position] = True
    vectors = torch.arange(4 * hidden, dtype=torch.float32).reshape(4, hidden) + 100  # one row per injected sample
    embeddings = torch.randn(samples, length, hidden)
    whole = rewrite_embeddings(embeddings, mask, vectors, "replace")
    assert torch.equal(rewritten_by_slices(monkeypatch, embeddings, mask, vectors, "replace", world), whole)


def test_a_length_that_is_neither_the_sequence_nor_a_slice_stops(monkeypatch):
    with_tp_rank(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match="5 sequence positions for a micro-batch of 12 with tensor parallel size 2"):
        _sequence_slice(torch.zeros(2, 12, dtype=torch.bool), torch.zeros(0, 4), 5)


@pytest.mark.parametrize("world", [2, 4])
def test_a_packed_row_hands_each_rank_the_vectors_of_its_own_tokens(monkeypatch, world):
    """One row holds every sample's tokens (`use_remove_padding`): vectors go by token, not by row."""
    length, hidden = 16, 4
    mask = torch.zeros(1, length, dtype=torch.bool)
    mask[0, [1, 5, 6, 13]] = True  # four samples' marker tokens, rank 0 holding two of them at world 2
    vectors = torch.arange(4 * hidden, dtype=torch.float32).reshape(4, hidden) + 100
    embeddings = torch.randn(1, length, hidden)
    whole = rewrite_embeddings(embeddings, mask, vectors, "add")
    assert torch.equal(rewritten_by_slices(monkeypatch, embeddings, mask, vectors, "add", world), whole)
