"""`ember nla train`: NLA's RL loop, the RL loop of `trainer/rl.py` with the reconstructor as the reward.

Each step: generate `rollout.n` explanations per prompt with the prompt's vector written over
its marker's input embedding in ember's engine's prefill → the reconstructor (the critic,
before its update, no gradient) predicts each vector from the explanation alone (after
`critic.critic_prompt`), and the reward is −mean((prediction − vector)²) (ember's
`nla.normalized_reward`: divided by mean(vector²)) on the last response token → old
log-probs with the vector injected (the batch carries it; the engine injects it in every
actor forward) → GRPO advantages → the reconstructor's MSE update → the actor's update after
`trainer.critic_warmup` steps. The fork's critic metrics come from the pre-update
predictions (`critic/critic_loss`, `critic/fve`, ...), the update's own loss as
`critic/loss`. `nla_eval` runs at step 1, every `freq` steps and at the last; the trained
reconstructor is exported beside the actor (`critic_hf_model`).
"""

from __future__ import annotations

import logging
import os

import torch

from ember.config.nla_rules import data_variant
from ember.config.schema.nla_train import NLATrainConfig
from ember.data.batch import Batch
from ember.distributed.device import rank
from ember.nla.data import NLAPromptRecord
from ember.nla.data import reading_options
from ember.nla.eval import eval_sampling, evaluate, read_eval_sets, should_evaluate, write_explanations
from ember.nla.rl_setup import build_nla_components
from ember.rollout import Injection
from ember.trainer.experience import Experience, Scores
from ember.trainer.dumps import advantages_in_generation_order, write_generations
from ember.trainer.metrics import timed
from ember.trainer.rl import RLTrainer
from ember.trainer.rank_setup import use_configured_device
from ember.trainer.rl_setup import RLComponents
from ember.workers.reconstructor import reconstruction_batch, reconstruction_metrics, squared_errors

logger = logging.getLogger("ember.nla")

CRITIC_EXPORT_DIR = "critic_hf_model"


