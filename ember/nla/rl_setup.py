"""Builds the driver's parts of an `ember nla train` run: the prompts with their vectors and the role groups
(each rank's roles, the reconstructor included, are `trainer/rank_setup.build_rank_roles`'s).

The actor, its rollout and the resource pools are `trainer/rl_setup`'s: an NLA run differs in its data
(`NLAPromptDataset`), in the actor's forwards (the batch carries the vectors, which the engine
injects) and in its critic, a `Reconstructor` in place of a value model, placed where the
critic's pool is.
"""

from __future__ import annotations

import logging

from ember.config.nla_rules import data_variant
from ember.config.schema.nla_train import NLATrainConfig
from ember.data.prompt_loader import PromptLoader
from ember.data.rl_dataset import sample_positions
from ember.nla.data import NLAPromptDataset, reading_options
from ember.trainer.rank_setup import load_tokenizer, run_noise_injection, stop_token_ids
from ember.trainer.rl_setup import RLComponents, build_worker_groups, total_training_steps, warn_overridden_settings
from ember.trainer.role_groups import ActorGroup, ReconstructorGroup, ReferenceGroup, RolloutGroup
from ember.trainer.startup import StartUp

logger = logging.getLogger(__name__)


def build_nla_components(cfg: NLATrainConfig, use_ray: bool | None = None) -> tuple[RLComponents, list[int]]:
    """The driver's parts of an NLA run, and the token ids of `critic.critic_prompt` (none when unset);
    `use_ray` as `trainer/rl_setup.build_worker_groups` takes it."""
    arr, data = cfg.actor_rollout_ref, cfg.data
    startup = StartUp()
    with startup.phase("data"):
        tokenizer = load_tokenizer(cfg)
        marker, vectors = reading_options(cfg.nla, tokenizer, arr.model.path, arr.model.trust_remote_code)
        dataset = NLAPromptDataset(data.train_files, tokenizer, marker, vectors, prompt_key=data.prompt_key,
                                   max_prompt_length=data.max_prompt_length, truncation=data.truncation,
                                   position=cfg.nla.injection.position)
        positions = sample_positions(len(dataset), data.train_max_samples, data.seed if data.shuffle else None)
        if len(positions) < len(dataset):  # data.train_max_samples, drawn as for RL prompts (rl_dataset.py)
            dataset = [dataset[position] for position in positions]
    logger.info("NLA data: %d prompts, marker %r (token %d), %s run", len(dataset), marker.character, marker.token_id,
                data_variant(data.train_files))
    loader = PromptLoader(dataset, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    total_steps = total_training_steps(cfg, len(loader))
    warn_overridden_settings(cfg, total_steps)
    with startup.phase("roles"):
        groups = build_worker_groups(cfg, total_steps, use_ray)
    n = arr.rollout.n
    parts = RLComponents(
        tokenizer=tokenizer, train_loader=loader, val_dataset=None,
        actor=ActorGroup(groups["actor"], mini_batch_samples=arr.actor.ppo_mini_batch_size * n,
                         ppo_epochs=arr.actor.ppo_epochs),
        reference=ReferenceGroup(groups["reference"]) if "reference" in groups else None,
        critic=ReconstructorGroup(groups["critic"]), rollout=RolloutGroup(groups["actor"]), reward_manager=None,
        eos_token_ids=stop_token_ids(arr.model.path, tokenizer), total_steps=total_steps,
        timeline_file=cfg.ray_init.timeline_json_file, noise=run_noise_injection(cfg, total_steps), startup=startup)
    prompt = cfg.critic.critic_prompt
    critic_prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids if prompt else []
    return parts, critic_prompt_ids
