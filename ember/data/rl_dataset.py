"""The RL prompt dataset: parquet rows in verl's format, rendered by the chat template, checked up front.

A row holds `data_source`, `prompt` (chat messages `[{role, content}]`), `ability`,
`reward_model: {style, ground_truth}` and `extra_info`. Every row is validated and
tokenized when the dataset is built, so a malformed row or an over-long prompt stops the
run before training starts, with a message naming the file, the row and the column.
Over-long prompts are either dropped (`filter_overlong_prompts`) or truncated as `truncation`
says; either way they are counted (`num_filtered_overlong`, `truncated_rows`) and logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from transformers import PreTrainedTokenizerBase

from ember.data.chat import Messages, check_messages, encode_texts, render_chat
from ember.data.parquet import DatasetError, SourceRow, read_parquet_rows

logger = logging.getLogger(__name__)

PROMPT_TRUNCATION_MODES = ("error", "left", "right", "middle")

Token = TypeVar("Token")


def truncate_tokens(tokens: Sequence[Token], max_length: int, side: str) -> list[Token]:
    """Cut `tokens` to `max_length`: `left` drops the start, `right` the end, `middle` the centre."""
    if len(tokens) <= max_length:
        return list(tokens)
    if side == "left":
        return list(tokens[len(tokens) - max_length :])
    if side == "right":
        return list(tokens[:max_length])
    if side == "middle":
        head = max_length // 2
        return list(tokens[:head]) + list(tokens[len(tokens) - (max_length - head) :])
    raise ValueError(f"unknown truncation side {side!r}; use left, right or middle")


@dataclass(frozen=True)
class PromptSample:
    """One prompt, ready for the rollout engine and the reward function."""

    prompt_ids: list[int]  # token ids of the rendered prompt, generation prompt included
    prompt_text: str  # the text those ids decode to
    data_source: str  # value of the reward_fn_key column; selects the reward function
    ground_truth: Any  # reward_model.ground_truth of the row
    extra_info: dict[str, Any]  # the row's extra_info ({} when the column is absent)
    index: int  # position of the row in the concatenated files, before any filtering
    raw_prompt: Messages | None = None  # the chat messages, kept only when return_raw_chat is set


class RLDataset:
    """Prompts read from parquet files, validated and tokenized once, indexed like a list."""

    def __init__(
        self,
        files: str | os.PathLike | Iterable[str | os.PathLike],
        tokenizer: PreTrainedTokenizerBase,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        return_raw_chat: bool = False,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        reward_fn_key: str = "data_source",
        max_samples: int = -1,
        sample_seed: int | None = None,
    ):
        if truncation not in PROMPT_TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is not one of {', '.join(PROMPT_TRUNCATION_MODES)}")
        rows = read_parquet_rows(
            files,
            required={prompt_key: "data.prompt_key", reward_fn_key: "data.reward_fn_key", "reward_model": None},
            optional=["extra_info"],
        )
        positions = sample_positions(len(rows), max_samples, sample_seed)
        if len(positions) < len(rows):
            logger.info("using %d of the %d rows of %s (%s)", len(positions), len(rows), files,
                        f"a random choice, seed {sample_seed}" if sample_seed is not None else "the first ones")
            rows = [rows[position] for position in positions]
        messages = [check_messages(row, prompt_key) for row in rows]
        texts = [render_chat(tokenizer, chat, True, apply_chat_template_kwargs) for chat in messages]
        token_ids = encode_texts(tokenizer, texts) if texts else []

        self.samples: list[PromptSample] = []
        self.num_filtered_overlong = 0  # prompts dropped for being longer than max_prompt_length
        self.truncated_rows: list[int] = []  # indices (as `PromptSample.index`) of the prompts truncation cut
        for index, row, chat, text, ids in zip(positions, rows, messages, texts, token_ids):
            # Checked before filtering, so that a malformed row is an error even when it is over-long.
            data_source = _data_source(row, reward_fn_key)
            ground_truth = _ground_truth(row)
            extra_info = _extra_info(row)
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered_overlong += 1
                    continue
                if truncation == "error":
                    raise row.error(
                        prompt_key,
                        f"prompt has {len(ids)} tokens, more than data.max_prompt_length={max_prompt_length}; "
                        "raise data.max_prompt_length, or set data.truncation to left, right or middle "
                        "(or data.filter_overlong_prompts=True to drop such prompts)",
                    )
                ids = truncate_tokens(ids, max_prompt_length, truncation)
                text = tokenizer.decode(ids)
                self.truncated_rows.append(index)
            self.samples.append(
                PromptSample(
                    prompt_ids=ids,
                    prompt_text=text,
                    data_source=data_source,
                    ground_truth=ground_truth,
                    extra_info=extra_info,
                    index=index,
                    raw_prompt=chat if return_raw_chat else None,
                )
            )
        if self.num_filtered_overlong:
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens "
                "(data.filter_overlong_prompts=True)",
                self.num_filtered_overlong,
                len(rows),
                max_prompt_length,
            )
        if self.truncated_rows:
            shown = ", ".join(map(str, self.truncated_rows[:10])) + (", ..." if len(self.truncated_rows) > 10 else "")
            logger.warning(
                "data.truncation=%s cut %d of %d prompts to data.max_prompt_length=%d tokens (rows %s of %s); "
                "the model sees them without their %s",
                truncation, len(self.truncated_rows), len(rows), max_prompt_length, shown, files,
                {"left": "start", "right": "end (the generation prompt with it)", "middle": "middle"}[truncation],
            )
        if not self.samples:
            raise DatasetError(
                f"no prompts left in {files} (read {len(rows)}, dropped {self.num_filtered_overlong} as over-long); "
                "add rows or raise data.max_prompt_length"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> PromptSample:
        return self.samples[index]


def sample_positions(total: int, max_samples: int, seed: int | None) -> list[int]:
    """The rows a dataset keeps of `total` (verl's `max_samples`): all when `max_samples` is not in 1 .. total - 1,
    else `max_samples` of them, drawn as verl draws them (`numpy.random.default_rng(seed).choice(total, max_samples,
    replace=False)`, in that order) when `seed` is given, or the first ones."""
    if not 0 < max_samples < total:
        return list(range(total))
    if seed is None:
        return list(range(max_samples))
    return [int(position) for position in np.random.default_rng(seed).choice(total, size=max_samples, replace=False)]


def _data_source(row: SourceRow, column: str) -> str:
    value = row.values[column]
    if not isinstance(value, str) or not value:
        raise row.error(column, f"expected the name of the data source as a non-empty string, got {value!r:.200}")
    return value


def _ground_truth(row: SourceRow) -> Any:
    value = row.values["reward_model"]
    if not isinstance(value, dict) or value.get("ground_truth") is None:
        raise row.error("reward_model", f"expected {{style, ground_truth}} with a ground_truth, got {value!r:.200}")
    return value["ground_truth"]


def _extra_info(row: SourceRow) -> dict[str, Any]:
    value = row.values.get("extra_info")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise row.error("extra_info", f"expected a mapping, got {type(value).__name__}")
    return value
