"""The built-in demo run as a layer of overrides under the user's own.

`ember train` with neither `actor_rollout_ref.model.path` nor `data.train_files` runs the
demo (`ember/trainer/builtin.py`): GRPO on two-digit addition with a small model it trains
from scratch. These settings size the run for a laptop CPU; anything the user passes on the
command line or in a config file is applied after them and wins.
"""

from __future__ import annotations

BUILTIN_DEMO_DIR = "${trainer.default_local_dir}/builtin"

BUILTIN_DEMO_OVERRIDES = [
    "trainer.experiment_name=builtin-arithmetic",
    f"actor_rollout_ref.model.path={BUILTIN_DEMO_DIR}/model-warm",
    f"data.train_files={BUILTIN_DEMO_DIR}/train.parquet",
    f"data.val_files={BUILTIN_DEMO_DIR}/test.parquet",
    "data.train_batch_size=16",
    "data.max_prompt_length=64",
    "data.max_response_length=40",
    "actor_rollout_ref.rollout.n=8",
    # below 1 the samples of a prompt differ where the model hesitates, not at random tokens: the
    # reward then tells GRPO which of its own answers to prefer
    "actor_rollout_ref.rollout.temperature=0.6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "actor_rollout_ref.actor.optim.lr_warmup_steps=5",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "algorithm.adv_estimator=grpo",
    "trainer.total_training_steps=60",
    "trainer.test_freq=10",
    "trainer.save_freq=20",
    "trainer.logger=['console','tensorboard']",
    "reward_model.num_workers=0",
]


def is_builtin_demo(model_path: str | None, train_files) -> bool:
    """The demo runs when the user names neither a model nor training data."""
    return model_path is None and train_files is None
