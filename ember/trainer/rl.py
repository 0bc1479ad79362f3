"""The RL loop (GRPO, PPO and relatives), readable top to bottom.

For each batch of prompts: generate → reward (for ReMax also the reward of one greedy
response per prompt, its baseline) → old log-probs (skipped when one update per batch makes
them equal to the current ones) → reference log-probs → values → advantages → critic update
→ actor update (after `critic_warmup` steps) → metrics. Validation before training and every
`test_freq` steps, checkpoints every `save_freq` steps, a final HF export and a plot of the
curves. With `trainer.balance_batch` the scored batch is reordered so that each data-parallel
rank's contiguous share holds about as many tokens as the others (`balance.py`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from ember.algorithms import AdvantageInputs, AdaptiveKLController, FixedKLController, apply_kl_penalty, get_advantage_fn
from ember.config import config_to_yaml
from ember.config.schema import EmberConfig
from ember.distributed.device import rank
from ember.distributed.worker_group import WorkerError
from ember.errors import UserError
from ember.rollout import SamplingParams
from ember.trainer.balance import balance_batch
from ember.trainer.checkpoint import HF_CHECKPOINT_DIR, CheckpointManager
from ember.trainer.experience import Experience, Scores, generate_experience, score_experience, token_level_scores
from ember.trainer.experiment_trackers import TrackedRun
from ember.trainer.faults import BadStepGuard, BadStepsError, StopRequest
from ember.trainer.loggers import MetricLogger
from ember.trainer.metrics import (compute_agent_metrics, compute_data_metrics, compute_timing_metrics,
                                   staleness_metrics, timed)
from ember.trainer.generation_queue import GenerationPlan, InFlightGeneration
from ember.trainer.rank_setup import use_configured_device
from ember.trainer.rl_setup import RLComponents, build_components
from ember.trainer.rollout_correction import correct_rollout, use_rollout_log_probs
from ember.trainer.rollout_correction import needs_old_log_probs as needs_correction_log_probs
from ember.trainer.resume import resume_from_checkpoint
from ember.trainer.run_folder import claim_run_folder
from ember.trainer.run_state import save_run_state
from ember.trainer.memory_snapshots import MemorySnapshots
from ember.trainer.step_profiler import StepProfiler
from ember.trainer.summary import finish_rl_run
from ember.trainer.dumps import advantages_in_generation_order, generation_records, write_generations
from ember.trainer.dynamic_sampling import sample_dynamically, shape_overlong
from ember.trainer.validation import validate, validation_sampling

logger = logging.getLogger("ember.trainer")

RUN_STATE_KEYS = ("step", "loader", "kl_coef", "validation_history")  # what `save` writes to trainer_state.json
WATCHED_METRICS = ("actor/loss", "actor/grad_norm", "critic/loss", "critic/grad_norm")  # bounded by the guard


class RLTrainer:
    """Drives the components of one RL run; see the module docstring for the step."""

    critic_gives_values = True
    """Whether the critic is a value model (PPO's); NLA's trainer has a critic that scores instead."""

    def __init__(self, cfg: EmberConfig, parts: RLComponents):
        self.cfg = cfg
        self.parts = parts
        self.run_dir = cfg.trainer.default_local_dir
        self.step = 0
        kl = cfg.algorithm.kl_ctrl
        self.kl_controller = (AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon) if kl.type == "adaptive"
                              else FixedKLController(kl.kl_coef))
        self.checkpoints = CheckpointManager(self.run_dir, cfg.trainer.max_actor_ckpt_to_keep, is_writer=rank() == 0,
                                             copy_to=cfg.trainer.default_hdfs_dir)
        self.logger = MetricLogger(self.run_dir, cfg.trainer.logger, parts.total_steps, enabled=rank() == 0,
                                   tracked_run=TrackedRun.of(cfg))
        self.guard = BadStepGuard(cfg.trainer.max_loss_or_grad_norm)
        self.reward_thread = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-reward")
                              if cfg.reward_model.launch_reward_fn_async else None)
        """`reward_model.launch_reward_fn_async`: where a step's scores are computed while its log-probs,
        reference and values are (the reward manager's workers do the scoring; this thread waits on them)."""
        self.validation_history: list[tuple[int, dict[str, float]]] = []
        self.plan = GenerationPlan.of(cfg.async_training)
        self.ahead: deque[InFlightGeneration] = deque()  # one_step_off, fully_async: later steps' generations
        self.stale_dropped = 0  # fully_async: samples of this step dropped as too stale (then generated again)
        self.weight_sync_gb = 0.0  # the size of one weight sync to a rollout pool of its own
        self.profiler = StepProfiler(cfg.global_profiler, parts.worker_groups(), parts.total_steps)
        self.memory_snapshots = MemorySnapshots(cfg.global_profiler, parts.worker_groups())

    def checkpointed_roles(self) -> list[tuple[str, object]]:
        """The roles a checkpoint holds, under their folder names: the actor, and the critic if any
        (the reference never changes, so it is rebuilt from the model instead)."""
        roles = [("actor", self.parts.actor)]
        if self.parts.critic is not None:
            roles.append(("critic", self.parts.critic))
        return roles

    # --- the loop ------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        cfg, parts = self.cfg, self.parts
        with parts.startup.phase("resume"):
            self.resume()
        start_time = time.monotonic()
        with StopRequest() as stop:
            if parts.val_dataset is not None and (cfg.trainer.val_only or (cfg.trainer.val_before_train and
                                                                          self.step == 0)):
                with parts.startup.phase("validation"):
                    self.log_validation(self.validate())
            if cfg.trainer.val_only:
                return self.validation_history[-1][1] if self.validation_history else {}
            if stop.requested:  # during the first validation: nothing trained since the checkpoint resumed from
                logger.warning("stopping before step %d on %s; nothing trained, no checkpoint written", self.step + 1,
                               stop.signal_name)
                return {}
            while self.step < parts.total_steps:
                prompts = self.ahead[0].prompts if self.ahead else self.next_prompts()
                self.step += 1
                try:
                    metrics = self.train_step(prompts)
                except (WorkerError, UserError) as error:  # the worker's rank, role (and traceback), and the step
                    kind = WorkerError if isinstance(error, WorkerError) else UserError
                    raise kind(f"step {self.step}: {error}\nThe last checkpoint stays loadable: rerun with "
                               "trainer.resume_mode=auto to go on from it") from None
                last = self.step >= parts.total_steps
                if parts.val_dataset is not None and (last or _every(cfg.trainer.test_freq, self.step)):
                    metrics.update(self.validate())
                metrics.update(parts.startup.metrics())  # with the first step this process trains
                self.logger.log(self.step, metrics)
                if self.guard.should_stop:
                    raise BadStepsError(f"{self.guard.stop_message()}. Lower the learning rate or check the data.")
                checkpoint_due = last or _every(cfg.trainer.save_freq, self.step) or stop.requested
                saved = self.save() if checkpoint_due else False
                if stop.requested and not last:  # a stop on the last step finishes the run
                    logger.warning("stopping at step %d on %s; %s, resume with trainer.resume_mode=auto", self.step,
                                   stop.signal_name, "checkpoint saved" if saved else "no checkpoint saved")
                    return {}
        return finish_rl_run(self, time.monotonic() - start_time)

    def train_step(self, prompts) -> dict[str, float]:
        """One step on `prompts` (profiled, or its memory snapshot written, as `global_profiler` says); its
        metrics."""
        with self.profiler.around(self.step):
            metrics = self.run_step(prompts)
        self.memory_snapshots.after(self.step)
        return metrics

    def run_step(self, prompts) -> dict[str, float]:
        cfg, parts = self.cfg, self.parts
        timings: dict[str, float] = {}
        trained_version = parts.actor.version  # the weights this step's update starts from
        self.stale_dropped = 0
        with timed(timings, "step"):
            experience, scored, sampling_metrics = self.generate_and_score(prompts, timings)
            batch = experience.batch
            reward_baselines, baseline_failures = None, {}
            if cfg.algorithm.adv_estimator == "remax":
                with timed(timings, "gen_max"):
                    reward_baselines, baseline_failures = self.greedy_reward_baselines(prompts)
            parts.rollout.sleep()
            balance_metrics, balance_order = {}, None
            if cfg.trainer.balance_batch:
                balanced = balance_batch(batch, parts.actor.dp_size)
                batch, balance_metrics, balance_order = balanced.batch, balanced.metrics, balanced.permutation
                if reward_baselines is not None:  # one per sample: follows the new order
                    reward_baselines = reward_baselines[balanced.permutation]
            correction = cfg.algorithm.rollout_correction
            bypassed = use_rollout_log_probs(batch, correction)  # bypass mode: π_old = π_rollout, no forward
            if not bypassed and (parts.actor.needs_old_log_probs(len(batch)) or needs_correction_log_probs(correction)):
                with timed(timings, "old_log_prob"):
                    batch.old_log_probs = parts.actor.compute_log_probs(batch)
            if parts.reference is not None:
                with timed(timings, "ref"):
                    batch.ref_log_probs = parts.reference.compute_log_probs(batch)
            if parts.critic is not None and self.critic_gives_values:
                with timed(timings, "values"):
                    batch.values = parts.critic.compute_values(batch)
            if isinstance(scored, Future):  # scored in the background since generation ended
                with timed(timings, "reward"):
                    scored = scored.result()
            scores = scored.scores if balance_order is None else scored.scores[torch.tensor(balance_order)]
            batch.token_level_scores = token_level_scores(batch, scores)  # on the last token before rejection
            generated_mask = batch.response_mask
            with timed(timings, "adv"):  # verl's order: the KL penalty on the generated tokens, rejection, advantages
                metrics = self.apply_kl_in_reward(batch)
            metrics.update(correct_rollout(batch, correction))
            with timed(timings, "adv"):
                self.estimate_advantages(batch, reward_baselines)
            if cfg.trainer.rollout_data_dir and rank() == 0:
                self.dump_rollouts(experience, scored, batch, balance_order)
            critic_update = None
            if parts.critic is not None:  # started first: a critic in its own pool updates beside the actor
                with timed(timings, "update_critic"):
                    critic_update = self.start_critic_update(batch)
            if self.step > cfg.trainer.critic_warmup:
                with timed(timings, "update_actor"):
                    metrics.update(parts.actor.update(batch, self.step))
            if critic_update is not None:
                with timed(timings, "update_critic"):
                    metrics.update(critic_update.wait())
            self.guard.record(self.step, metrics.get("actor/skipped", 0.0) > 0 or metrics.get("critic/skipped", 0.0) > 0,
                              {key: metrics[key] for key in WATCHED_METRICS if key in metrics})
        metrics.update(scored.metrics)
        for key, count in baseline_failures.items():  # ReMax: its greedy responses were scored too
            metrics[key] = metrics.get(key, 0.0) + count
        metrics.update(sampling_metrics)
        if parts.noise is not None:
            metrics.update(parts.noise.metrics(self.step))
        metrics.update(balance_metrics)
        if scored.accuracies is not None:
            metrics["critic/acc/mean"] = scored.accuracies.mean().item()
        as_generated = replace(batch, response_mask=generated_mask)  # lengths before rollout correction's rejection
        metrics.update(compute_data_metrics(as_generated, cfg.data.max_response_length,
                                            parts.critic is not None and self.critic_gives_values))
        if experience.agent_stats is not None:
            metrics.update(compute_agent_metrics(experience.agent_stats, experience.batch))
        metrics.update(compute_timing_metrics(timings, batch))
        metrics.update(staleness_metrics(batch, trained_version))
        if self.plan.max_staleness is not None:
            metrics["rollout/stale_dropped"] = float(self.stale_dropped)
        if "weight_sync" in timings:
            metrics["perf/weight_sync_gb"] = self.weight_sync_gb
        metrics["training/epoch"] = float(parts.train_loader.epoch)
        return metrics

    def start_critic_update(self, batch):
        """The critic's update on this step's batch, started (a pending call)."""
        return self.parts.critic.start_update(batch, self.step)

    def next_prompts(self) -> list:
        """The loader's next batch of prompts (the next epoch's first after the last of one)."""
        return next(iter(self.parts.train_loader))

    def generate_and_score(self, prompts, timings: dict[str, float]
                           ) -> tuple[Experience, Scores | Future[Scores], dict[str, float]]:
        """This step's samples and their scores (overlong-shaped with the dapo reward manager). With
        `algorithm.filter_groups` (DAPO's dynamic sampling) groups whose samples all scored alike
        are dropped and more prompts are generated until `data.train_batch_size` groups are kept.
        With `reward_model.launch_reward_fn_async` the scores come as a Future, being computed in the
        background, where nothing before the advantages needs them (no dynamic sampling, not ReMax)."""
        cfg = self.cfg
        generated = [0]  # prompts this step has generated so far: a later round's samples draw after them

        def one_round(round_prompts, uid_prefix: str, in_background: bool = False):
            sampling = replace(self.sampling(), first_prompt_index=generated[0])
            generated[0] += len(round_prompts)
            with timed(timings, "gen"):
                experience = self.generate(round_prompts, sampling, uid_prefix, timings)
            if in_background:
                return experience, self.reward_thread.submit(self.score_round, experience)
            with timed(timings, "reward"):
                return experience, self.score_round(experience)

        if self.parts.noise is not None:
            self.parts.rollout.use_noise(self.step)
        in_background = (self.reward_thread is not None and not cfg.algorithm.filter_groups.enable
                         and cfg.algorithm.adv_estimator != "remax")
        experience, scored = one_round(prompts, f"step{self.step}", in_background)
        if not cfg.algorithm.filter_groups.enable:
            return experience, scored, {}
        return sample_dynamically(experience, scored, one_round, self.next_prompts, cfg.algorithm.filter_groups,
                                  cfg.data.train_batch_size, f"step{self.step}")

    def generate(self, prompts, sampling: SamplingParams, uid_prefix: str, timings: dict[str, float]) -> Experience:
        """Samples for `prompts`: the generation started for this step ahead of it (one_step_off, fully_async), or
        generated now with the actor's current weights (sent first to a rollout pool of its own). A batch staler
        than fully_async's bound is dropped and generated again after a sync. The later steps' generations are
        started before this returns (`generation_queue.py`)."""
        parts = self.parts
        in_flight = self.ahead.popleft() if self.ahead else None
        experience = None
        if in_flight is not None:
            with timed(timings, "wait_prev_gen"):  # verl's name: the part of the generation training did not hide
                experience = in_flight.experience(parts.tokenizer, parts.eos_token_ids)
            if self.plan.too_stale(experience.batch.policy_versions, parts.actor.version):
                self.stale_dropped += len(experience.batch)
                experience = None
        if experience is None:
            self.sync_rollout_weights(timings)
            experience = generate_experience(parts.rollout, prompts, sampling, parts.tokenizer, parts.eos_token_ids,
                                             uid_prefix=uid_prefix)
        self.start_generations_ahead(timings)
        return experience

    def start_generations_ahead(self, timings: dict[str, float]) -> None:
        """Starts the next steps' generations until `plan.steps_ahead` are under way (none past the last step)."""
        last_started = self.ahead[-1].step if self.ahead else self.step
        while len(self.ahead) < self.plan.steps_ahead and last_started < self.parts.total_steps:
            last_started += 1
            self.ahead.append(self.start_generation(last_started, timings))

    def start_generation(self, step: int, timings: dict[str, float]) -> InFlightGeneration:
        """Step `step`'s prompts, generating with the rollout's weights, synced first when `plan.sync_due`."""
        parts = self.parts
        loader_state = parts.train_loader.state_dict()
        prompts = self.next_prompts()
        if self.plan.sync_due(parts.actor.version, parts.rollout.synced_version):
            self.sync_rollout_weights(timings)
        pending = parts.rollout.start_generate([prompt.prompt_ids for prompt in prompts], self.sampling(step))
        return InFlightGeneration(step, prompts, pending, loader_state)

    def sync_rollout_weights(self, timings: dict[str, float] | None = None) -> None:
        """A rollout pool of its own gets the actor's current weights if it holds others (no-op beside the actor)."""
        sent = self.parts.rollout.sync_weights(self.parts.actor.version)
        if sent and timings is not None:
            timings["weight_sync"] = timings.get("weight_sync", 0.0) + sent["seconds"]
            self.weight_sync_gb = sent["gb"]

    def score_round(self, experience: Experience) -> Scores:
        """The reward manager's scores of one generation round, overlong-shaped with the dapo reward manager."""
        cfg = self.cfg
        scored = score_experience(self.parts.reward_manager, experience)
        if cfg.reward_model.reward_manager == "dapo" and cfg.reward_model.overlong_buffer.enable:
            scored = shape_overlong(experience, scored, cfg.reward_model.overlong_buffer, cfg.data.max_response_length)
        return scored

    def dump_rollouts(self, experience, scored, batch, order) -> None:
        """This step's samples to `trainer.rollout_data_dir`, in generation order (`order`: the
        balanced batch's sample i is generated sample order[i])."""
        write_generations(self.cfg.trainer.rollout_data_dir, self.step,
                          generation_records(experience, scored, self.step, advantages_in_generation_order(batch, order)))

    def greedy_reward_baselines(self, prompts) -> tuple[torch.Tensor, dict[str, float]]:
        """ReMax's baseline: the reward of one greedy response per prompt, for each of its samples; and the reward
        function's errors and timeouts on those responses (counted in the step's `reward/errors|timeouts`)."""
        parts = self.parts
        greedy = replace(self.sampling(), n=1, do_sample=False)
        experience = generate_experience(parts.rollout, prompts, greedy, parts.tokenizer, parts.eos_token_ids,
                                         uid_prefix=f"step{self.step}-greedy")
        scored = score_experience(parts.reward_manager, experience)
        failures = {key: scored.metrics[key] for key in ("reward/errors", "reward/timeouts")}
        return scored.scores.repeat_interleave(self.cfg.actor_rollout_ref.rollout.n), failures

    def compute_advantages(self, batch, reward_baselines: torch.Tensor | None = None) -> dict[str, float]:
        """The token rewards (`apply_kl_in_reward`) and the advantages and returns (`estimate_advantages`)."""
        metrics = self.apply_kl_in_reward(batch)
        self.estimate_advantages(batch, reward_baselines)
        return metrics

    def apply_kl_in_reward(self, batch) -> dict[str, float]:
        """`batch.token_level_rewards`: the scores, less the KL penalty with `algorithm.use_kl_in_reward` (whose
        coefficient then follows the step's KL)."""
        algorithm, metrics = self.cfg.algorithm, {}
        if algorithm.use_kl_in_reward:
            log_probs = (batch.old_log_probs if batch.old_log_probs is not None
                         else self.parts.actor.compute_log_probs(batch))
            batch.token_level_rewards, kl_metrics = apply_kl_penalty(
                token_level_scores=batch.token_level_scores, log_probs=log_probs, ref_log_probs=batch.ref_log_probs,
                response_mask=batch.response_mask, kl_coef=self.kl_controller.value, kind=algorithm.kl_penalty)
            self.kl_controller.update(float(kl_metrics["kl"]), n_steps=len(batch))
            metrics.update({f"actor/reward_{key}": float(value) for key, value in kl_metrics.items()})
        else:
            batch.token_level_rewards = batch.token_level_scores
        return metrics

    def estimate_advantages(self, batch, reward_baselines: torch.Tensor | None = None) -> None:
        """`batch.advantages` and `batch.returns` from the token rewards, by `algorithm.adv_estimator`."""
        algorithm = self.cfg.algorithm
        batch.advantages, batch.returns = get_advantage_fn(algorithm.adv_estimator)(AdvantageInputs(
            token_level_rewards=batch.token_level_rewards, response_mask=batch.response_mask,
            group_ids=batch.uids, values=batch.values, reward_baselines=reward_baselines,
            gamma=algorithm.gamma, lam=algorithm.lam,
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo))

    def sampling(self, step: int | None = None) -> SamplingParams:
        """Sampling of training step `step` (default: the current one): its seed follows the step."""
        rollout = self.cfg.actor_rollout_ref.rollout
        return SamplingParams(n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                              max_new_tokens=self.cfg.data.max_response_length, do_sample=rollout.do_sample,
                              ignore_eos=rollout.ignore_eos, stop_token_ids=tuple(self.parts.eos_token_ids),
                              seed=rollout.seed * 1_000_003 + (self.step if step is None else step))

    # --- validation and checkpoints ----------------------------------------------------------------

    def validate(self) -> dict[str, float]:
        cfg, parts = self.cfg, self.parts
        sampling = validation_sampling(cfg.actor_rollout_ref.rollout.val_kwargs, cfg.data.max_response_length,
                                       parts.eos_token_ids, seed=cfg.actor_rollout_ref.rollout.seed)
        if parts.noise is not None:
            parts.rollout.use_noise(None)  # validation measures the policy itself, not its noised copy
        self.sync_rollout_weights()  # (queued after a generation in flight, which keeps its weights)
        metrics, scored = validate(parts.rollout, parts.val_dataset, parts.reward_manager, parts.tokenizer,
                                   sampling, parts.eos_token_ids, batch_size=cfg.data.val_batch_size)
        parts.rollout.sleep()
        self.validation_history.append((self.step, metrics))
        if cfg.trainer.validation_data_dir and rank() == 0:
            write_generations(cfg.trainer.validation_data_dir, self.step,
                              [record for experience, scores in scored
                               for record in generation_records(experience, scores, self.step)])
        shown = cfg.trainer.log_val_generations
        if shown and rank() == 0:
            experience = scored[0][0]
            for prompt, response in list(zip(experience.prompts, experience.responses))[:shown]:
                logger.info("validation sample | prompt: %r | response: %r | ground truth: %r",
                            prompt.prompt_text, response, prompt.ground_truth)
        return metrics

    def log_validation(self, metrics: dict[str, float]) -> None:
        self.logger.log(self.step, metrics)

    def save(self) -> bool:
        """Writes the checkpoint of this step unless its weights are unsound (see BadStepGuard); True if written."""
        parts = self.parts
        if not self.guard.weights_sound:
            logger.warning(self.guard.unsound_save_message(self.step))
            return False

        def write(directory: str) -> None:
            for name, role in self.checkpointed_roles():
                role.save(os.path.join(directory, name))
                if "hf_model" in self.checkpoint_contents(name):  # verl's folder for it
                    role.export_hf(os.path.join(directory, name, HF_CHECKPOINT_DIR), tokenizer=parts.tokenizer)
            if rank() == 0:
                loader = self.ahead[0].loader_state if self.ahead else parts.train_loader.state_dict()
                save_run_state(directory, step=self.step, loader=loader,
                               kl_coef=self.kl_controller.value, validation_history=self.validation_history)

        self.guard.last_sound_checkpoint = self.checkpoints.save(self.step, write, barrier=_barrier)
        return True

    def checkpoint_contents(self, role: str) -> list[str]:
        """`<role>.checkpoint.save_contents` of a checkpointed role ("actor" or "critic")."""
        section = self.cfg.actor_rollout_ref.actor if role == "actor" else self.cfg.critic
        return section.checkpoint.save_contents

    def resume(self) -> None:
        """Continues from the checkpoint `trainer.resume_mode` picks (see resume.py); only then takes the run
        directory (run_folder.py) and writes the resolved config there, and starts the metric log."""
        trainer = self.cfg.trainer
        resumed = resume_from_checkpoint(self.checkpoints, trainer.resume_mode, trainer.resume_from_path,
                                         self.checkpointed_roles(), RUN_STATE_KEYS)
        claim_run_folder(self.checkpoints, resumed.path if resumed else None, trainer.overwrite_default_local_dir,
                         config_to_yaml(self.cfg))
        if resumed is None:
            self.logger.start(None)
            return
        state = resumed.values
        self.step = state["step"]
        self.parts.train_loader.load_state_dict(state["loader"])
        self.kl_controller.value = state["kl_coef"]
        self.parts.actor.set_version(self.step)
        self.validation_history = [tuple(item) for item in state["validation_history"]]
        self.guard.last_sound_checkpoint = resumed.path
        self.logger.start(self.step)
        logger.warning("resumed from %s at step %d", resumed.path, self.step)
        if trainer.del_local_ckpt_after_load:
            _barrier()  # every rank has read it
            if rank() == 0:
                shutil.rmtree(resumed.path)
            self.guard.last_sound_checkpoint = None
            logger.warning("deleted %s after loading it (trainer.del_local_ckpt_after_load=true): until the next "
                           "checkpoint (trainer.save_freq=%d) a crash restarts the run from the beginning",
                           resumed.path, trainer.save_freq)


def _every(frequency: int, step: int) -> bool:
    return frequency > 0 and step % frequency == 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def run_rl(cfg: EmberConfig) -> int:
    """`ember train`: trains the configured run to its end (or a requested stop)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    use_configured_device(cfg.trainer.device)
    trainer = RLTrainer(cfg, build_components(cfg))
    try:
        trainer.fit()
    finally:
        if trainer.reward_thread is not None:  # a step that failed may have left scoring under way
            trainer.reward_thread.shutdown(wait=True, cancel_futures=True)
        trainer.parts.reward_manager.close()
        trainer.parts.shutdown()
        trainer.logger.close()
    return 0
