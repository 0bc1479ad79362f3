"""Numbers no range check can catch: NaN and infinity, integers past 64 bits, seeds torch cannot
take, and sizes no machine can allocate.

A comparison with NaN is always false, so `lr=nan` passes `lr >= 0` and every other range; this
module walks every float field of the schema (`number_errors`) and refuses any that is not
finite. No key of the schema documents infinity as a meaning ("no limit" is spelled 0, -1 or
null), so there is no exception. Integers must fit torch's int64 (a 20-digit `rollout.n` would
otherwise reach the arithmetic of the later checks), seeds must be in [0, 2**64) (torch's
`manual_seed`; numpy refuses negative seeds), token lengths at most `MAX_TOKENS` (the engine's
RoPE tables and KV cache are sized by them), the responses of one step at most
`MAX_RESPONSES` and the run's GPUs at most `MAX_GPUS`. `validate.py` reports these errors
before any other check, which could hang or mislead on such numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ember.config.introspect import field_types, union_members, value_at
from ember.config.schema import EmberConfig, SFTConfig
from ember.config.schema.nla_extract import NLAExtractConfig
from ember.config.schema.nla_train import NLATrainConfig

MAX_INT = 2**63 - 1  # torch's int64
MAX_SEED = 2**64 - 1  # torch.manual_seed's range
MAX_TOKENS = 2**24
"""Longest sequence, token budget or generation a key may ask for (16,777,216 tokens: beyond any model's context)."""
MAX_RESPONSES = 2**24
"""Most responses (or examples) one step or round may hold."""
MAX_GPUS = 2**20
"""Most GPUs a run may have (trainer.nnodes × trainer.n_gpus_per_node)."""

_RL_TOKEN_KEYS = (
    "data.max_prompt_length", "data.max_response_length", "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.response_length", "actor_rollout_ref.rollout.max_model_len",
    "actor_rollout_ref.rollout.max_num_batched_tokens", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu", "reward_model.max_length",
    "reward_model.forward_max_token_len_per_gpu")
_SFT_TOKEN_KEYS = ("data.max_length", "data.max_token_len_per_gpu")
_NLA_TOKEN_KEYS = ("nla_eval.max_new_tokens",)
_EXTRACT_TOKEN_KEYS = ("sampling.max_length", "response.summarizer.max_new_tokens")


def number_errors(cfg: Any) -> list[str]:
    """Every non-finite float, out-of-range integer or seed, and unallocatable size of the root configuration `cfg`."""
    errors = _field_errors(cfg, "")
    if errors:
        return errors
    return _size_errors(cfg)


def _field_errors(section: Any, prefix: str) -> list[str]:
    errors = []
    for name, annotation in field_types(type(section)).items():
        value, key = getattr(section, name), f"{prefix}{name}"
        if dataclasses.is_dataclass(value):
            errors += _field_errors(value, key + ".")
        elif isinstance(value, list):
            errors += [error for index, item in enumerate(value) for error in _value_errors(f"{key}[{index}]", name, item)]
        elif float in union_members(annotation) or int in union_members(annotation):
            errors += _value_errors(key, name, value)
    return errors


def _value_errors(key: str, name: str, value: Any) -> list[str]:
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{key}={value}: must be a finite number"]
    if not isinstance(value, int) or isinstance(value, bool):
        return []
    if name == "seed":
        return [] if 0 <= value <= MAX_SEED else [f"{key}={value}: a seed must be in [0, 2**64 - 1] (what torch takes)"]
    if abs(value) > MAX_INT:
        return [f"{key}={value}: too large; give a number below 2**63"]
    return []


def _size_errors(cfg: Any) -> list[str]:
    if isinstance(cfg, EmberConfig):
        token_keys = _RL_TOKEN_KEYS + (_NLA_TOKEN_KEYS if isinstance(cfg, NLATrainConfig) else ())
        batches = [("data.train_batch_size", "actor_rollout_ref.rollout.n", "responses"),
                   ("data.gen_batch_size", "actor_rollout_ref.rollout.n", "responses"),
                   ("data.val_batch_size", "actor_rollout_ref.rollout.val_kwargs.n", "responses")]
    elif isinstance(cfg, SFTConfig):
        token_keys, batches = _SFT_TOKEN_KEYS, [("data.train_batch_size", None, "examples")]
    elif isinstance(cfg, NLAExtractConfig):
        token_keys, batches = _EXTRACT_TOKEN_KEYS, [("sampling.parallel_batch_size", None, "documents")]
    else:
        return []
    errors = []
    if not isinstance(cfg, NLAExtractConfig):
        nodes, per_node = cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node
        if nodes * per_node > MAX_GPUS:
            errors.append(f"trainer.nnodes × trainer.n_gpus_per_node = {nodes} × {per_node} GPUs: "
                          f"give at most {MAX_GPUS:,} (2**20)")
    for key in token_keys:
        value = value_at(cfg, key)
        if value is not None and value > MAX_TOKENS:
            errors.append(f"{key}={value} tokens cannot be allocated: give at most {MAX_TOKENS:,} (2**24)")
    for count_key, n_key, noun in batches:
        count, n = value_at(cfg, count_key), 1 if n_key is None else value_at(cfg, n_key)
        if count is not None and count * n > MAX_RESPONSES:
            what = f"{count_key} × {n_key} = {count} × {n} = {count * n}" if n_key else f"{count_key}={count}"
            errors.append(f"{what} {noun} in one batch cannot be allocated: give at most {MAX_RESPONSES:,} (2**24)")
    return errors
