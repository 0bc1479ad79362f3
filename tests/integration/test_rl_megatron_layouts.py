"""A whole RL step under Megatron's model-parallel layouts equals the one-rank step, on a CPU.

Each run is `ember train`'s trainer with its ranks in Ray workers that run megatron-core behind
megatron_on_cpu's stand-ins (gloo between the ranks), in fp32, so layouts agree to rounding.
Two steps of 4 prompts × 4 samples with two mini-batches per step: the ranks of one tensor- or
pipeline-parallel replica must take the same samples (the trainer dispatches by the engines'
data layout), and each mini-batch must be divided by the data-parallel size, not the world size.
Generation (ember's engine on every rank, seeded by each sample's place in the batch) draws
the same tokens at every layout, so every logged metric of both steps and the exported weights
must match. The same for PPO with a Megatron critic and for NLA with actor and reconstructor on
Megatron at TP=2.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rl_helpers import NOT_REPRODUCIBLE, hf_weights, metrics_by_step, prepare_inputs, run_overrides, train

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.slow

MEGATRON = ["actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
            "critic.strategy=megatron", "actor_rollout_ref.actor.megatron.param_dtype=float32",
            "actor_rollout_ref.ref.megatron.param_dtype=float32", "critic.megatron.param_dtype=float32",
            "actor_rollout_ref.rollout.name=ember", "trainer.device=cpu", "trainer.total_training_steps=2",
            "trainer.val_before_train=False", "trainer.test_freq=-1",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
            # two micro-batches of 4 everywhere: the interleaved schedule needs a multiple of the pipeline
            # size, and the loss metrics are means over micro-batches
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]


def sizes(role: str, tp: int = 1, pp: int = 1, vpp: int | None = None) -> list[str]:
    section = f"actor_rollout_ref.{role}" if role in ("actor", "ref") else role
    return [f"{section}.megatron.tensor_model_parallel_size={tp}", f"{section}.megatron.pipeline_model_parallel_size={pp}",
            f"{section}.megatron.virtual_pipeline_model_parallel_size={vpp if vpp else 'null'}"]


@pytest.fixture(scope="module")
def megatron_ray():
    """A local Ray whose worker processes start with megatron_on_cpu's stand-ins."""
    ray = pytest.importorskip("ray")
    here = Path(__file__).parent
    path = os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])
    if ray.is_initialized():  # a Ray another test's run left up (its driver process is this one): start clean
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"},
                          "worker_process_setup_hook": "megatron_on_cpu.stand_in_cuda"})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny Qwen2 of 4 layers (2 pipeline stages × 2 virtual ones), 4 heads and 2 key-value heads."""
    return prepare_inputs(tmp_path_factory.mktemp("megatron-rl"), num_hidden_layers=4)


def run(inputs, run_dir: Path, ranks: int, *layout: str) -> tuple[dict, dict]:
    train(run_overrides(inputs, run_dir, *MEGATRON, f"trainer.n_gpus_per_node={ranks}", *layout), use_ray=True)
    return metrics_by_step(run_dir), hf_weights(run_dir / "hf_model")


def assert_same_run(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    (metrics, weights), (expected_metrics, expected_weights) = got, expected
    for step in (1, 2):
        compared = [key for key in expected_metrics[step] if not key.startswith(NOT_REPRODUCIBLE)]
        assert "actor/grad_norm" in compared and "actor/entropy" in compared
        for key in compared:
            assert metrics[step][key] == pytest.approx(expected_metrics[step][key], rel=1e-4, abs=1e-5), (step, key)
    # Adam divides by the gradient's size, so a weight whose gradient is ~0 may move by a few lr-sized
    # rounding steps of its own; a wrong update moves every weight by up to lr (1e-3) each step.
    for name, weight in expected_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=0, atol=1e-4, msg=name)


@pytest.fixture(scope="module")
def grpo_one_rank(inputs, tmp_path_factory, megatron_ray):
    return run(inputs, tmp_path_factory.mktemp("tp1"), 1)


# Tensor parallelism of the actor is in the PPO and NLA tests below; a plain pipeline (no virtual stages)
# dispatches as this one does (its schedule is the engine tests' business: test_megatron_parallel_cpu.py).
# The rollout spans both ranks here (rollout TP=2), so the Megatron stages' weights reach a split engine.
def test_a_grpo_step_with_pipeline_stages_equals_the_one_rank_step(inputs, tmp_path, grpo_one_rank):
    layout = sizes("actor", pp=2, vpp=2) + sizes("ref", pp=2, vpp=2)
    assert_same_run(run(inputs, tmp_path, 2, *layout, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
                    grpo_one_rank)


def test_ppo_with_a_megatron_critic_at_tensor_parallel_2_equals_the_one_rank_step(inputs, tmp_path, megatron_ray):
    ppo = ["algorithm.adv_estimator=gae"]
    expected = run(inputs, tmp_path / "one", 1, *ppo)
    got = run(inputs, tmp_path / "two", 2, *ppo, *sizes("actor", tp=2), *sizes("critic", tp=2))
    assert "critic/grad_norm" in got[0][1] and "critic/vf_loss" in got[0][2]
    assert_same_run(got, expected)


NLA_RUN = Path(__file__).resolve().parents[1] / "nla_configs"


def run_nla(model_dir: Path, train_file: Path, run_dir: Path, ranks: int, *layout: str) -> tuple[dict, dict]:
    """Two NLA GRPO steps of the fork's 7B run file on the tiny model, actor and reconstructor on Megatron."""
    from ember.config.loader import load_config
    from ember.config.schema.nla_train import NLATrainConfig
    from ember.nla.rl import run_nla_rl

    overrides = [f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
                 "critic.output_layer_index=1", f"data.train_files=[{train_file}]", "data.val_files=null",
                 f"trainer.n_gpus_per_node={ranks}", "trainer.device=cpu", "trainer.logger=[console]",
                 "nla_eval.enabled=false", f"trainer.default_local_dir={run_dir}", "data.train_batch_size=4",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
                 "trainer.total_training_steps=2", "data.max_response_length=8", "data.max_prompt_length=64",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=8",
                 "critic.ppo_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-3", "critic.critic_prompt='Summary:'",
                 "trainer.save_freq=-1", f"trainer.rollout_data_dir={run_dir}/dumps", "actor_rollout_ref.rollout.name=ember",
                 "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
                 "critic.strategy=megatron", "actor_rollout_ref.actor.megatron.param_dtype=float32",
                 "actor_rollout_ref.ref.megatron.param_dtype=float32", "critic.megatron.param_dtype=float32", *layout]
    cfg = load_config(overrides, str(NLA_RUN), "runs/qwen_7b/rl_grpo", schema=NLATrainConfig)
    assert run_nla_rl(cfg, use_ray=True) == 0
    return metrics_by_step(run_dir), hf_weights(run_dir / "critic_hf_model")


def test_nla_with_actor_and_reconstructor_at_tensor_parallel_2_equals_the_one_rank_run(tmp_path, megatron_ray):
    import random

    from ember.data.parquet import write_parquet
    from fixtures import make_nla_model_dir, nla_rl_row

    model_dir = make_nla_model_dir(tmp_path)
    rng = random.Random(0)
    train = write_parquet([nla_rl_row([rng.gauss(0, 1) for _ in range(64)], sample_uuid=f"u{i}") for i in range(8)],
                          tmp_path / "rl_train_layer1.parquet")
    expected = run_nla(model_dir, train, tmp_path / "one", 1)
    got = run_nla(model_dir, train, tmp_path / "two", 2, *sizes("actor", tp=2), *sizes("ref", tp=2),
                  *sizes("critic", tp=2))
    assert got[0][1]["critic/critic_loss"] > 0 and "critic/fve" in got[0][2]
    assert_same_run(got, expected)
