"""NLA's data files, read into records the trainers use: prompts with a marker and a vector, SFT examples.

An RL row holds `prompt` (chat messages whose user turn carries `<concept>MARKER</concept>`),
the activation vector (a list of floats under `nla.activation_vector_key`) and provenance
columns (`sample_uuid`, `activation_layer`, ...); an SFT row adds `response`. Every row is
checked and tokenized when the dataset is built: a vector of the wrong length, a prompt with
no marker (the fork injects at position 0 or 1 then, silently) or with several (the fork
uses the first) stops the run naming the file, the row and the column. The marker position
of a record is its index in the record's own prompt token list, as the Batch's
`injection_positions` and the rollout's `Injection.position` count it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

from ember.config.schema.nla import NLASection
from ember.data.chat import Messages, check_messages, encode_texts, render_chat
from ember.data.parquet import DatasetError, SourceRow, as_file_list, read_parquet_rows, read_parquet_schema
from ember.data.rl_dataset import sample_positions, truncate_tokens
from ember.nla.marker import Marker, check_recorded_marker, choose_marker

# Columns the extraction writes about where a vector came from; kept with each record, never required.
PROVENANCE_COLUMNS = (
    "sample_uuid", "activation_layer", "activation_token_id", "source_sequence_token_index", "immediate_prefix",
    "activation_vector_source_uuid", "activation_token", "source_message_token_index", "prompt_token_index",
    "tokenized_source", "forward_pass_text", "prompt_text", "is_chat", "source", "formatted_source",
)


@dataclass(frozen=True)
class VectorOptions:
    """How vectors are read: the length they must have and the fork's SFT transforms (nla.norm, nla.scale)."""

    column: str = "activation_vector"
    size: int | None = None  # required length (the actor's hidden size); None = the first row's
    norm: str | None = None  # "unit": divide by the L2 norm
    scale: float | None = None  # multiply by this, after norm


def model_hidden_size(path: str, trust_remote_code: bool = False) -> int:
    """Hidden size of the model at `path`: the length its injected vectors must have (modes replace and add)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return config.get_text_config().hidden_size


def vector_options(nla: NLASection, hidden_size: int) -> VectorOptions:
    """How the `nla` section says vectors are read for an actor of `hidden_size`: that length in modes replace
    and add; in mode project any length the file keeps to (the projection maps it to the hidden size)."""
    size = None if nla.injection.mode == "project" else hidden_size
    return VectorOptions(nla.activation_vector_key, size, nla.norm, nla.scale)


def reading_options(nla: NLASection, tokenizer: PreTrainedTokenizerBase, model_path: str,
                    trust_remote_code: bool = False) -> tuple[Marker, VectorOptions]:
    """The marker `tokenizer` keeps (`nla.injection.injection_token` or ember's choice) and how vectors are read
    for the actor at `model_path`: what every NLA reader of rows needs."""
    return (choose_marker(tokenizer, nla.injection.injection_token),
            vector_options(nla, model_hidden_size(model_path, trust_remote_code)))


@dataclass(frozen=True)
class NLAPromptRecord:
    """One RL prompt: what the rollout generates from and what the critic's reward compares against."""

    prompt_ids: list[int]  # the chat-rendered prompt, generation prompt included
    marker_position: int  # index of the marker in prompt_ids
    vector: torch.Tensor  # [H] float32, as injected and as the critic's target
    provenance: dict[str, Any]  # the row's provenance columns that are present
    index: int  # row index over the files read, in order
    prompt_text: str  # what prompt_ids decode to
    messages: Messages  # the chat messages (the marker written in)


@dataclass(frozen=True)
class NLASFTExample:
    """One SFT example: the actor's target is the response after the prompt, the critic's input the response alone."""

    prompt_ids: list[int]  # the first user turn, stripped and rendered with the generation prompt (as the fork)
    response_ids: list[int]  # the response, then EOS
    marker_position: int  # index of the marker in prompt_ids
    vector: torch.Tensor  # [H] float32
    index: int
    response_text: str


def read_vector(row: SourceRow, options: VectorOptions) -> torch.Tensor:
    """The row's vector as float32 [H], checked and transformed as `options` say."""
    value = row.values[options.column]
    if not isinstance(value, list) or not value or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                           for x in value):
        raise row.error(options.column, f"expected the activation vector as a non-empty list of numbers, got {value!r:.120}")
    if options.size is not None and len(value) != options.size:
        raise row.error(options.column, f"Activation vector dimension mismatch: expected {options.size}, got {len(value)} "
                                        "(the vectors must come from a model of the actor's hidden size)")
    if not all(math.isfinite(x) for x in value):
        raise row.error(options.column, "the activation vector holds NaN or infinite values")
    vector = torch.tensor(value, dtype=torch.float32)
    if options.norm == "unit":
        norm = vector.norm()
        if norm == 0:
            raise row.error(options.column, "the activation vector is all zeros, so nla.norm=unit cannot scale it")
        vector = vector / norm
    if options.scale is not None:
        vector = vector * options.scale
    return vector


