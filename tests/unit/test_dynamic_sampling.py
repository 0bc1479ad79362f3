"""DAPO's dynamic sampling loop (`trainer/dynamic_sampling.py`) on hand-made rounds: it logs each
extra round, keeps verl's round limit, and stops instead of generating forever when no group varies."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from ember.data.batch import Batch
from ember.errors import UserError
from ember.trainer.dynamic_sampling import sample_dynamically
from ember.trainer.experience import Experience, Scores

GROUPS, N = 4, 2  # prompt groups per round, samples per group


def one_round(uid_prefix: str, scores: list[float]) -> tuple[Experience, Scores]:
    """A round of GROUPS groups of N samples, sample i scoring scores[i]."""
    size = GROUPS * N
    batch = Batch.from_rollout([[1]] * size, [[2, 3]] * size, pad_token_id=0,
                               uids=[f"{uid_prefix}-{i // N}" for i in range(size)])
    tensor = torch.tensor(scores, dtype=torch.float32)
    return (Experience(batch=batch, responses=["r"] * size, prompts=[None] * size),
            Scores(scores=tensor, accuracies=tensor, metrics={}, extras={}))


def alike(_prompts, uid_prefix):
    return one_round(uid_prefix, [1.0] * (GROUPS * N))


def run(generate_round, max_num_gen_batches: int, first=None, round_cap: int = 1000):
    """sample_dynamically with a round counter; fails (instead of hanging) past `round_cap` rounds."""
    calls = []

    def counted(prompts, uid_prefix):
        calls.append(uid_prefix)
        if len(calls) > round_cap:
            pytest.fail(f"dynamic sampling generated more than {round_cap} rounds without stopping")
        return generate_round(prompts, uid_prefix)

    experience, scored = first or alike(None, "step1")
    options = SimpleNamespace(metric="acc", max_num_gen_batches=max_num_gen_batches)
    return sample_dynamically(experience, scored, counted, lambda: [], options, GROUPS, "step1"), calls


def test_a_reward_that_never_varies_stops_the_default_unlimited_loop_naming_the_keys():
    with pytest.raises(UserError, match=r"reward never varies within a group.*max_num_gen_batches") as raised:
        run(alike, max_num_gen_batches=0)
    assert "the last 40 prompt groups generated" in str(raised.value)  # ten steps' worth of 4 groups


def test_rounds_that_keep_some_groups_reset_the_empty_count(caplog):
    # every 9th round keeps one group: never ten steps' worth of empty rounds in a row
    rounds = []

    def sparse(prompts, uid_prefix):
        rounds.append(uid_prefix)
        varied = len(rounds) % 9 == 0
        return one_round(uid_prefix, [float(i % 2) if varied and i < N else 1.0 for i in range(GROUPS * N)])

    with caplog.at_level(logging.INFO, logger="ember.trainer"):
        (experience, _, metrics), calls = run(sparse, max_num_gen_batches=0)
    assert metrics["batch/kept_groups"] == GROUPS and len(calls) == 36
    assert len(set(experience.batch.uids)) == GROUPS
    extra_rounds = [record.getMessage() for record in caplog.records if "generating round" in record.getMessage()]
    assert len(extra_rounds) == 36
    assert ("3 of the 4 prompt groups a step needs kept after 36 round(s) (144 generated); generating round 37"
            in extra_rounds[-1])


def test_a_positive_max_num_gen_batches_stops_after_that_many_rounds_as_verl_does():
    with pytest.raises(UserError, match=r"20 generation rounds \(max_num_gen_batches=20\) kept 0 of the 4"):
        run(alike, max_num_gen_batches=20)  # beyond the default's empty-round bound: verl's limit decides
