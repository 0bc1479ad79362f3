"""DecodeRunner: windows of decode steps that stay on the device between two scheduling rounds.

A window of k steps feeds every running sequence's newest token, samples the next one
and feeds that back, k times, with no host round trip in between: the step's inputs live
in fixed device buffers (newest token, position, block table and seed per row) that the
step itself advances, and slots and context lengths are derived from them on the device.
The host reads the k x rows sampled tokens once at the end; a sequence that stopped
inside the window is cut there by the engine (its extra steps wrote only slots of its own
blocks or of the trash block, never another sequence's). It writes the buffers whole only
when the rows change: while the same sequences run on (none finished, was preempted or
joined), it writes just the blocks they took for the next window.

A window is launched (`launch`) and read (`DecodeWindow.result`) apart, so the engine can queue the next
window before reading this one's tokens (`continuing=True`): the next window's rows then come from the rows
this one leaves on the device (each row's newest token and position, advanced by the steps), gathered into
place when some sequences dropped out, with the blocks taken since written behind them. Every host-to-device
write goes through pinned memory without waiting for the device, so the host schedules while the device decodes.

On CUDA each step (model forward, sampling, advancing the buffers) is one captured CUDA
graph per padded batch size and sampling setting, replayed k times: a decode step is a
few hundred small kernels, whose launches would otherwise cost more than the work. Rows
beyond the real sequences point every block at the trash block. Elsewhere the same step
runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from ember.inference.attention import AttentionInputs
from ember.inference.kv_cache import KVCache
from ember.inference.models.decoder import DecoderForCausalLM
from ember.inference.request import SamplingParams
from ember.inference.sequence import Sequence
from ember.profiling import phase


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes with a graph each: 1, 2, 4, 8, then powers of two and their midpoints
    (above 8 at most a third of a padded batch is padding)."""
    sizes, power = [1, 2, 4, 8], 8
    while sizes[-1] < max_num_seqs:
        sizes += [power + power // 2, power * 2]
        power *= 2
    return [size for size in sizes if size < max_num_seqs] + [max_num_seqs]


@dataclass
class DecodeWindow:
    """A launched window: `steps` tokens and log-probs for each of `sequences`, read by `result` (which waits
    for the device only there)."""

    sequences: list[Sequence]
    steps: int
    sampling: SamplingParams
    tokens: torch.Tensor
    """steps x sequences sampled tokens (in pinned host memory on CUDA, filled when `ready` has passed)."""
    log_probs: torch.Tensor
    ready: torch.cuda.Event | None = None

    def result(self) -> tuple[list[list[int]], list[list[float]]]:
        """Each sequence's `steps` sampled tokens and their log-probs."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.T.tolist(), self.log_probs.T.tolist()


@dataclass(frozen=True)
class LoadedRows:
    """What the decode buffers' rows hold after the last window: which sequences in which rows, how far each
    row got, and how much of its block table was written."""

    sequences: list[Sequence]
    rows: int
    """The rows written, padding rows included."""
    lengths: list[int]
    """Each sequence's length once the window's tokens are appended (its row's newest token is the last)."""
    table_lengths: np.ndarray
    """Block-table entries written for each sequence."""


class DecodeRunner:
    """Runs decode windows for up to `max_num_seqs` sequences over the paged KV cache."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: KVCache,
        block_size: int,
        max_num_seqs: int,
        max_blocks_per_sequence: int,
        trash_block: int,
        use_cuda_graphs: bool,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.trash_block = trash_block
        self.device = kv_cache.device
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        rows = max_num_seqs
        # each row's newest token, its position and its sampling seed, in one tensor: a reload is one copy
        self.row_inputs = torch.zeros(3, rows, dtype=torch.long, device=self.device)
        self.token_ids, self.positions, self.seeds = self.row_inputs
        self.step_tokens = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.ones = torch.ones(rows, dtype=torch.long, device=self.device)
        self.step_log_probs = torch.zeros(rows, dtype=torch.float32, device=self.device)
        self.block_tables = torch.full((rows, max_blocks_per_sequence), trash_block, dtype=torch.long, device=self.device)
        self.loaded = LoadedRows([], 0, [], np.zeros(0, dtype=np.int64))
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        self.kv_address: int | None = None  # the KV cache's address the captured graphs read
        self.graph_pool_bytes = 0  # what capturing took from the device (the graphs' pool, at most)

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they read the weights' and the KV cache's memory: call when either
        moves) and their memory pool."""
        self.graphs.clear()
        self.kv_address = None
        self.graph_pool_bytes = 0
        if self.use_cuda_graphs:  # a pool dies with its last graph: later captures need a new one
            self.graph_pool = torch.cuda.graph_pool_handle()

    def padded_rows(self, count: int) -> int:
        """Rows a window of `count` sequences runs on: the smallest captured batch size that holds them."""
        return next(size for size in self.batch_sizes if size >= count) if self.use_cuda_graphs else count

    def can_continue(self, count: int, sampling: SamplingParams) -> bool:
        """Whether a window of `count` of the last window's sequences can be queued behind it now: its graph is
        captured already (a capture would overwrite the rows the last window leaves)."""
        return not self.use_cuda_graphs or self._graph_key(self.padded_rows(count), sampling) in self.graphs

    @torch.inference_mode()
    def launch(self, sequences: list[Sequence], steps: int, sampling: SamplingParams,
               continuing: bool = False) -> DecodeWindow:
        """Queue a window of `steps` decode steps for `sequences` (which must hold slots for them) and return
        it unread. `continuing`: the sequences are some of the last window's, in its order, each to go on from
        where that window leaves it (its tokens not yet read); else their tokens are all on the host."""
        count = len(sequences)
        padded = self.padded_rows(count)
        graph = self._graph(padded, sampling) if self.use_cuda_graphs else None
        if continuing:
            self._continue_rows(sequences, padded, steps)
        else:
            self._load_rows(sequences, padded, steps)
        # A graph reads the table at its full width (the kernel skips unused blocks); an eager step
        # gathers every block of the width it is given, so it gets only what this window can reach
        # (the longest row's length at the window's end).
        width = None if graph is not None else -(-max(self.loaded.lengths) // self.block_size)
        tokens = torch.empty(steps, count, dtype=torch.long, device=self.device)
        log_probs = torch.empty(steps, count, dtype=torch.float32, device=self.device)
        for index in range(steps):
            if graph is not None:
                graph.replay()
            else:
                self._step(padded, sampling, width)
            tokens[index].copy_(self.step_tokens[:count])
            log_probs[index].copy_(self.step_log_probs[:count])
        if self.device.type != "cuda":
            return DecodeWindow(list(sequences), steps, sampling, tokens, log_probs)
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_log_probs = torch.empty(log_probs.shape, dtype=log_probs.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        host_log_probs.copy_(log_probs, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))  # the engine's device, whichever is current
        return DecodeWindow(list(sequences), steps, sampling, host_tokens, host_log_probs, ready)

    def _step(self, rows: int, sampling: SamplingParams, width: int | None = None) -> None:
        """One decode step for the first `rows` buffer rows (block tables cut to `width` columns if given):
        forward, sample, feed the sampled token back."""
        token_ids, positions = self.token_ids[:rows], self.positions[:rows]
        block_tables = self.block_tables[:rows, :width]
        blocks = block_tables.gather(1, (positions // self.block_size)[:, None])[:, 0]
        inputs = AttentionInputs(
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            query_lengths=self.ones[:rows],
            context_lengths=positions + 1,
            block_tables=block_tables,
            block_size=self.block_size,
            is_decode=True,
        )
        hidden = self.model(token_ids, positions, self.kv_cache.layers, inputs)
        next_tokens, log_probs = self.model.sample(hidden, sampling, self.seeds[:rows], positions + 1)
        self.step_tokens[:rows].copy_(next_tokens)
        self.step_log_probs[:rows].copy_(log_probs)
        token_ids.copy_(next_tokens)
        positions.add_(1)

    def _load_rows(self, sequences: list[Sequence], rows: int, steps: int = 0) -> None:
        """Fill the buffers' first `rows` rows for a window of `steps` steps: the sequences, then padding rows
        (token 0 at position 0, every block the trash block).

        When the rows hold the same sequences as the last window left them, each grown by all of that window's
        tokens, the steps have already fed each row its newest token and advanced its position: only the blocks
        taken since (a running sequence's table only grows) are written, and the padding rows go back to
        position 0. The buffers then hold what a full reload would write."""
        lengths = [len(sequence.token_ids) for sequence in sequences]
        table_lengths = np.array([len(sequence.block_table) for sequence in sequences], dtype=np.int64)
        loaded = self.loaded
        if rows == loaded.rows and lengths == loaded.lengths and sequences == loaded.sequences:
            self._write_new_blocks(sequences, table_lengths)
            self.row_inputs[:2, len(sequences) : rows].zero_()
        else:
            self._write_rows(sequences, rows, lengths, table_lengths)
        self.loaded = LoadedRows(list(sequences), rows, [length + steps for length in lengths], table_lengths)

    def _write_rows(self, sequences: list[Sequence], rows: int, lengths: list[int], table_lengths: np.ndarray) -> None:
        """Write the first `rows` rows whole: each sequence's block table (`table_lengths` entries), newest token,
        position and seed (`lengths`: its tokens), then padding rows."""
        count, width = len(sequences), self.block_tables.shape[1]
        block_tables = np.full((rows, width), self.trash_block, dtype=np.int64)
        in_table = np.arange(width) < table_lengths[:, None]
        block_tables[:count][in_table] = list(chain.from_iterable(sequence.block_table for sequence in sequences))
        row_inputs = np.zeros((3, rows), dtype=np.int64)
        row_inputs[0, :count] = [sequence.token_ids[-1] for sequence in sequences]
        row_inputs[1, :count] = np.array(lengths, dtype=np.int64) - 1
        row_inputs[2, :count] = [sequence.seed for sequence in sequences]
        self.block_tables[:rows].copy_(self._to_device(block_tables))
        self.row_inputs[:, :rows].copy_(self._to_device(row_inputs))

    def _continue_rows(self, sequences: list[Sequence], rows: int, steps: int) -> None:
        """Fill the first `rows` rows for a window of `steps` steps that goes on from the last one, whose tokens
        the host has not read: `sequences` are some of its sequences, in its order. The rows it left hold each
        one's newest token and position: rows whose sequence dropped out are closed up on the device, padding
        rows go back to position 0 on the trash block, and the blocks taken since are written."""
        loaded = self.loaded
        row_of = {id(sequence): row for row, sequence in enumerate(loaded.sequences)}
        kept = [row_of[id(sequence)] for sequence in sequences]
        count = len(sequences)
        if kept != list(range(count)):
            index = self._to_device(np.array(kept, dtype=np.int64))
            self.row_inputs[:, :count] = self.row_inputs[:, index]
            self.block_tables[:count] = self.block_tables[index]
        self.row_inputs[:2, count:rows].zero_()
        self.block_tables[count:rows].fill_(self.trash_block)
        written = loaded.table_lengths[kept]
        table_lengths = np.array([len(sequence.block_table) for sequence in sequences], dtype=np.int64)
        self._write_new_blocks(sequences, table_lengths, written)
        lengths = [loaded.lengths[row] for row in kept]
        self.loaded = LoadedRows(list(sequences), rows, [length + steps for length in lengths], table_lengths)

    def _write_new_blocks(self, sequences: list[Sequence], table_lengths: np.ndarray,
                          written: np.ndarray | None = None) -> None:
        """Write the block-table entries each row's sequence took since its row was last written (it has
        `table_lengths` entries now; `written` of them are in its row, by default as the last window left it)."""
        written = self.loaded.table_lengths if written is None else written
        new_blocks = list(chain.from_iterable(
            sequence.block_table[start:] for sequence, start in zip(sequences, written.tolist())))
        if not new_blocks:
            return
        counts = table_lengths - written  # new entries per row
        rank_in_row = np.arange(len(new_blocks)) - np.repeat(np.cumsum(counts) - counts, counts)
        first_new = np.arange(len(sequences)) * self.block_tables.shape[1] + written  # flat index of each row's first
        update = self._to_device(np.stack([np.repeat(first_new, counts) + rank_in_row, np.array(new_blocks)]))
        self.block_tables.put_(update[0], update[1])

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the device, copied from pinned memory without making the host wait for the device."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _graph_key(self, rows: int, sampling: SamplingParams) -> tuple:
        return (rows, sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p)

    def _graph(self, rows: int, sampling: SamplingParams) -> torch.cuda.CUDAGraph:
        """The captured step for `rows` rows and this sampling setting, captured on first use on padding rows."""
        key = self._graph_key(rows, sampling)
        if key not in self.graphs:
            reserved = torch.cuda.memory_reserved(self.device)
            with phase("engine/graph_capture"):
                self.graphs[key] = self._capture(rows, sampling)
            self.graph_pool_bytes += max(torch.cuda.memory_reserved(self.device) - reserved, 0)
            self.kv_address = self.kv_cache.address
        return self.graphs[key]

    def _capture(self, rows: int, sampling: SamplingParams) -> torch.cuda.CUDAGraph:
        """A decode step for `rows` rows captured as a graph, after two warm-up runs on padding rows."""
        self._load_rows([], rows)
        side_stream = torch.cuda.Stream(self.device)
        side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side_stream):
            for _ in range(2):  # compiles the Triton kernels and warms cuBLAS before capture
                self._step(rows, sampling)
        torch.cuda.current_stream(self.device).wait_stream(side_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.graph_pool):
            self._step(rows, sampling)
        return graph
