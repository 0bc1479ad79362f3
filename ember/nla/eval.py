"""The NLA fork's string-match evaluation: does the actor's explanation of a known vector name the expected word?

An evaluation set is a parquet of `source_prompt`, `activation_vector` (the source model's
vector at the prompt's last token), `expected_completions` (a string or a list of strings)
and `description` (its text before the first `_` is the row's category). Each row's prompt
is `nla_eval.template` as the user turn, the vector injected at the marker; the actor writes
`num_generations_per_prompt` explanations and the row scores the fraction that contain an
expected string as a whole word, case-insensitively. Scoring is a pure function
(`score_string_match`); generation goes through the rollout interface with one `Injection`
per prompt. Metrics keep the fork's names: `nla_eval/<set>/accuracy`,
`nla_eval/<set>/accuracy_<category>`, `nla_eval/<set>/num_prompts`,
`nla_eval/aggregate/accuracy` (the mean over sets) and `nla_eval/evaluation_time`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from ember.config.schema.nla import NLAEvalConfig
from ember.data.chat import encode_texts, render_chat
from ember.data.parquet import DatasetError, SourceRow, read_parquet_rows
from ember.nla.data import VectorOptions, find_marker, read_vector
from ember.nla.marker import Marker, check_recorded_marker
from ember.rollout.base import Injection, RolloutEngine, SamplingParams

# The fork samples evaluation explanations with these, whatever the training rollout uses.
EVAL_TOP_K = 50
EVAL_TOP_P = 0.9


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation row, its prompt rendered and tokenized."""

    source_prompt: str
    expected: list[str]  # any of these, as a whole word, makes an explanation correct
    description: str
    vector: torch.Tensor  # [H] float32
    prompt_ids: list[int]
    marker_position: int


def eval_sets(eval_files: dict[str, str], eval_file: str | None) -> dict[str, str]:
    """The evaluation sets by name: `eval_files`, or `eval_file` as the set named default (the fork's rule)."""
    return dict(eval_files) if eval_files else ({"default": eval_file} if eval_file is not None else {})


def read_eval_set(path: str, tokenizer: PreTrainedTokenizerBase, marker: Marker, template: str,
                  vectors: VectorOptions, max_samples: int | None = None) -> list[EvalRecord]:
    """The first `max_samples` rows (all when None) of the evaluation parquet at `path`, ready to generate from."""
    check_recorded_marker(path, marker)
    rows = read_parquet_rows(path, {"source_prompt": None, vectors.column: "nla.activation_vector_key",
                                    "expected_completions": None}, optional=["description"])
    rows = rows[:max_samples] if max_samples is not None else rows
    if not rows:
        raise DatasetError(f"{path} holds no evaluation rows")
    records = []
    for row in rows:
        source_prompt = row.values["source_prompt"]
        if not isinstance(source_prompt, str):
            raise row.error("source_prompt", f"expected a string, got {source_prompt!r:.120}")
        user = template.format(injection_character=marker.character, source_prompt=source_prompt)
        (ids,) = encode_texts(tokenizer, [render_chat(tokenizer, [{"role": "user", "content": user}], True)])
        records.append(EvalRecord(source_prompt, _expected(row), str(row.values.get("description") or "unknown"),
                                  read_vector(row, vectors), ids, find_marker(row, "source_prompt", ids, marker)))
    return records


def _expected(row: SourceRow) -> list[str]:
    value = row.values["expected_completions"]
    expected = [value] if isinstance(value, str) else value
    if not isinstance(expected, list) or not expected or not all(isinstance(item, str) and item for item in expected):
        raise row.error("expected_completions", f"expected a non-empty string or list of strings, got {value!r:.120}")
    return expected


def read_eval_sets(evaluation: NLAEvalConfig, tokenizer: PreTrainedTokenizerBase, marker: Marker,
                   vectors: VectorOptions) -> dict[str, list[EvalRecord]]:
    """Every evaluation set `nla_eval` names, read and rendered, by set name."""
    return {name: read_eval_set(path, tokenizer, marker, evaluation.template, vectors, evaluation.max_samples)
            for name, path in eval_sets(evaluation.eval_files, evaluation.eval_file).items()}


def is_word_match(text: str, target: str) -> bool:
    """Whether `target` appears in `text` as a whole word, ignoring case ("red" is not in "bred")."""
    return re.search(r"\b" + re.escape(target.lower()) + r"\b", text.lower()) is not None


def category_of(description: str) -> str:
    """A row's category: its description up to the first "_" ("general" when it has none)."""
    return description.split("_")[0] if "_" in description else "general"


