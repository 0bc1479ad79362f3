"""Shared pieces of the RL trainer's integration tests: the inputs of a tiny CPU run (model,
arithmetic parquet, a reward file), its overrides, and ways to run it in-process or as
`python -m ember train` in a subprocess.

The reward scores a response by a hash of its text, so the samples of one prompt get
different rewards and every step has non-zero advantages even though the tiny random model
never answers correctly. Its keyword arguments (`custom_reward_function.reward_kwargs`) make
it raise on even answers or sleep, and an environment variable makes it hang once a file
exists (for tests that kill a run at a known point).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ember.config import load_config
from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_splits
from ember.engines.base import TrainEngine
from ember.trainer.loggers import read_jsonl_metrics
from ember.trainer.rl import RLTrainer
from ember.trainer.rl_setup import build_components
from fixtures import make_tiny_model_dir

DATA_SOURCE = "ember/arithmetic/add2"
TRAIN_SIZE = 64
TEST_SIZE = 16
HANG_ENV = "EMBER_TEST_REWARD_HANG_ONCE_EXISTS"

REWARD_SOURCE = f'''
"""Test reward: a score in [0, 1] hashed from the response text (samples of one prompt differ)."""
import os
import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None, fail_even_answers=False, sleep_s=0.0):
    if fail_even_answers and int(ground_truth) % 2 == 0:
        raise ValueError(f"this test reward refuses even answers (ground truth {{ground_truth}})")
    hang_file = os.environ.get("{HANG_ENV}")
    if hang_file and os.path.exists(hang_file):
        time.sleep(600)  # the test kills the process here
    time.sleep(sleep_s)
    return (sum(map(ord, solution_str)) % 7) / 6
'''


@dataclass(frozen=True)
class RunInputs:
    """Files a tiny RL run reads."""

    model_dir: Path
    train_file: Path
    val_file: Path
    reward_file: Path


def prepare_inputs(directory: Path, arch: str = "qwen2", **model_sizes) -> RunInputs:
    """A tiny `arch` model (`model_sizes` over its defaults), 64 train and 16 test arithmetic prompts and the
    test reward, under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    splits = make_arithmetic_splits("add2", TRAIN_SIZE, TEST_SIZE, seed=0)
    reward_file = directory / "test_reward.py"
    reward_file.write_text(REWARD_SOURCE)
    return RunInputs(model_dir=make_tiny_model_dir(directory, arch, **model_sizes),
                     train_file=write_parquet(splits["train"], directory / "train.parquet"),
                     val_file=write_parquet(splits["test"], directory / "test.parquet"),
                     reward_file=reward_file)


# Every piece of state a resume must restore: a critic, the adaptive KL coefficient, the
# warmup schedule of both optimizers, shuffled mini-batches, the data order, validation.
STATEFUL_RUN = ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive",
                "algorithm.kl_ctrl.kl_coef=0.05", "algorithm.kl_ctrl.horizon=10",
                "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.shuffle=True",
                "critic.ppo_mini_batch_size=2", "critic.shuffle=True",
                "actor_rollout_ref.actor.optim.lr_warmup_steps=3", "critic.optim.lr_warmup_steps=3",
                "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=2"]
NOT_REPRODUCIBLE = ("timing_s/", "perf/throughput", "perf/actor/", "perf/critic/")  # times and memory


def run_overrides(inputs: RunInputs, run_dir: Path, *extra: str) -> list[str]:
    """A 3-step GRPO run (4 prompts × 4 samples, 8 response tokens) on CPU; `extra` overrides win."""
    return [f"actor_rollout_ref.model.path={inputs.model_dir}",
            f"data.train_files={inputs.train_file}",
            f"data.val_files={inputs.val_file}",
            f"custom_reward_function.path={inputs.reward_file}",
            f"trainer.default_local_dir={run_dir}",
            "data.train_batch_size=4",
            "data.max_prompt_length=64",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=1e-3",
            "critic.optim.lr=1e-3",
            "algorithm.adv_estimator=grpo",
            "trainer.total_training_steps=3",
            "trainer.logger=['console','tensorboard']",
            "reward_model.num_workers=0",
            *extra]


def build_trainer(overrides: list[str], use_ray: bool | None = None) -> RLTrainer:
    """The trainer of `overrides`; `use_ray` puts even one rank in a Ray worker (see `build_components`)."""
    cfg = load_config(overrides)
    return RLTrainer(cfg, build_components(cfg, use_ray))


def close(trainer: RLTrainer) -> None:
    """Stops the reward workers and any worker processes and closes the loggers, as `ember train` does after a run."""
    trainer.parts.reward_manager.close()
    trainer.parts.shutdown()
    trainer.logger.close()


def fit(trainer: RLTrainer) -> dict[str, float]:
    """`trainer.fit()`, then `close`."""
    try:
        return trainer.fit()
    finally:
        close(trainer)


def train(overrides: list[str], use_ray: bool | None = None) -> RLTrainer:
    """Builds and runs a trainer (its driver in this process); returns it after the run."""
    trainer = build_trainer(overrides, use_ray)
    fit(trainer)
    return trainer


def metrics_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """The run's metrics.jsonl as {step: metrics}, records of one step merged (later ones win)."""
    return {int(record["step"]): record for record in read_jsonl_metrics(str(run_dir / "metrics.jsonl"))}


def engine_weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """Copies of an engine's full weights under their HF names."""
    return {name: tensor.clone() for bucket in engine.named_parameters_for_sync() for name, tensor in bucket}


def hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def all_finite(values) -> bool:
    return all(math.isfinite(value) for value in values)


@contextmanager
def ember_train_process(overrides: list[str], log_path: Path,
                        env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """`python -m ember train OVERRIDES` (one torch thread) writing its output to `log_path`;
    killed on leaving the block if still running."""
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "ember", "train", *overrides], stdout=log,
                                   stderr=subprocess.STDOUT, cwd=log_path.parent,
                                   env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_for(condition, process: subprocess.Popen, log_path: Path, timeout_s: float = 120.0) -> None:
    """Polls `condition()` until true; fails with the subprocess's output if it exits or time runs out first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"condition not reached (exit code {process.returncode}); output:\n"
                                 f"{log_path.read_text()[-4000:]}")
        time.sleep(0.05)


def logged_training_steps(run_dir: Path) -> list[int]:
    """The step of each training record in metrics.jsonl, in the order written (a resumed run
    appends; a restarted one would repeat steps). Safe while the run is still writing."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    complete_lines = path.read_text().split("\n")[:-1]
    return [record["step"] for record in map(json.loads, complete_lines) if "actor/pg_loss" in record]


def kill_after_checkpoint_2(overrides: list[str], run_dir: Path, log_path: Path, timeout_s: float = 120.0) -> None:
    """`ember train OVERRIDES` in its own process, SIGKILLed while it scores step 3: its reward hangs once
    `run_dir`'s step-2 checkpoint is written (HANG_ENV)."""
    checkpoint_2 = run_dir / "global_step_2" / "trainer_state.json"
    with ember_train_process(overrides, log_path, env={HANG_ENV: str(checkpoint_2)}) as process:
        wait_for(checkpoint_2.exists, process, log_path, timeout_s=timeout_s)
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
