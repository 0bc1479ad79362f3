"""From prompts to scored experience: generate `n` responses per prompt, pack them into a
Batch, decode them and score them with the reward manager. Shared by training steps and
validation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.algorithms import scores_to_token_rewards
from ember.data.batch import Batch
from ember.data.rl_dataset import PromptSample
from ember.rewards import RewardItem, RewardManager
from ember.rollout import AgentStats, RolloutEngine, RolloutOutput, SamplingParams


@dataclass
class Experience:
    """A generated batch with its decoded responses."""

    batch: Batch
    responses: list[str]  # the whole response (multi-turn: tool turns included), as the reward reads it
    prompts: list[PromptSample]  # one per sample (each prompt repeated n times)
    agent_stats: list[AgentStats] | None = None  # multi-turn: each sample's turns and tool calls


def generate_experience(rollout: RolloutEngine, prompts: list[PromptSample], sampling: SamplingParams,
                        tokenizer, eos_token_ids: list[int], uid_prefix: str) -> Experience:
    """Samples `sampling.n` responses per prompt; samples of one prompt share a uid (its GRPO group)."""
    outputs = rollout.generate([prompt.prompt_ids for prompt in prompts], sampling,
                               extra_infos=[prompt.extra_info for prompt in prompts])
    return build_experience(prompts, outputs, tokenizer, eos_token_ids, uid_prefix)


def build_experience(prompts: list[PromptSample], outputs: list[RolloutOutput], tokenizer, eos_token_ids: list[int],
                     uid_prefix: str) -> Experience:
    """The Batch and decoded responses of a rollout's `outputs` for `prompts` (`generate_experience`)."""
    per_sample = [prompts[output.prompt_index] for output in outputs]
    agent_stats = [output.agent for output in outputs] if outputs and outputs[0].agent is not None else None
    extra_infos = [prompt.extra_info for prompt in per_sample]
    if agent_stats is not None:  # each tool's calc_reward, for rewards that read it (verl's reward_scores)
        extra_infos = [{**extra, "tool_rewards": stats.tool_rewards} for extra, stats in zip(extra_infos, agent_stats)]
    batch = Batch.from_rollout(
        [prompt.prompt_ids for prompt in per_sample], [output.token_ids for output in outputs],
        pad_token_id=tokenizer.pad_token_id, eos_token_ids=eos_token_ids,
        rollout_log_probs=[output.log_probs for output in outputs],
        response_masks=[output.response_mask for output in outputs],
        uids=[f"{uid_prefix}-{output.prompt_index}" for output in outputs],
        data_sources=[prompt.data_source for prompt in per_sample],
        ground_truths=[prompt.ground_truth for prompt in per_sample],
        extra_infos=extra_infos)
    batch.policy_versions = torch.tensor([output.policy_version for output in outputs], dtype=torch.int64)
    # the response's attended tokens are a prefix of each row (up to EOS; multi-turn: every turn): one host list
    lengths = batch.attention_mask[:, batch.prompt_length:].sum(dim=1).tolist()
    responses = tokenizer.batch_decode([row[:int(length)] for row, length in zip(batch.responses.tolist(), lengths)],
                                       skip_special_tokens=True)
    return Experience(batch=batch, responses=responses, prompts=per_sample, agent_stats=agent_stats)


@dataclass
class Scores:
    """Rewards of an experience batch and what the reward manager reported."""

    scores: torch.Tensor  # [B] sequence rewards
    accuracies: torch.Tensor | None  # [B] the reward function's `acc` where it gives one, else the score; None:
    # the run has no notion of accuracy (NLA's reconstruction reward)
    metrics: dict[str, float]
    extras: dict[str, list[float]]  # the numbers the reward function returned beside its score, per sample


def score_experience(manager: RewardManager, experience: Experience, stop_if_none_scored: bool = True) -> Scores:
    """The manager's scores of `experience`. A training step's batch whose every sample failed to
    score stops the run (`RewardManager.score`); validation passes `stop_if_none_scored=False`
    and counts its failures."""
    batch = experience.batch
    items = [RewardItem(data_source, text, truth, extra)
             for data_source, text, truth, extra in zip(batch.data_sources, experience.responses,
                                                         batch.ground_truths, batch.extra_infos)]
    result = manager.score(items, stop_if_none_scored=stop_if_none_scored)
    scores = torch.tensor(result.scores, dtype=torch.float32)
    accuracies = torch.tensor(result.extras["acc"], dtype=torch.float32) if "acc" in result.extras else scores
    accuracies = torch.where(torch.isnan(accuracies), scores, accuracies)
    metrics = {"reward/errors": float(result.num_errors), "reward/timeouts": float(result.num_timeouts)}
    for key, values in result.extras.items():
        finite = [value for value in values if value == value]
        if finite:
            metrics[f"reward/{key}/mean"] = sum(finite) / len(finite)
    return Scores(scores=scores, accuracies=accuracies, metrics=metrics, extras=dict(result.extras))


def token_level_scores(batch: Batch, scores: torch.Tensor) -> torch.Tensor:
    """Each sequence's reward on its last response token, the rest zero."""
    return scores_to_token_rewards(scores, batch.response_mask)