def find_marker(row: SourceRow, column: str, ids: Sequence[int], marker: Marker) -> int:
    """The index of the one marker token in `ids`; no marker or several stop the run, naming the row."""
    positions = [index for index, token in enumerate(ids) if token == marker.token_id]
    if not positions:
        raise row.error(column, f"the prompt holds no marker {marker.concept} (token id {marker.token_id}), so the "
                                "vector has nowhere to go (the fork would write it at position 0 or 1 without a word); "
                                "write the marker into the user turn, or set nla.injection.position=start or end")
    if len(positions) > 1:
        raise row.error(column, f"the prompt holds the marker {marker.character!r} {len(positions)} times (token "
                                f"positions {positions}); the fork injects at the first only: keep one")
    return positions[0]


def with_marker(messages: Messages, marker: Marker, position: str) -> Messages:
    """`messages` with `<concept>MARKER</concept>` written at the start or end of the last user turn,
    when no message holds the marker (`nla.injection.position` start / end); unchanged for manual."""
    if position == "manual" or any(marker.character in message["content"] for message in messages):
        return messages
    users = [index for index, message in enumerate(messages) if message["role"] == "user"]
    if not users:
        return messages  # find_marker names the row
    last = users[-1]
    content = messages[last]["content"]
    content = f"{marker.concept} {content}" if position == "start" else f"{content} {marker.concept}"
    return [*messages[:last], {**messages[last], "content": content}, *messages[last + 1:]]


def _provenance(row: SourceRow) -> dict[str, Any]:
    return {column: row.values[column] for column in PROVENANCE_COLUMNS if row.values.get(column) is not None}


def _first_size(options: VectorOptions, rows: list[SourceRow]) -> VectorOptions:
    """`options` with `size` fixed from the first row when none was given (vectors of project mode)."""
    if options.size is not None or not rows:
        return options
    first = rows[0].values.get(options.column)
    size = len(first) if isinstance(first, list) else None
    return VectorOptions(options.column, size, options.norm, options.scale)


def _read_rows(files: str | os.PathLike | Iterable[str | os.PathLike], marker: Marker,
               required: dict[str, str | None]) -> list[SourceRow]:
    paths = as_file_list(files)
    for path in paths:
        check_recorded_marker(path, marker)
    rows = read_parquet_rows(paths, required, optional=PROVENANCE_COLUMNS)
    if not rows:
        raise DatasetError(f"no rows in {', '.join(paths)}; check the data files")
    return rows


