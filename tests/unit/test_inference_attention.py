"""Prefill attention inputs the host knows (longest query, each token's padded row) give the same
attention as asking the device; the flash path for fresh prefills is a GPU test (test_inference_gpu.py)."""

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from ember.inference.attention import AttentionInputs, gathered_attention, paged_attention


def prefill_case(lengths, starts, block_size=4, kv_heads=2, heads=6, head_dim=8, seed=0, host_known=True):
    """A paged cache holding each sequence's keys up to start + length, and the step's queries."""
    generator = torch.Generator().manual_seed(seed)
    blocks_per_sequence = max(-(-(start + length) // block_size) for start, length in zip(starts, lengths))
    blocks = blocks_per_sequence * len(lengths) + 1
    key_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=generator)
    tables = torch.arange(1, blocks).view(len(lengths), blocks_per_sequence)
    slots = [int(tables[row, position // block_size]) * block_size + position % block_size
             for row, (start, length) in enumerate(zip(starts, lengths)) for position in range(start, start + length)]
    host = dict(host_query_lengths=list(lengths), fresh=all(start == 0 for start in starts)) if host_known else {}
    inputs = AttentionInputs(slot_mapping=torch.tensor(slots), query_lengths=torch.tensor(lengths),
                             context_lengths=torch.tensor([s + n for s, n in zip(starts, lengths)]),
                             block_tables=tables, block_size=block_size, is_decode=False, **host)
    queries = torch.randn(sum(lengths), heads, head_dim, generator=generator)
    return queries, key_cache, value_cache, inputs


@pytest.mark.parametrize("starts", [(0, 0, 0), (0, 5, 2)])
@pytest.mark.parametrize("window", [None, 3])
def test_host_known_rows_give_the_attention_the_device_finds(starts, window):
    lengths = (5, 1, 7)
    asked = gathered_attention(*prefill_case(lengths, starts, host_known=False), scale=0.3, sliding_window=window)
    queries, key_cache, value_cache, inputs = prefill_case(lengths, starts)
    told = paged_attention(queries, key_cache, value_cache, inputs, scale=0.3, sliding_window=window)
    assert told.shape == (sum(lengths), 6, 8)
    torch.testing.assert_close(told, asked, atol=0, rtol=0)


class RecordedOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        indices = args[1] if name == "index" else ()
        if any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices):
            name = "boolean index"
        self.names.add(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("host_known", [True, False])
def test_host_known_rows_do_not_read_anything_back_from_the_device(host_known):
    """Reading a length back (`item`) or indexing by a mask (its rows counted on the device) is a host
    sync per layer on CUDA."""
    queries, key_cache, value_cache, inputs = prefill_case((3, 2), (0, 0), host_known=host_known)
    with RecordedOps() as recorded:
        gathered_attention(queries, key_cache, value_cache, inputs, scale=0.3, sliding_window=None)
    syncs = recorded.names & {"boolean index", "_local_scalar_dense"}
    assert syncs == (set() if host_known else {"boolean index", "_local_scalar_dense"})