class NLARLTrainer(RLTrainer):
    """The RL loop with NLA's generation, reward and critic (see the module docstring)."""

    critic_gives_values = False

    def __init__(self, cfg: NLATrainConfig, parts: RLComponents, critic_prompt_ids: list[int]):
        super().__init__(cfg, parts)
        self.critic_prompt_ids = critic_prompt_ids
        self.reconstruction: Batch | None = None  # this step's reconstructor batch, for its update
        self.random_control = data_variant(cfg.data.train_files) == "random"
        model, tokenizer = cfg.actor_rollout_ref.model, parts.tokenizer
        self.eval_sets = (read_eval_sets(cfg.nla_eval, tokenizer, *reading_options(cfg.nla, tokenizer, model.path,
                                                                                   model.trust_remote_code))
                          if cfg.nla_eval.enabled else {})

    def generate_and_score(self, prompts: list[NLAPromptRecord], timings: dict[str, float]):
        parts, mode = self.parts, self.cfg.nla.injection.mode
        sampling = self.sampling()
        if parts.noise is not None:
            parts.rollout.use_noise(self.step)
        with timed(timings, "gen"):
            outputs = parts.rollout.generate([record.prompt_ids for record in prompts], sampling,
                                             [Injection(record.marker_position, record.vector, mode) for record in prompts])
        per_sample = [prompts[output.prompt_index] for output in outputs]
        vectors = torch.stack([record.vector for record in per_sample])
        batch = Batch.from_rollout(
            [record.prompt_ids for record in per_sample], [output.token_ids for output in outputs],
            pad_token_id=parts.tokenizer.pad_token_id, eos_token_ids=parts.eos_token_ids,
            rollout_log_probs=[output.log_probs for output in outputs],
            uids=[f"step{self.step}-{output.prompt_index}" for output in outputs])
        batch = batch.with_fields(activation_vectors=vectors, injection_positions=torch.tensor(
            [record.marker_position for record in per_sample], dtype=torch.long))
        responses = [batch.responses[i][batch.response_mask[i].bool()].tolist() for i in range(len(batch))]
        texts = parts.tokenizer.batch_decode(responses, skip_special_tokens=True)
        with timed(timings, "reward"):
            self.reconstruction = reconstruction_batch(self.critic_prompt_ids, responses, vectors,
                                                       parts.tokenizer.pad_token_id)
            predictions = parts.critic.predict(self.reconstruction)
            errors = squared_errors(predictions, vectors)
            if self.cfg.nla.normalized_reward:
                errors = errors / vectors.pow(2).mean(dim=-1).clamp_min(1e-12)
            scores = -errors
        metrics = reconstruction_metrics(predictions, vectors)
        metrics.update({"nla/injections": float(len(batch)), "nla/random_control": float(self.random_control)})
        return Experience(batch=batch, responses=texts, prompts=per_sample), \
            Scores(scores=scores, accuracies=None, metrics=metrics, extras={}), {}

    def start_critic_update(self, batch: Batch):
        return self.parts.critic.start_update(self.reconstruction, self.step)

    def train_step(self, prompts) -> dict[str, float]:
        metrics = super().train_step(prompts)
        if self.eval_sets and should_evaluate(self.step, self.cfg.nla_eval.freq, self.parts.total_steps):
            metrics.update(self.nla_evaluate())
        return metrics

    def nla_evaluate(self) -> dict[str, float]:
        """The fork's string-match evaluation of the current actor; explanations written under
        `default_local_dir/nla_eval/<set>/<step>.jsonl`."""
        parts = self.parts
        sampling = eval_sampling(self.cfg.nla_eval, parts.eos_token_ids, seed=self.cfg.trainer.seed)
        if parts.noise is not None:
            parts.rollout.use_noise(None)
        metrics, explanations = evaluate(parts.rollout, self.eval_sets, sampling, parts.tokenizer,
                                         mode=self.cfg.nla.injection.mode)
        parts.rollout.sleep()
        if rank() == 0:
            for name, records in self.eval_sets.items():
                write_explanations(os.path.join(self.run_dir, "nla_eval"), name, self.step, records,
                                   explanations[name], sampling.n)
        return metrics

    def dump_rollouts(self, experience, scored, batch, order) -> None:
        """This step's explanations to `trainer.rollout_data_dir`: prompt, explanation, reward, advantage and
        where the vector came from."""
        advantages = advantages_in_generation_order(batch, order)
        records = [{"input": record.prompt_text, "output": text, "score": float(score), "advantage": float(advantage),
                    "step": self.step, **{key: value for key, value in record.provenance.items()
                                          if isinstance(value, (str, int, float))}}
                   for record, text, score, advantage in zip(experience.prompts, experience.responses,
                                                             scored.scores.tolist(), advantages.tolist())]
        write_generations(self.cfg.trainer.rollout_data_dir, self.step, records)

    def fit(self) -> dict[str, float]:
        metrics = super().fit()
        if self.step >= self.parts.total_steps:
            export_dir = os.path.join(self.run_dir, CRITIC_EXPORT_DIR)
            self.parts.critic.export_hf(export_dir, tokenizer=self.parts.tokenizer)
            if rank() == 0:
                print(f"reconstructor (Hugging Face format): {export_dir}", flush=True)
        return metrics


def run_nla_rl(cfg: NLATrainConfig, use_ray: bool | None = None) -> int:
    """`ember nla train`: NLA GRPO to the end of the run (or a requested stop); `use_ray` as
    `build_nla_components` takes it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    use_configured_device(cfg.trainer.device)
    parts, critic_prompt_ids = build_nla_components(cfg, use_ray)
    trainer = NLARLTrainer(cfg, parts, critic_prompt_ids)
    try:
        trainer.fit()
    finally:
        trainer.parts.shutdown()
        trainer.logger.close()
    return 0