class NLAPromptDataset:
    """RL prompts with their vectors, validated and tokenized once, indexed like a list."""

    def __init__(self, files: str | os.PathLike | Iterable[str | os.PathLike], tokenizer: PreTrainedTokenizerBase,
                 marker: Marker, vectors: VectorOptions, prompt_key: str = "prompt", max_prompt_length: int = 512,
                 truncation: str = "error", position: str = "manual"):
        rows = _read_rows(files, marker, {prompt_key: "data.prompt_key", vectors.column: "nla.activation_vector_key"})
        vectors = _first_size(vectors, rows)
        messages = [with_marker(check_messages(row, prompt_key), marker, position) for row in rows]
        texts = [render_chat(tokenizer, chat, True) for chat in messages]
        self.records: list[NLAPromptRecord] = []
        for index, (row, chat, text, ids) in enumerate(zip(rows, messages, texts, encode_texts(tokenizer, texts))):
            vector = read_vector(row, vectors)
            if len(ids) > max_prompt_length:
                if truncation == "error":
                    raise row.error(prompt_key, f"prompt has {len(ids)} tokens, more than data.max_prompt_length="
                                                f"{max_prompt_length}; raise it, or set data.truncation to left, right or middle")
                ids = truncate_tokens(ids, max_prompt_length, truncation)
                text = tokenizer.decode(ids)
            position_of_marker = find_marker(row, prompt_key, ids, marker)
            self.records.append(NLAPromptRecord(ids, position_of_marker, vector, _provenance(row), index, text, chat))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> NLAPromptRecord:
        return self.records[index]


class NLASFTDataset:
    """SFT examples with their vectors (for the actor and the critic alike), indexed like a list."""

    def __init__(self, files: str | os.PathLike | Iterable[str | os.PathLike], tokenizer: PreTrainedTokenizerBase,
                 marker: Marker, vectors: VectorOptions, prompt_key: str = "prompt", response_key: str = "response",
                 max_length: int = 1024, truncation: str = "error", max_samples: int = -1):
        if tokenizer.eos_token_id is None:
            raise DatasetError(f"tokenizer {tokenizer.name_or_path!r} has no eos token to end responses with")
        rows = _read_rows(files, marker, {prompt_key: "data.prompt_key", response_key: "data.response_key",
                                                 vectors.column: "nla.activation_vector_key"})
        rows = [rows[i] for i in sample_positions(len(rows), max_samples, seed=None)]  # the first ones, as verl's SFT
        vectors = _first_size(vectors, rows)
        self.examples: list[NLASFTExample] = []
        for index, row in enumerate(rows):
            vector = read_vector(row, vectors)
            response = row.values[response_key]
            if not isinstance(response, str) or not response:
                raise row.error(response_key, f"expected the response as a non-empty string, got {response!r:.120}")
            prompt_text = render_chat(tokenizer, [{"role": "user", "content": _user_turn(row, prompt_key)}], True)
            prompt_ids, response_ids = encode_texts(tokenizer, [prompt_text, response])
            response_ids.append(tokenizer.eos_token_id)
            total = len(prompt_ids) + len(response_ids)
            if total > max_length:
                if truncation == "error":
                    raise row.error(response_key, f"prompt and response have {total} tokens, more than data.max_length="
                                                  f"{max_length}; raise data.max_length or set data.truncation=right")
                if truncation != "right" or len(prompt_ids) >= max_length:
                    raise row.error(prompt_key, f"cutting {total} tokens to data.max_length={max_length} on the "
                                                f"{truncation} would cut the prompt (and its marker); raise data.max_length")
                response_ids = response_ids[: max_length - len(prompt_ids)]
            marker_position = find_marker(row, prompt_key, prompt_ids, marker)
            self.examples.append(NLASFTExample(prompt_ids, response_ids, marker_position, vector, index, response))

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> NLASFTExample:
        return self.examples[index]


def _user_turn(row: SourceRow, column: str) -> str:
    """The fork's SFT prompt: the first user message's content, stripped (a plain string prompt as it is)."""
    value = row.values[column]
    if isinstance(value, str):
        return value.strip()
    for message in check_messages(row, column):
        if message["role"] == "user":
            return message["content"].strip()
    raise row.error(column, "no user message, so the marker has no turn to sit in")


def activation_layers(files: str | os.PathLike | Iterable[str | os.PathLike]) -> set[int]:
    """The `activation_layer` values the files record (empty when the column is absent): the layer the vectors were
    read from, which the critic's `output_layer_index` must match."""
    layers: set[int] = set()
    for path in as_file_list(files):
        if "activation_layer" in read_parquet_schema(path):
            layers |= {row.values["activation_layer"] for row in read_parquet_rows(path, {"activation_layer": None})}
    return layers