def score_string_match(responses: Sequence[str], expected: Sequence[Sequence[str]], descriptions: Sequence[str],
                       generations_per_prompt: int) -> dict[str, float]:
    """The fork's metrics of one set: responses come grouped by prompt (prompt i's at i*n .. i*n+n-1)."""
    n = generations_per_prompt
    if len(responses) != len(expected) * n or len(descriptions) != len(expected):
        raise ValueError(f"{len(responses)} responses for {len(expected)} prompts × {n} generations "
                         f"({len(descriptions)} descriptions)")
    scores, by_category = [], {}
    for index, targets in enumerate(expected):
        matches = sum(any(is_word_match(response, target) for target in targets)
                      for response in responses[index * n:(index + 1) * n])
        scores.append(matches / n)
        by_category.setdefault(category_of(descriptions[index]), []).append(matches / n)
    metrics = {"accuracy": sum(scores) / len(scores) if scores else 0.0, "num_prompts": len(scores),
               "num_generations_per_prompt": n}
    metrics.update({f"accuracy_{category}": sum(values) / len(values) for category, values in by_category.items()})
    return metrics


def eval_metrics(per_set: dict[str, dict[str, float]], seconds: float) -> dict[str, float]:
    """The per-set metrics under `nla_eval/<set>/`, their mean accuracy and the time the evaluation took."""
    metrics = {f"nla_eval/{name}/{key}": value for name, values in per_set.items() for key, value in values.items()}
    if per_set:
        metrics["nla_eval/aggregate/accuracy"] = sum(values["accuracy"] for values in per_set.values()) / len(per_set)
    metrics["nla_eval/evaluation_time"] = seconds
    return metrics


def should_evaluate(step: int, freq: int, total_steps: int) -> bool:
    """The fork's schedule: at step 1, every `freq` steps and at the last step."""
    return step == 1 or step % freq == 0 or step >= total_steps


def eval_sampling(evaluation: NLAEvalConfig, stop_token_ids: Sequence[int], seed: int | None = None) -> SamplingParams:
    return SamplingParams(n=evaluation.num_generations_per_prompt, temperature=evaluation.temperature, top_p=EVAL_TOP_P,
                          top_k=EVAL_TOP_K, max_new_tokens=evaluation.max_new_tokens, do_sample=evaluation.do_sample,
                          stop_token_ids=tuple(stop_token_ids), seed=seed)


def generate_explanations(rollout: RolloutEngine, records: Sequence[EvalRecord], sampling: SamplingParams,
                          tokenizer: PreTrainedTokenizerBase, mode: str = "replace") -> list[str]:
    """`sampling.n` explanations per record, grouped by record, each written with the record's vector at its marker."""
    outputs = rollout.generate([record.prompt_ids for record in records], sampling,
                               injections=[Injection(position=record.marker_position, vector=record.vector, mode=mode)
                                           for record in records])
    return [tokenizer.decode(output.token_ids, skip_special_tokens=True) for output in outputs]


def evaluate(rollout: RolloutEngine, sets: dict[str, list[EvalRecord]], sampling: SamplingParams,
             tokenizer: PreTrainedTokenizerBase, mode: str = "replace") -> tuple[dict[str, float], dict[str, list[str]]]:
    """Every set's metrics (`eval_metrics`) and its explanations, by set name (`mode`: nla.injection.mode)."""
    start = time.perf_counter()
    per_set, explanations = {}, {}
    for name, records in sets.items():
        explanations[name] = generate_explanations(rollout, records, sampling, tokenizer, mode)
        per_set[name] = score_string_match(explanations[name], [record.expected for record in records],
                                           [record.description for record in records], sampling.n)
    return eval_metrics(per_set, time.perf_counter() - start), explanations


def write_explanations(folder: str | Path, name: str, step: int, records: Sequence[EvalRecord],
                       explanations: Sequence[str], generations_per_prompt: int) -> Path:
    """The explanations of one set at one step as JSON lines (`<folder>/<name>/<step>.jsonl`), as the fork keeps them."""
    path = Path(folder) / name / f"{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as lines:
        for index, explanation in enumerate(explanations):
            record = records[index // generations_per_prompt]
            lines.write(json.dumps({"dataset": name, "index": index, "step": step, "source_prompt": record.source_prompt,
                                    "expected_completion": record.expected, "description": record.description,
                                    "generated_response": explanation,
                                    "match_found": any(is_word_match(explanation, t) for t in record.expected)}) + "\n")
    return path
