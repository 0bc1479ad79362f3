"""The `ember nla` commands: train, sft, extract, eval, each a configured command of trainer/command_line.py.

Every one takes `--config-path/--config-name`, key=value overrides, `--print-config` and
`--describe`, and exits 2 on a user error. Without `--config-name`, train and eval start from
ember's `nla_grpo_full` and extract from `nla_activation_dataset` (the fork's bases). A real
run first makes the checks that need the model and the data (ember/nla/checks.py), then the
feature check (config/features.py), then calls its entry point: `ember.nla.rl.run_nla_rl`,
`ember.nla.sft.run_nla_sft`, `ember.nla.extract.run_extract` or `run_nla_eval` here.
This module imports only the configuration; the rest is imported when a run starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.config.features import NLA_EVAL_UNIMPLEMENTED
from ember.config.schema.nla_extract import NLAExtractConfig
from ember.config.schema.nla_sft import NLASFTConfig
from ember.config.schema.nla_train import NLATrainConfig
from ember.trainer.command_line import RunPlan


@dataclass(frozen=True)
class NLACommand:
    """One `ember nla` subcommand: its configuration root, its default base and what it does."""

    summary: str
    schema: type
    default_config: str | None
    plan: Any  # cfg -> RunPlan


def _train_checks(cfg: NLATrainConfig) -> None:
    from ember.nla.checks import check_nla_train_start, log_notes, nla_run_notes

    log_notes(nla_run_notes(cfg))
    check_nla_train_start(cfg)


def _run_nla_rl(cfg: NLATrainConfig) -> int:
    from ember.nla.rl import run_nla_rl

    return run_nla_rl(cfg)


def _sft_checks(cfg: NLASFTConfig) -> None:
    from ember.nla.checks import check_nla_sft_start

    check_nla_sft_start(cfg)


def _run_nla_sft(cfg: NLASFTConfig) -> int:
    from ember.nla.sft import run_nla_sft

    return run_nla_sft(cfg)


def _run_extract(cfg: NLAExtractConfig) -> int:
    from ember.nla.extract import run_extract

    return run_extract(cfg)


def _eval_checks(cfg: NLATrainConfig) -> None:
    from ember.config.errors import ConfigError
    from ember.nla.checks import check_data_markers, log_notes, nla_run_notes
    from ember.nla.eval import eval_sets
    from ember.trainer.rl_setup import check_data_files, check_model_path

    evaluation = cfg.nla_eval
    sets = eval_sets(evaluation.eval_files, evaluation.eval_file)
    if not sets:
        raise ConfigError("ember nla eval needs nla_eval.eval_files ({NAME: parquet}) or nla_eval.eval_file")
    if cfg.actor_rollout_ref.model.path is None:
        raise ConfigError("actor_rollout_ref.model.path is not set; point it at the actor to evaluate (an HF folder)")
    log_notes(nla_run_notes(cfg))
    model = cfg.actor_rollout_ref.model
    check_model_path("actor_rollout_ref.model.path", model.path)
    for name, path in sets.items():
        check_data_files(f"nla_eval.eval_files.{name}", path)
    check_data_markers(list(sets.values()), model.tokenizer_path or model.path, cfg.nla.injection.injection_token,
                       model.trust_remote_code)


def run_nla_eval(cfg: NLATrainConfig) -> int:
    """The string-match evaluation of `actor_rollout_ref.model.path`: metrics printed, explanations written as JSON
    lines under `trainer.default_local_dir/nla_eval/<set>/0.jsonl`."""
    import dataclasses
    from pathlib import Path

    from ember.distributed.device import request_device
    from ember.nla.data import reading_options
    from ember.nla.eval import eval_sampling, evaluate, read_eval_sets, write_explanations
    from ember.rollout.ember_rollout import EmberRollout
    from ember.trainer.rank_setup import engine_config, load_tokenizer, stop_token_ids

    model, evaluation = cfg.actor_rollout_ref.model, cfg.nla_eval
    tokenizer = load_tokenizer(cfg)
    sets = read_eval_sets(evaluation, tokenizer, *reading_options(cfg.nla, tokenizer, model.path, model.trust_remote_code))
    request_device(cfg.trainer.device)
    longest = max(len(record.prompt_ids) for records in sets.values() for record in records)
    config = engine_config(cfg.actor_rollout_ref.rollout)
    config = dataclasses.replace(config, max_model_len=max(config.max_model_len, longest + evaluation.max_new_tokens))
    rollout = EmberRollout.from_pretrained(model.path, config)
    sampling = eval_sampling(evaluation, stop_token_ids(model.path, tokenizer), seed=cfg.trainer.seed)
    metrics, explanations = evaluate(rollout, sets, sampling, tokenizer, mode=cfg.nla.injection.mode)
    for name, records in sets.items():
        write_explanations(Path(cfg.trainer.default_local_dir) / "nla_eval", name, 0, records, explanations[name],
                           sampling.n)
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    return 0


NLA_COMMANDS: dict[str, NLACommand] = {
    "train": NLACommand("NLA RL (GRPO): the actor explains injected vectors, the critic rebuilds them from the words",
                        NLATrainConfig, "nla_grpo_full",
                        lambda cfg: RunPlan(_run_nla_rl, checks=_train_checks)),
    "sft": NLACommand("NLA SFT of the actor (nla.train_mode=actor) or the critic (nla.train_mode=critic)",
                      NLASFTConfig, None, lambda cfg: RunPlan(_run_nla_sft, checks=_sft_checks)),
    "extract": NLACommand("write NLA RL / SFT / eval rows: a base model's activation vectors over text documents",
                          NLAExtractConfig, "nla_activation_dataset", lambda cfg: RunPlan(_run_extract)),
    "eval": NLACommand("the string-match evaluation of an NLA actor (nla_eval.*)", NLATrainConfig, "nla_grpo_full",
                       lambda cfg: RunPlan(run_nla_eval, checks=_eval_checks, feature_rows=NLA_EVAL_UNIMPLEMENTED)),
}
