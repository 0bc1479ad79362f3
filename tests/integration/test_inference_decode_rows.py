"""The decode runner's rows between two windows: when the same sequences run on, only the blocks they took are
written (the steps advanced the rest on the device), and the buffers then hold exactly what a full reload writes:
through sequences finishing, being preempted and joining, and with padding rows (a captured graph's batch size)."""

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


def checked_rows(decoder: DecodeRunner, paths: list[str]) -> None:
    """Check every window's rows against a full reload, noting in `paths` whether only new blocks were written."""
    load_rows, write_new_blocks = decoder._load_rows, decoder._write_new_blocks

    def write_new_blocks_noted(*args):
        paths[-1] = "new blocks"
        write_new_blocks(*args)

    def load_rows_checked(sequences, rows, steps=0):
        paths.append("full")
        load_rows(sequences, rows, steps)
        row_inputs, tables = full_reload(decoder, sequences, rows)
        assert torch.equal(decoder.row_inputs[:, :rows], row_inputs)
        assert torch.equal(decoder.block_tables[:rows], tables)

    decoder._load_rows, decoder._write_new_blocks = load_rows_checked, write_new_blocks_noted


def run(engine, preempted: list[int] | None = None) -> list[Sequence]:
    if preempted is not None:
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda sequence: (preempted.append(sequence.sequence_id), preempt(sequence))
    sequences = [engine.submit(prompt, [index + 1], budget, first_sequence_id=index)[0]
                 for index, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS))]
    while engine.has_unfinished():
        engine.step(SAMPLING)
    return sequences


@pytest.mark.parametrize("window", [3, 6])  # a window takes at most one block per sequence, or up to two
def test_rows_equal_a_full_reload_through_finishes_preemption_and_joins(window):
    model = tiny_model()
    config = dict(max_num_seqs=4, decode_window=window, max_model_len=64, num_kv_blocks=16)  # 6 prompts, 4 slots
    engine, paths, preempted = engine_for(model, **config), [], []
    checked_rows(engine.decoder, paths)
    outputs = run(engine, preempted)

    assert preempted and "new blocks" in paths and paths.count("full") > len(PROMPTS)
    reference = engine_for(model, **config)  # every window's rows written whole
    load_rows = reference.decoder._load_rows

    def full_load_rows(sequences, rows, steps=0):
        reference.decoder.loaded = LoadedRows([], 0, [], np.zeros(0, dtype=np.int64))
        load_rows(sequences, rows, steps)

    reference.decoder._load_rows = full_load_rows
    expected = run(reference)
    assert [(s.token_ids, s.log_probs, s.finish_reason) for s in outputs] == \
           [(s.token_ids, s.log_probs, s.finish_reason) for s in expected]


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
