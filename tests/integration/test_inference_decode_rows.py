"""The decode runner's rows between two windows: when the same sequences run on, only the blocks they took are
written (the steps advanced the rest on the device), and the buffers then hold exactly what a full reload writes:
through sequences finishing, being preempted and joining, and with padding rows (a captured graph's batch size).
A window queued behind the running one (before its tokens are read) builds its rows from the rows that one
leaves, closed up where sequences dropped out: they too equal a full reload once the tokens are in, and the
tokens equal those of windows run one at a time, through stop tokens (a queued row discarded) and preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_inference_engine import engine_for, tiny_model

from ember.inference.decode_runner import DecodeRunner, LoadedRows
from ember.inference.sequence import Sequence
from ember.rollout.base import SamplingParams

PROMPTS = [[5, 9, 13], [7, 3, 22, 40, 41, 90, 2], [100], [64, 65, 1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15], [8, 8]]
BUDGETS = [14, 30, 9, 22, 30, 17]  # sequences finish in different windows: the rows change, then run on
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=30)


def full_reload(decoder: DecodeRunner, sequences: list[Sequence], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `rows` rows of (newest token, position, seed) and of the block tables, as a full reload writes
    them: the sequences, then padding rows (token 0 at position 0 on the trash block)."""
    padding = rows - len(sequences)
    row_inputs = torch.tensor([[s.token_ids[-1] for s in sequences] + [0] * padding,
                               [len(s) - 1 for s in sequences] + [0] * padding,
                               [s.seed for s in sequences] + [0] * padding])
    width = decoder.block_tables.shape[1]
    tables = [s.block_table + [decoder.trash_block] * (width - len(s.block_table)) for s in sequences]
    return row_inputs, torch.tensor(tables + [[decoder.trash_block] * width] * padding).reshape(rows, width)


def checked_rows(decoder: DecodeRunner, paths: list[str], queued: list | None = None) -> None:
    """Check every window's rows against a full reload, noting in `paths` whether only new blocks were written.
    A queued window's rows (`_continue_rows`) are kept in `queued`, to be checked by `check_queued` once the
    window before it has been read."""
    load_rows, write_new_blocks, continue_rows = decoder._load_rows, decoder._write_new_blocks, decoder._continue_rows

    def continue_rows_kept(sequences, rows, steps):
        closed_up = [id(s) for s in sequences] != [id(s) for s in decoder.loaded.sequences[: len(sequences)]]
        paths.append("queued, closed up" if closed_up else "queued")
        continue_rows(sequences, rows, steps)
        queued.append((list(sequences), rows, decoder.row_inputs[:, :rows].clone(), decoder.block_tables[:rows].clone()))

    def write_new_blocks_noted(*args):
        if paths[-1] == "full":  # the rows were not written whole
            paths[-1] = "new blocks"
        write_new_blocks(*args)

    def load_rows_checked(sequences, rows, steps=0):
        paths.append("full")
        load_rows(sequences, rows, steps)
        row_inputs, tables = full_reload(decoder, sequences, rows)
        assert torch.equal(decoder.row_inputs[:, :rows], row_inputs)
        assert torch.equal(decoder.block_tables[:rows], tables)

    decoder._load_rows, decoder._write_new_blocks = load_rows_checked, write_new_blocks_noted
    if queued is not None:
        decoder._continue_rows = continue_rows_kept


def check_queued(decoder: DecodeRunner, queued: list) -> None:
    """The queued windows' rows, now that the windows before them have been read, against a full reload (but the
    rows of sequences that stopped in the window before: those rows are discarded)."""
    for sequences, rows, row_inputs, tables in queued:
        expected_inputs, expected_tables = full_reload(decoder, sequences, rows)
        going_on = [row for row in range(rows) if row >= len(sequences) or sequences[row].finish_reason is None]
        assert torch.equal(row_inputs[:, going_on], expected_inputs[:, going_on])
        assert torch.equal(tables[going_on], expected_tables[going_on])
    queued.clear()


def run(engine, preempted: list[int] | None = None, queued: list | None = None,
        sampling: SamplingParams = SAMPLING) -> list[Sequence]:
    if preempted is not None:
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda sequence: (preempted.append(sequence.sequence_id), preempt(sequence))
    sequences = [engine.submit(prompt, [index + 1], budget, first_sequence_id=index)[0]
                 for index, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS))]
    while engine.has_unfinished():
        engine.step(sampling)
        if queued:
            check_queued(engine.decoder, queued)
    return sequences


