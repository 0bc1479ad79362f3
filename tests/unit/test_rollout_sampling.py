"""Rollout records and pure helpers: SamplingParams checks, log-probs, trimming, padding, GenerationConfig."""

from __future__ import annotations

import math

import pytest
import torch

from ember.inference.sampling import log_prob_temperature, token_log_probs
from ember.rollout.base import SamplingParams
from ember.rollout.hf import build_generation_config, left_pad
from ember.rollout.sampling import trim_response


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n", 0, "n=0"),
        ("temperature", -0.1, "temperature >= 0"),
        ("top_p", 0.0, "top_p in \\(0, 1\\]"),
        ("top_p", 1.5, "top_p in \\(0, 1\\]"),
        ("top_k", -2, "-1 / 0 for off"),
        ("max_new_tokens", 0, "at least 1"),
    ],
)
def test_sampling_params_reject_bad_values_with_a_fix(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_greedy_and_top_k_switches():
    assert SamplingParams(do_sample=False, temperature=0.8).greedy
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.8).greedy
    assert not SamplingParams(top_k=-1).top_k_enabled
    assert not SamplingParams(top_k=0).top_k_enabled
    assert SamplingParams(top_k=5).top_k_enabled


def test_log_prob_temperature_is_one_for_greedy_zero():
    assert log_prob_temperature(SamplingParams(temperature=0.0)) == 1.0
    assert log_prob_temperature(SamplingParams(temperature=0.6)) == 0.6
    assert log_prob_temperature(SamplingParams(temperature=0.6, do_sample=False)) == 0.6


def test_token_log_probs_hand_computed():
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    tokens = torch.tensor([1, 0])
    # temperature 1: probabilities 1/4, 3/4
    torch.testing.assert_close(token_log_probs(logits, tokens, 1.0), torch.tensor([math.log(0.75), math.log(0.25)]))
    # temperature 0.5 squares the odds: 1/10, 9/10
    torch.testing.assert_close(token_log_probs(logits, tokens, 0.5), torch.tensor([math.log(0.9), math.log(0.1)]))


def test_token_log_probs_is_float32_for_half_logits():
    logits = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    result = token_log_probs(logits, torch.zeros(2, 3, dtype=torch.long), 1.0)
    assert result.shape == (2, 3) and result.dtype == torch.float32
    torch.testing.assert_close(result, torch.full((2, 3), math.log(0.25)))


def test_trim_response_cuts_after_first_stop_token():
    assert trim_response([4, 5, 9, 0, 0], (9, 7), ignore_eos=False) == ([4, 5, 9], "stop")
    assert trim_response([7, 9, 0], (9, 7), ignore_eos=False) == ([7], "stop")
    assert trim_response([4, 5, 6], (9,), ignore_eos=False) == ([4, 5, 6], "length")
    assert trim_response([4, 9, 6], (9,), ignore_eos=True) == ([4, 9, 6], "length")
    assert trim_response([4, 9, 6], (), ignore_eos=False) == ([4, 9, 6], "length")


def test_left_pad_aligns_prompts_right():
    input_ids, attention_mask = left_pad([[1, 2, 3], [4]], pad_token_id=0, device=torch.device("cpu"))
    assert input_ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_generation_config_pins_every_sampling_knob():
    config = build_generation_config(
        SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, max_new_tokens=33, stop_token_ids=(2, 5)), pad_token_id=0
    )
    assert config.do_sample and config.temperature == 0.7 and config.top_p == 0.9
    assert config.top_k == 0  # off; unset would become transformers' default of 50
    assert config.max_new_tokens == 33 and config.eos_token_id == [2, 5] and config.pad_token_id == 0
    assert config.repetition_penalty == 1.0 and config.use_cache
    # nothing is kept per step: generate returns only the sequences
    assert not config.return_dict_in_generate and not config.output_logits and not config.output_scores

    greedy = build_generation_config(SamplingParams(do_sample=False, temperature=0.7, top_k=5, top_p=0.5), 0)
    assert not greedy.do_sample and greedy.top_k is None and greedy.top_p is None and greedy.temperature is None

    ignoring = build_generation_config(SamplingParams(stop_token_ids=(2,), ignore_eos=True), 0)
    assert ignoring.eos_token_id == []
