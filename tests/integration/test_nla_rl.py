"""`ember nla train` and `ember nla eval` end to end on a tiny model (CPU): the fork's run file, NLA GRPO steps
with every metric, checkpoints of both roles, the exported reconstructor, the evaluation, the control tag."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
from fixtures import make_nla_model_dir, nla_rl_row
from transformers import AutoModelForCausalLM

from ember.cli import main
from ember.data.parquet import write_parquet

RUNS = str(Path(__file__).resolve().parents[1] / "nla_configs")
FORK_METRICS = ["critic/critic_loss", "critic/pred_activation_mean", "critic/pred_activation_std",
                "critic/pred_activation_avg_norm", "critic/target_activation_mean", "critic/target_activation_std",
                "critic/target_activation_avg_norm", "critic/mse_with_zero_pred", "critic/mse_with_mean_pred_over_batch",
                "critic/normalized_mse", "critic/normalized_mse_by_zero", "critic/normalized_mse_by_mean_pred_over_batch",
                "critic/lr", "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "actor/entropy",
                "actor/pg_loss", "critic/fve", "nla/injections", "critic/loss"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_nla_model_dir(tmp_path_factory.mktemp("nla-rl"))


def rows(count=8, seed=0):
    rng = random.Random(seed)
    return [nla_rl_row([rng.gauss(0, 1) for _ in range(64)], sample_uuid=f"u{i}") for i in range(count)]


def run_overrides(tmp_path, model_dir, train, steps=2):
    return [f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}", "critic.output_layer_index=1",
            f"data.train_files=[{train}]", "data.val_files=null", "trainer.n_gpus_per_node=1", "trainer.logger=[console]",
            f"trainer.rollout_data_dir={tmp_path}/dumps", "nla_eval.enabled=false",
            f"trainer.default_local_dir={tmp_path}/run", "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=4",
            f"trainer.total_training_steps={steps}", "data.max_response_length=8", "data.max_prompt_length=64",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
            "critic.optim.lr=1e-3", "critic.critic_prompt='Summary:'", "trainer.save_freq=1"]


def nla(command, config, *overrides):
    return main(["nla", command, "--config-path", RUNS, "--config-name", config, *overrides])


def metric_lines(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_nla_grpo_runs_the_forks_file_and_logs_every_metric(tmp_path, model_dir):
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    assert nla("train", "runs/qwen_7b/rl_grpo", *run_overrides(tmp_path, model_dir, train)) == 0
    lines = metric_lines(tmp_path / "run")
    assert [line["step"] for line in lines] == [1, 2]
    for key in FORK_METRICS:
        assert all(key in line for line in lines), key
    assert lines[0]["nla/injections"] == 16 and lines[0]["nla/random_control"] == 0
    assert "critic/acc/mean" not in lines[0]  # no accuracy in NLA: the reward is the reconstruction's
    assert lines[0]["critic/score/mean"] == pytest.approx(-lines[0]["critic/critic_loss"], rel=1e-5)
    for role in ("actor", "critic"):
        assert (tmp_path / "run" / "global_step_2" / role).is_dir()
    critic = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "critic_hf_model")
    initial = AutoModelForCausalLM.from_pretrained(model_dir)
    moved = [(a - b).abs().max() for a, b in zip(critic.parameters(), initial.parameters())]
    assert max(moved) > 0  # the reconstructor trained (lr 1e-3)
    dumped = [json.loads(line) for line in (tmp_path / "dumps" / "1.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and {"score", "advantage", "sample_uuid"} <= set(dumped[0])


def test_a_random_control_file_is_tagged(tmp_path, model_dir):
    train = write_parquet(rows(), tmp_path / "rl_train_layer1_random.parquet")
    assert nla("train", "runs/qwen_7b/rl_grpo", *run_overrides(tmp_path, model_dir, train, steps=1)) == 0
    assert metric_lines(tmp_path / "run")[0]["nla/random_control"] == 1


def test_verls_train_max_samples_draws_the_nla_prompts(tmp_path, model_dir):
    from ember.config import load_config
    from ember.config.schema.nla_train import NLATrainConfig
    from ember.nla.rl_setup import build_nla_components

    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    cfg = load_config([*run_overrides(tmp_path, model_dir, train), "data.train_max_samples=4"], config_path=RUNS,
                      config_name="runs/qwen_7b/rl_grpo", schema=NLATrainConfig)
    parts, _ = build_nla_components(cfg, use_ray=False)
    try:
        drawn = parts.train_loader.dataset
        expected = [int(i) for i in np.random.default_rng(cfg.data.seed).choice(8, 4, replace=False)]
        assert [sample.index for sample in drawn] == expected  # data.shuffle: verl's seeded draw of 4 of the 8 rows
    finally:
        parts.shutdown()


def test_nla_eval_scores_and_writes_explanations(tmp_path, model_dir, capsys):
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    eval_set = write_parquet([{"source_prompt": "the cat", "activation_vector": [0.1] * 64,
                               "expected_completions": ["cat"], "description": "animals_1"}] * 2,
                             tmp_path / "eval.parquet")
    assert nla("eval", "runs/qwen_7b/rl_grpo", *run_overrides(tmp_path, model_dir, train), "~nla_eval.eval_files",
               f"nla_eval.eval_file={eval_set}", "nla_eval.max_new_tokens=6",
               "nla_eval.num_generations_per_prompt=2") == 0
    out = capsys.readouterr().out
    assert "nla_eval/default/accuracy:" in out and "nla_eval/default/accuracy_animals:" in out
    written = (tmp_path / "run" / "nla_eval" / "default" / "0.jsonl").read_text().splitlines()
    assert len(written) == 4


def test_nla_resumes_both_roles_from_its_checkpoint(tmp_path, model_dir):
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    assert nla("train", "runs/qwen_7b/rl_grpo", *run_overrides(tmp_path, model_dir, train, steps=3)) == 0
    straight = metric_lines(tmp_path / "run")
    resumed_dir = tmp_path / "resumed"
    overrides = [*run_overrides(tmp_path, model_dir, train, steps=2), f"trainer.default_local_dir={resumed_dir}"]
    assert nla("train", "runs/qwen_7b/rl_grpo", *overrides) == 0
    assert nla("train", "runs/qwen_7b/rl_grpo", *overrides, "trainer.total_training_steps=3",
               "trainer.resume_mode=auto") == 0
    resumed = metric_lines(resumed_dir)
    assert [line["step"] for line in resumed] == [1, 2, 3]
    for key in ("critic/critic_loss", "critic/loss", "actor/pg_loss"):  # the third step as if never stopped
        assert resumed[2][key] == pytest.approx(straight[2][key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("layout, pools", [
    ("split", ["+ray_kwargs.resource_pool.actor_rollout.num_gpus=1", "+ray_kwargs.resource_pool.critic.num_gpus=1"]),
    ("shared", []),  # no pools: both roles on both ranks, data-parallel, taking turns
])
def test_nla_on_two_ray_workers(tmp_path, model_dir, local_ray, layout, pools):
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    overrides = [*run_overrides(tmp_path, model_dir, train), "trainer.n_gpus_per_node=2", "trainer.device=cpu", *pools]
    assert nla("train", "runs/qwen_7b/rl_grpo", *overrides) == 0
    lines = metric_lines(tmp_path / "run")
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["perf/critic/peak_memory_gb"] >= 0 and line["critic/grad_norm"] > 0 and "critic/fve" in line
        assert line["nla/injections"] == 16


def test_nla_eval_runs_during_training_at_the_forks_steps(tmp_path, model_dir):
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    eval_set = write_parquet([{"source_prompt": "the cat", "activation_vector": [0.1] * 64,
                               "expected_completions": ["cat"], "description": "animals_1"}] * 2,
                             tmp_path / "eval.parquet")
    overrides = [*run_overrides(tmp_path, model_dir, train, steps=3), "nla_eval.enabled=true", "~nla_eval.eval_files",
                 f"nla_eval.eval_file={eval_set}", "nla_eval.freq=10", "nla_eval.max_new_tokens=4",
                 "nla_eval.num_generations_per_prompt=2"]
    assert nla("train", "runs/qwen_7b/rl_grpo", *overrides) == 0
    evaluated = [line["step"] for line in metric_lines(tmp_path / "run") if "nla_eval/default/accuracy" in line]
    assert evaluated == [1, 3]  # step 1, every 10, and the last
    for step in (1, 3):
        assert len((tmp_path / "run" / "nla_eval" / "default" / f"{step}.jsonl").read_text().splitlines()) == 4


def test_the_forks_actor_gradient_scale_divides_the_actor_gradient_by_n(tmp_path, model_dir):
    """nla.fork_actor_gradient_scale: the fork's actor gradient is 1/rollout.n of the mean (docs/nla.md); the
    samples and their loss are the same, so step 1's grad norm is n times smaller and nothing else moves."""
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    lines = {}
    for scaled in (False, True):
        run = tmp_path / f"scaled-{scaled}"
        overrides = [*run_overrides(run, model_dir, train, steps=1), f"nla.fork_actor_gradient_scale={scaled}",
                     "trainer.save_freq=-1", "actor_rollout_ref.actor.grad_clip=1e9"]
        assert nla("train", "runs/qwen_7b/rl_grpo", *overrides) == 0
        lines[scaled] = metric_lines(run / "run")[0]
    n = 4  # run_overrides' rollout.n
    assert lines[True]["actor/grad_norm"] == pytest.approx(lines[False]["actor/grad_norm"] / n, rel=1e-4)
    assert lines[True]["actor/grad_norm"] > 0
    for key in ("actor/pg_loss", "critic/critic_loss", "critic/grad_norm"):
        assert lines[True][key] == pytest.approx(lines[False][key], rel=1e-5, abs=1e-7), key


def test_the_forks_own_rl_file_runs_and_copies_each_checkpoint_to_its_hdfs_dir(tmp_path, model_dir):
    """The fork's real base (tests/verl_fork_configs/nla_grpo_full.yaml) sets trainer.default_hdfs_dir; the run is
    not refused, and each checkpoint is also copied to that folder (here a temporary one)."""
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    fork = str(Path(__file__).resolve().parents[1] / "verl_fork_configs")
    copies = tmp_path / "hdfs"
    overrides = [*run_overrides(tmp_path, model_dir, train, steps=1), f"trainer.default_hdfs_dir={copies}",
                 "actor_rollout_ref.model.trust_remote_code=false", "critic.model.trust_remote_code=false",
                 "trainer.device=auto"]  # the fork's base asks for cuda
    assert main(["nla", "train", "--config-path", fork, "--config-name", "runs/qwen_7b/rl_grpo", *overrides]) == 0
    assert (tmp_path / "run" / "global_step_1").is_dir() and (copies / "global_step_1").is_dir()
    assert sorted(path.name for path in (copies / "global_step_1").iterdir()) == \
        sorted(path.name for path in (tmp_path / "run" / "global_step_1").iterdir())
