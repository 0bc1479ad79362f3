"""Validation: generate for every validation prompt with `rollout.val_kwargs` (greedy and
n=1 by default), score, and report accuracy per data source as `val-core/<source>/acc`.

Prompts go to the rollout in batches of `data.val_batch_size` (512 when null). A reward function
that fails or times out on a validation sample scores it `reward_model.failure_score`, as in
training; the count is reported as `val/reward_errors` and `val/reward_timeouts`, so a
validation accuracy lowered by a broken reward function does not pass for a worse policy."""

from __future__ import annotations

from collections import defaultdict

from ember.data.rl_dataset import RLDataset
from ember.rewards import RewardManager
from ember.rollout import RolloutEngine, SamplingParams
from ember.trainer.experience import Experience, Scores, generate_experience, score_experience

DEFAULT_BATCH_SIZE = 512  # prompts per rollout call when data.val_batch_size is null


def validation_sampling(val_kwargs, max_new_tokens: int, stop_ids: list[int], seed: int) -> SamplingParams:
    greedy = not val_kwargs.do_sample or val_kwargs.temperature == 0
    return SamplingParams(n=val_kwargs.n, temperature=1.0 if greedy else val_kwargs.temperature,
                          top_p=val_kwargs.top_p, top_k=val_kwargs.top_k, max_new_tokens=max_new_tokens,
                          do_sample=not greedy, stop_token_ids=tuple(stop_ids), seed=seed)


def validate(rollout: RolloutEngine, dataset: RLDataset, manager: RewardManager, tokenizer, sampling: SamplingParams,
             stop_ids: list[int], batch_size: int | None = None
             ) -> tuple[dict[str, float], list[tuple[Experience, Scores]]]:
    """Metrics `val-core/<data_source>/acc`, `val-core/mean/acc`, `val-aux/<data_source>/score`,
    `val/reward_errors` and `val/reward_timeouts`, and each batch's experience with its scores;
    prompts in batches of `batch_size` (null: 512)."""
    batch_size = batch_size or DEFAULT_BATCH_SIZE
    accuracies: dict[str, list[float]] = defaultdict(list)
    scores: dict[str, list[float]] = defaultdict(list)
    failures = {"val/reward_errors": 0.0, "val/reward_timeouts": 0.0}
    experiences = []
    prompts = [dataset[i] for i in range(len(dataset))]
    for start in range(0, len(prompts), batch_size):
        experience = generate_experience(rollout, prompts[start:start + batch_size], sampling, tokenizer, stop_ids,
                                         uid_prefix=f"val{start}")
        result = score_experience(manager, experience, stop_if_none_scored=False)
        failures["val/reward_errors"] += result.metrics["reward/errors"]
        failures["val/reward_timeouts"] += result.metrics["reward/timeouts"]
        for source, accuracy, score in zip(experience.batch.data_sources, result.accuracies.tolist(),
                                           result.scores.tolist()):
            accuracies[source].append(accuracy)
            scores[source].append(score)
        experiences.append((experience, result))
    metrics = {}
    for source in sorted(accuracies):
        metrics[f"val-core/{source}/acc"] = sum(accuracies[source]) / len(accuracies[source])
        metrics[f"val-aux/{source}/score"] = sum(scores[source]) / len(scores[source])
    every = [value for values in accuracies.values() for value in values]
    metrics["val-core/mean/acc"] = sum(every) / len(every)
    metrics.update(failures)
    return metrics, experiences
