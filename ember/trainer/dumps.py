"""Generations written to disk as jsonl: `trainer.rollout_data_dir` (each training step's samples)
and `trainer.validation_data_dir` (each validation's), one file per step, `<dir>/<step>.jsonl`.

A line per sample, as verl writes them: `input` (the prompt text), `output` (the decoded
response), `gts` (the ground truth), `score` (the reward), `step`, each number the reward
function returned beside its score (`acc`, ...), and for training samples `advantage` (the
mean over the response's tokens: GRPO's per-sequence advantage).
"""

from __future__ import annotations

import json
import os

import torch

from ember.trainer.experience import Experience, Scores


def generation_records(experience: Experience, scores: Scores, step: int,
                       advantages: torch.Tensor | None = None) -> list[dict]:
    """One record per sample of `experience`, in its order; `advantages` [B] in that order too."""
    records = []
    for index, (prompt, response) in enumerate(zip(experience.prompts, experience.responses)):
        record = {"input": prompt.prompt_text, "output": response, "gts": prompt.ground_truth,
                  "score": float(scores.scores[index]), "step": step}
        if experience.batch.policy_versions is not None:
            record["policy_version"] = int(experience.batch.policy_versions[index])
        record.update({key: values[index] for key, values in scores.extras.items()})
        if advantages is not None:
            record["advantage"] = float(advantages[index])
        records.append(record)
    return records


def sequence_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B] mean advantage over each response's counted tokens."""
    mask = response_mask.float()
    return (advantages * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def advantages_in_generation_order(batch, order) -> torch.Tensor:
    """[B] `sequence_advantages` of a scored batch, put back in generation order (`order`: the balanced batch's
    sample i is generated sample order[i]; None when the batch was not reordered)."""
    advantages = sequence_advantages(batch.advantages, batch.response_mask)
    if order is None:
        return advantages
    restored = torch.empty_like(advantages)
    restored[torch.as_tensor(order)] = advantages
    return restored


def write_generations(directory: str, step: int, records: list[dict]) -> str:
    """Writes `records` to `<directory>/<step>.jsonl` (replacing a file a resumed run left there)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    return path
