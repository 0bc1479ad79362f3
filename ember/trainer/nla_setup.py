"""Builds the parts of an `ember nla train` run: the driver's prompts with their vectors, and on each rank the
reconstructor (NLA's critic) beside or apart from the actor, as `rl_setup.py` builds an RL run's roles.

The actor, its rollout and the resource pools are `rl_setup`'s: an NLA run differs in its data
(`NLAPromptDataset`), in the actor's forwards (the batch carries the vectors, which the engine
injects) and in its critic, a `Reconstructor` in place of a value model, placed where the
critic's pool is.
"""

from __future__ import annotations

import logging

from ember.config.nla_rules import data_variant
from ember.config.schema.nla_train import NLATrainConfig
from ember.data.prompt_loader import PromptLoader
from ember.distributed.device import world_size
from ember.nla.checks import model_hidden_size
from ember.nla.data import NLAPromptDataset, vector_options
from ember.nla.marker import choose_marker
from ember.trainer.rl_setup import (RLComponents, build_engine, build_worker_groups, load_tokenizer, micro_batch_spec,
                                    optim_options, optimizer_steps_per_rl_step, run_noise_injection, stop_token_ids,
                                    total_training_steps)
from ember.trainer.role_groups import ActorGroup, ReconstructorGroup, ReferenceGroup, RolloutGroup
from ember.workers.reconstructor import Reconstructor, ReconstructorOptions

logger = logging.getLogger(__name__)


def build_reconstructor(cfg: NLATrainConfig, total_steps: int) -> Reconstructor:
    """This rank's reconstructor, sized for its data-parallel share of the critic's batches."""
    critic = cfg.critic
    n = cfg.actor_rollout_ref.rollout.n
    updates = optimizer_steps_per_rl_step(cfg, critic.ppo_epochs, critic.ppo_mini_batch_size)
    engine = build_engine(critic.model.path, "reconstructor", critic.model, critic.model.fsdp_config,
                          optim_options(critic.optim, critic.grad_clip, total_steps, updates), seed=cfg.trainer.seed,
                          use_remove_padding=critic.model.use_remove_padding,
                          output_layer_index=critic.output_layer_index,
                          truncate_at_layer=critic.model.truncate_at_layer)
    mini_batch_samples = critic.ppo_mini_batch_size * n // world_size()
    micro = critic.ppo_micro_batch_size_per_gpu or mini_batch_samples
    return Reconstructor(engine, ReconstructorOptions(
        mini_batch_samples=mini_batch_samples,
        micro_batch=micro_batch_spec(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu, micro, micro),
        forward_micro_batch=micro_batch_spec(critic.use_dynamic_bsz, critic.forward_max_token_len_per_gpu,
                                             critic.forward_micro_batch_size_per_gpu, micro),
        ppo_epochs=critic.ppo_epochs, shuffle=critic.shuffle, seed=cfg.trainer.seed))


def build_nla_components(cfg: NLATrainConfig) -> tuple[RLComponents, list[int]]:
    """The driver's parts of an NLA run, and the token ids of `critic.critic_prompt` (none when unset)."""
    arr, data = cfg.actor_rollout_ref, cfg.data
    tokenizer = load_tokenizer(cfg)
    marker = choose_marker(tokenizer, cfg.nla.injection.injection_token)
    vectors = vector_options(cfg.nla, model_hidden_size(arr.model.path, arr.model.trust_remote_code))
    dataset = NLAPromptDataset(data.train_files, tokenizer, marker, vectors, prompt_key=data.prompt_key,
                               max_prompt_length=data.max_prompt_length, truncation=data.truncation,
                               position=cfg.nla.injection.position)
    logger.info("NLA data: %d prompts, marker %r (token %d), %s run", len(dataset), marker.character, marker.token_id,
                data_variant(data.train_files))
    loader = PromptLoader(dataset, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    total_steps = total_training_steps(cfg, len(loader))
    groups = build_worker_groups(cfg, total_steps)
    n = arr.rollout.n
    parts = RLComponents(
        tokenizer=tokenizer, train_loader=loader, val_dataset=None,
        actor=ActorGroup(groups["actor"], mini_batch_samples=arr.actor.ppo_mini_batch_size * n,
                         ppo_epochs=arr.actor.ppo_epochs),
        reference=ReferenceGroup(groups["reference"]) if "reference" in groups else None,
        critic=ReconstructorGroup(groups["critic"]), rollout=RolloutGroup(groups["actor"]), reward_manager=None,
        eos_token_ids=stop_token_ids(arr.model.path, tokenizer), total_steps=total_steps,
        timeline_file=cfg.ray_init.timeline_json_file, noise=run_noise_injection(cfg, total_steps))
    prompt = cfg.critic.critic_prompt
    critic_prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids if prompt else []
    return parts, critic_prompt_ids