def one_window_at_a_time(model, **config):
    """An engine that reads each window before running the next and writes every window's rows whole."""
    reference = engine_for(model, overlap_decode=False, **config)
    load_rows = reference.decoder._load_rows

    def full_load_rows(sequences, rows, steps=0):
        reference.decoder.loaded = LoadedRows([], 0, [], np.zeros(0, dtype=np.int64))
        load_rows(sequences, rows, steps)

    reference.decoder._load_rows = full_load_rows
    return reference


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-window", "queue-the-next"])
@pytest.mark.parametrize("window", [3, 6])  # a window takes at most one block per sequence, or up to two
def test_rows_equal_a_full_reload_through_finishes_preemption_and_joins(window, overlap):
    model = tiny_model()
    config = dict(max_num_seqs=4, decode_window=window, max_model_len=64, num_kv_blocks=16)  # 6 prompts, 4 slots
    engine, paths, preempted, queued = engine_for(model, overlap_decode=overlap, **config), [], [], []
    checked_rows(engine.decoder, paths, queued)
    outputs = run(engine, preempted, queued)

    assert preempted and paths.count("full") >= len(PROMPTS)  # rows change as prompts join, finish, are preempted
    assert ("queued" in paths) if overlap else ("new blocks" in paths)  # queued: the last prompts, none waiting
    expected = run(one_window_at_a_time(model, **config))
    assert [(s.token_ids, s.log_probs, s.finish_reason) for s in outputs] == \
           [(s.token_ids, s.log_probs, s.finish_reason) for s in expected]


def test_queued_windows_draw_the_tokens_of_windows_run_one_at_a_time_through_stop_tokens():
    """Sequences stop inside windows that already have the next one queued: those queued rows are discarded, the
    others' tokens kept; every sequence ends as without queueing, and every block is given back."""
    model = tiny_model()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(3, 17, 40, 77))
    config = dict(max_num_seqs=8, decode_window=4, max_model_len=64)
    engine, paths, queued = engine_for(model, **config), [], []
    checked_rows(engine.decoder, paths, queued)
    discarded = []
    accept = engine._accept

    def accept_noting_discards(sequences, tokens, log_probs, stop_token_ids):
        discarded.extend(s.sequence_id for s in sequences if s.status.value == "finished")
        return accept(sequences, tokens, log_probs, stop_token_ids)

    engine._accept = accept_noting_discards
    outputs = run(engine, queued=queued, sampling=sampling)
    expected = run(one_window_at_a_time(model, **config), sampling=sampling)

    assert {s.finish_reason for s in outputs} == {"stop", "length"}
    assert discarded and "queued, closed up" in paths
    assert [(s.token_ids, s.finish_reason) for s in outputs] == [(s.token_ids, s.finish_reason) for s in expected]
    # a closed-up window runs its rows at other batch positions, and a CPU GEMM may round a row a last bit apart
    # by its position (seen on an AVX-512 machine: 1 ulp in 2 of 6 answers); the draws themselves must not move
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs), atol=1e-5, rtol=0)
    assert engine._queued is None and engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_padding_rows_go_back_to_position_zero_and_rows_whose_tokens_were_not_all_kept_are_reloaded():
    engine = engine_for(tiny_model(), max_num_seqs=8, decode_window=5)
    decoder, paths, rows, steps = engine.decoder, [], 8, 5
    checked_rows(decoder, paths)
    for index, prompt in enumerate(PROMPTS[:3]):
        engine.submit(prompt, [index + 1], 30, first_sequence_id=index)
    engine.step(SAMPLING)  # the prefill
    for kept in [steps, steps, steps, 2, steps]:  # windows on 8 rows, as a graph captured for 8 rows runs them
        sequences = engine.scheduler.schedule(lookahead=steps).decode_sequences
        decoder._load_rows(sequences, rows, steps)
        drawn = []
        for _ in range(steps):
            decoder._step(rows, SAMPLING)
            drawn.append(decoder.step_tokens[: len(sequences)].tolist())
        for sequence, tokens in zip(sequences, zip(*drawn)):
            sequence.extend(list(tokens[:kept]), [0.0] * kept)
    assert paths == ["full", "new blocks", "new blocks", "new blocks", "full"]  # the 4th window's rows ran ahead
