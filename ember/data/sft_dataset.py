"""The SFT dataset: parquet rows in one of three forms, turned into token ids and a loss mask.

Forms (chosen by `form`, or detected from the columns with `form="auto"`):
- `messages`: a chat list; the loss covers the assistant turns, each through its end-of-turn token.
- `prompt_response`: a prompt (string or chat list) rendered with the generation prompt,
  then the response; the loss covers the response and the eos token after it.
- `tokenized`: `input_ids`, `labels` (-100 where no loss) and optionally `attention_mask`
  (positions where it is 0 are dropped).
Everything is tokenized and checked when the dataset is built; `collate_sft` pads a list of
examples into the tensors a causal-LM forward takes.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from ember.data.chat import check_messages, encode_chat_with_assistant_mask, encode_texts, render_chat
from ember.data.parquet import DatasetError, SourceRow, as_file_list, read_parquet_rows, read_parquet_schema
from ember.data.rl_dataset import sample_positions, truncate_tokens

logger = logging.getLogger(__name__)

SFT_FORMS = ("auto", "messages", "prompt_response", "tokenized")
SFT_TRUNCATION_MODES = ("error", "left", "right")
IGNORE_INDEX = -100  # label of positions that carry no loss, as Hugging Face models expect


@dataclass(frozen=True)
class SFTExample:
    """One training sequence."""

    input_ids: list[int]  # the whole sequence, prompt and response
    loss_mask: list[int]  # 1 where the token is a target of the loss, 0 elsewhere


def _report_truncation(paths: list[str], truncation: str, truncated: int, total: int, max_length: int,
                       untrained: list[int]) -> None:
    """Logs how many rows truncation changed, and those it left with no token to train on (by row index)."""
    message = (f"{', '.join(paths)}: data.truncation={truncation} cut {truncated} of {total} rows to "
               f"data.max_length={max_length}")
    if untrained:
        shown = ", ".join(map(str, untrained[:10])) + (f" and {len(untrained) - 10} more" if len(untrained) > 10 else "")
        message += (f"; rows {shown} keep no token to train on (they fill batch slots and train on nothing): raise "
                    "data.max_length, or cut from the other side")
    logger.warning(message)


class SFTDataset:
    """SFT examples read from parquet files, tokenized and checked once, indexed like a list."""

    def __init__(
        self,
        files: str | os.PathLike | Iterable[str | os.PathLike],
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        truncation: str = "error",
        form: str = "auto",
        messages_key: str = "messages",
        prompt_key: str = "prompt",
        response_key: str = "response",
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        tools_key: str = "tools",
        max_samples: int = -1,
    ):
        if truncation not in SFT_TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r} is not one of {', '.join(SFT_TRUNCATION_MODES)}")
        if form not in SFT_FORMS:
            raise ValueError(f"SFT data form {form!r} is not one of {', '.join(SFT_FORMS)}")
        self.tokenizer = tokenizer
        self.template_kwargs = apply_chat_template_kwargs
        self.messages_key, self.prompt_key, self.response_key = messages_key, prompt_key, response_key
        self.tools_key = tools_key
        paths = as_file_list(files)
        self.form = self._detect_form(paths[0]) if form == "auto" else form
        required, encode, main_column = {
            "messages": ({messages_key: "data.messages_key"}, self._encode_messages, messages_key),
            "prompt_response": (
                {prompt_key: "data.prompt_key", response_key: "data.response_key"},
                self._encode_prompt_response,
                response_key,
            ),
            "tokenized": ({"input_ids": None, "labels": None}, self._encode_tokenized, "input_ids"),
        }[self.form]
        optional = {"tokenized": ["attention_mask"], "messages": [tools_key]}.get(self.form, [])
        rows = read_parquet_rows(paths, required, optional=optional)
        kept = sample_positions(len(rows), max_samples, seed=None)  # the first rows, as verl's SFT dataset
        if len(kept) < len(rows):
            logger.info("using the first %d of the %d rows of %s", len(kept), len(rows), ", ".join(paths))
            rows = [rows[i] for i in kept]
        self.examples: list[SFTExample] = []
        truncated, untrained = 0, []
        for index, row in enumerate(rows):
            input_ids, loss_mask = encode(row)
            if len(input_ids) > max_length:
                if truncation == "error":
                    raise row.error(
                        main_column,
                        f"sequence has {len(input_ids)} tokens, more than data.max_length={max_length}; "
                        "raise data.max_length or set data.truncation to left or right",
                    )
                input_ids = truncate_tokens(input_ids, max_length, truncation)
                loss_mask = truncate_tokens(loss_mask, max_length, truncation)
                truncated += 1
                if not any(loss_mask):
                    untrained.append(index)
            self.examples.append(SFTExample(input_ids, loss_mask))
        if not self.examples:
            raise DatasetError(f"no rows in {', '.join(paths)}; check data.train_files / data.val_files")
        if truncated:
            _report_truncation(paths, truncation, truncated, len(self.examples), max_length, untrained)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> SFTExample:
        return self.examples[index]

    def _detect_form(self, path: str) -> str:
        columns = read_parquet_schema(path)
        if self.messages_key in columns:
            return "messages"
        if self.prompt_key in columns and self.response_key in columns:
            return "prompt_response"
        if "input_ids" in columns:
            return "tokenized"
        raise DatasetError(
            f"{path}: cannot tell the SFT data form from its columns ({', '.join(columns)}); expected a "
            f"{self.messages_key!r} column (data.messages_key), {self.prompt_key!r} and {self.response_key!r} "
            "columns (data.prompt_key, data.response_key), or 'input_ids' and 'labels'"
        )

    def _encode_messages(self, row: SourceRow) -> tuple[list[int], list[int]]:
        messages = check_messages(row, self.messages_key)
        if not any(message["role"] == "assistant" for message in messages):
            raise row.error(self.messages_key, "no assistant message, so nothing to train on")
        if messages[0]["role"] == "assistant":
            raise row.error(self.messages_key, "starts with an assistant message; put a user or system message first")
        template_kwargs = dict(self.template_kwargs or {})
        tools = self._tools(row)
        if tools is not None:
            template_kwargs["tools"] = tools
        return encode_chat_with_assistant_mask(self.tokenizer, messages, template_kwargs)

    def _tools(self, row: SourceRow) -> list[dict] | None:
        """The row's tool schemas (`data.multiturn.tools_key`: a list of dicts, or its JSON text), for the template."""
        value = row.values.get(self.tools_key)
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as error:
                raise row.error(self.tools_key, f"is text but not JSON ({error})") from None
        if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
            raise row.error(self.tools_key, f"expected a list of tool schemas (dicts), got {value!r:.200}")
        return value

    def _encode_prompt_response(self, row: SourceRow) -> tuple[list[int], list[int]]:
        prompt, response = row.values[self.prompt_key], row.values[self.response_key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = check_messages(row, self.prompt_key)
        if not isinstance(response, str):
            raise row.error(self.response_key, f"expected the response as a string, got {response!r:.200}")
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {self.tokenizer.name_or_path!r} has no eos token to end responses with")
        prompt_text = render_chat(self.tokenizer, messages, True, self.template_kwargs)
        prompt_ids, response_ids = encode_texts(self.tokenizer, [prompt_text, response])
        response_ids.append(self.tokenizer.eos_token_id)
        return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)

    def _encode_tokenized(self, row: SourceRow) -> tuple[list[int], list[int]]:
        columns = ["input_ids", "labels"] + (["attention_mask"] if "attention_mask" in row.values else [])
        for column in columns:
            value = row.values[column]
            if not (isinstance(value, list) and all(isinstance(item, int) for item in value)):
                raise row.error(column, f"expected a list of integers, got {value!r:.200}")
            if len(value) != len(row.values["input_ids"]):
                raise row.error(column, f"has {len(value)} entries but input_ids has {len(row.values['input_ids'])}")
        input_ids, labels = row.values["input_ids"], row.values["labels"]
        attention_mask = row.values.get("attention_mask") or [1] * len(input_ids)
        kept = [position for position, attended in enumerate(attention_mask) if attended]
        for position in kept:
            if labels[position] not in (IGNORE_INDEX, input_ids[position]):
                raise row.error(
                    "labels",
                    f"labels[{position}]={labels[position]} is neither -100 nor input_ids[{position}]="
                    f"{input_ids[position]}; give unshifted labels (the loss shifts them)",
                )
        return [input_ids[p] for p in kept], [int(labels[p] != IGNORE_INDEX) for p in kept]


def collate_sft(examples: list[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad `examples` into `input_ids`, `attention_mask`, `position_ids` and `labels` (-100 off the loss)."""
    longest = max(len(example.input_ids) for example in examples)
    input_ids = torch.full((len(examples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    position_ids = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        ids = torch.tensor(example.input_ids, dtype=torch.long)
        input_ids[row, :length] = ids
        labels[row, :length] = torch.where(torch.tensor(example.loss_mask, dtype=torch.bool), ids, IGNORE_INDEX)
        attention_mask[row, :length] = 1
        position_ids[row, :length] = torch.arange(length)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, "labels": labels}
