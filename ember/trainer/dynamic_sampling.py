"""DAPO as verl's recipe runs it: overlong reward shaping and dynamic sampling.

`shape_overlong` adds the overlong penalty (`algorithms/reward_shaping.py`) to each sample's
score; with `overlong_buffer.log` its values and the share of penalised samples become
metrics. `sample_dynamically` keeps the prompt groups whose metric varies and generates more
prompts (`data.gen_batch_size` per round) until `data.train_batch_size` groups are kept, then
takes the first that many; after `max_num_gen_batches` rounds (when > 0) it stops the run,
as verl does, saying the data is likely too hard or too easy for the model. A step that
needs several rounds takes several batches from the loader, so an epoch ends sooner.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ember.algorithms.reward_shaping import groups_with_spread, overlong_penalty
from ember.data.batch import Batch
from ember.errors import UserError
from ember.trainer.experience import Experience, Scores


def shape_overlong(experience: Experience, scored: Scores, options, max_length: int) -> Scores:
    """`scored` with the overlong penalty of each response added to its score."""
    lengths = experience.batch.response_mask.sum(dim=1)
    penalty = overlong_penalty(lengths, max_length, options.len, options.penalty_factor)
    metrics = dict(scored.metrics)
    extras = dict(scored.extras)
    if options.log:
        metrics["reward/overlong_reward/mean"] = penalty.mean().item()
        metrics["reward/overlong/mean"] = (penalty < 0).float().mean().item()
        extras["overlong_reward"] = penalty.tolist()
    return Scores(scores=scored.scores + penalty, accuracies=scored.accuracies, metrics=metrics, extras=extras)


def sample_dynamically(experience: Experience, scored: Scores,
                       generate_round: Callable[[list, str], tuple[Experience, Scores]],
                       next_prompts: Callable[[], list], options, groups_needed: int,
                       uid_prefix: str) -> tuple[Experience, Scores, dict[str, float]]:
    """The first `groups_needed` groups with spread, from this round and as many more as it takes."""
    kept: list[tuple[Experience, Scores]] = []
    kept_groups, generated_groups, rounds = 0, 0, 1
    while True:
        metric = scored.accuracies if options.metric == "acc" else scored.scores
        keep = groups_with_spread(experience.batch.uids, metric.tolist())
        kept.append(_select_groups(experience, scored, keep))
        kept_groups += len(keep)
        generated_groups += len(set(experience.batch.uids))
        if kept_groups >= groups_needed:
            break
        if 0 < options.max_num_gen_batches <= rounds:
            raise UserError(
                f"algorithm.filter_groups: {rounds} generation rounds (max_num_gen_batches={options.max_num_gen_batches}) "
                f"kept {kept_groups} of the {groups_needed} prompt groups a step needs ({generated_groups} generated): "
                f"almost every group scored alike on {options.metric}, so the data is likely too hard or too easy for "
                "the model. Raise max_num_gen_batches, set it to 0 for no limit, or use other data")
        rounds += 1
        experience, scored = generate_round(next_prompts(), f"{uid_prefix}-round{rounds}")
    experience, scored = _join(kept)
    first = _first_groups(experience.batch.uids, groups_needed)
    experience, scored = _take(experience, scored, first)
    metrics = {"batch/num_gen_batches": float(rounds), "batch/kept_groups": float(kept_groups),
               "batch/generated_groups": float(generated_groups),
               "batch/kept_group_fraction": kept_groups / max(generated_groups, 1)}
    return experience, scored, metrics


def _select_groups(experience: Experience, scored: Scores, groups: list[str]) -> tuple[Experience, Scores]:
    wanted = set(groups)
    return _take(experience, scored, [i for i, uid in enumerate(experience.batch.uids) if uid in wanted])


def _first_groups(uids: list[str], count: int) -> list[int]:
    """Indices of the samples of the first `count` groups, in order."""
    wanted = set(list(dict.fromkeys(uids))[:count])
    return [index for index, uid in enumerate(uids) if uid in wanted]


def _take(experience: Experience, scored: Scores, indices: list[int]) -> tuple[Experience, Scores]:
    rows = torch.as_tensor(indices, dtype=torch.long)
    return (Experience(batch=experience.batch.select(indices), responses=[experience.responses[i] for i in indices],
                       prompts=[experience.prompts[i] for i in indices]),
            Scores(scores=scored.scores[rows], accuracies=scored.accuracies[rows], metrics=scored.metrics,
                   extras={key: [values[i] for i in indices] for key, values in scored.extras.items()}))


def _join(parts: list[tuple[Experience, Scores]]) -> tuple[Experience, Scores]:
    """One experience and its scores from several rounds' kept samples; the reward counters summed."""
    experiences = [experience for experience, _ in parts if len(experience.responses)]
    scores = [scored for experience, scored in parts if len(experience.responses)]
    metrics = dict(parts[-1][1].metrics)
    for key in ("reward/errors", "reward/timeouts"):
        metrics[key] = sum(scored.metrics.get(key, 0.0) for _, scored in parts)
    keys = scores[0].extras.keys()
    return (Experience(batch=Batch.concat([experience.batch for experience in experiences]),
                       responses=[text for experience in experiences for text in experience.responses],
                       prompts=[prompt for experience in experiences for prompt in experience.prompts]),
            Scores(scores=torch.cat([scored.scores for scored in scores]),
                   accuracies=torch.cat([scored.accuracies for scored in scores]), metrics=metrics,
                   extras={key: [value for scored in scores for value in scored.extras.get(key, [])] for key in keys}))
