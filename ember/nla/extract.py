"""`ember nla extract`: activation vectors of a base model over text documents, written as NLA's RL, SFT or eval rows.

Each document (a .parquet or .jsonl row: plain text, or a chat rendered with the model's
template) is tokenized and cut to `sampling.max_length` tokens; `activations_per_sample`
token positions are drawn from it (seeded; never position 0 of a document longer than one
token, whose activations are outliers); a row's vector is transformers'
`hidden_states[model.layer_index]` at its position (0 = the embeddings, L = the output of
decoder layer L). Eval rows take the last token of `source_prompt`. RL rows hold the actor's
prompt (`prompt.messages`, the marker written in) and provenance; SFT rows add a response
from the documents' `response` column or from a summariser model run on ember's engine. The
`_random` control file holds the same rows with the vectors moved between them (a
permutation without fixed points), each row naming its donor. The marker is recorded in
every file written (ember/nla/marker.py).
"""

from __future__ import annotations

import logging
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ember.config.errors import ConfigError
from ember.config.schema.nla_extract import ExtractOutputConfig, NLAExtractConfig, RandomVariantConfig, SummarizerConfig
from ember.data.chat import Messages, check_messages, encode_texts, render_chat
from ember.data.parquet import DatasetError, SourceRow, read_records, write_parquet_files
from ember.nla.checks import model_layer_count, resolve_layer_index
from ember.nla.marker import Marker, choose_marker, marker_metadata

logger = logging.getLogger(__name__)

VECTOR_COLUMN = "activation_vector"
DEFAULT_BATCH_SIZE = 8  # documents per forward pass when sampling.parallel_batch_size is null


@dataclass(frozen=True)
class Draw:
    """One vector to read: document `document`, token `position` of its ids."""

    document: int
    position: int
    sample_uuid: str


def read_documents(cfg: NLAExtractConfig) -> list[SourceRow]:
    """The documents of `dataset.input_parquet`, sliced and capped as `dataset` says."""
    dataset = cfg.dataset
    if dataset.input_parquet is None:
        raise ConfigError("dataset.input_parquet is not set; give the documents as a .parquet or .jsonl file")
    column = dataset.chat_column or dataset.text_column
    required: dict[str, str | None] = {column: "dataset.chat_column" if dataset.chat_column else "dataset.text_column"}
    if cfg.mode == "eval":
        required["expected_completions"] = None
    rows = read_records(dataset.input_parquet, required)
    start = dataset.slice_start or 0
    rows = rows[start: None if dataset.slice_length is None else start + dataset.slice_length]
    rows = rows[: dataset.max_samples] if dataset.max_samples is not None else rows
    if not rows:
        raise DatasetError(f"{dataset.input_parquet}: no documents left after dataset.slice_start / slice_length / "
                           "max_samples; widen them")
    return rows


def document_ids(row: SourceRow, cfg: NLAExtractConfig, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """A document's token ids as the model reads it, cut to sampling.max_length."""
    dataset = cfg.dataset
    if dataset.chat_column is not None:
        messages = check_messages(row, dataset.chat_column)
        if dataset.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": dataset.system_prompt}, *messages]
        (ids,) = encode_texts(tokenizer, [render_chat(tokenizer, messages, dataset.add_generation_prompt)])
    else:
        text = row.values[dataset.text_column]
        if not isinstance(text, str) or not text:
            raise row.error(dataset.text_column, f"expected the document as a non-empty string, got {text!r:.120}")
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return list(ids[: cfg.sampling.max_length])


def draw_positions(length: int, count: int, rng: random.Random) -> list[int]:
    """`count` distinct token positions of a `length`-token document, uniformly, position 0 only when it is alone."""
    candidates = range(1, length) if length > 1 else range(length)
    return sorted(rng.sample(candidates, min(count, len(candidates))))


def plan_draws(documents: list[list[int]], cfg: NLAExtractConfig) -> list[Draw]:
    """Which token of which document gives each row, at most sampling.total_activations of them."""
    rng = random.Random(cfg.seed)
    draws: list[Draw] = []
    for index, ids in enumerate(documents):
        positions = [len(ids) - 1] if cfg.mode == "eval" else draw_positions(len(ids), cfg.sampling.activations_per_sample, rng)
        draws += [Draw(index, position, str(uuid.UUID(int=rng.getrandbits(128), version=4))) for position in positions]
        if cfg.sampling.total_activations is not None and len(draws) >= cfg.sampling.total_activations:
            return draws[: cfg.sampling.total_activations]
    return draws


@torch.no_grad()
def read_vectors(model: torch.nn.Module, documents: list[list[int]], draws: list[Draw], layer: int, batch_size: int,
                 pad_id: int) -> list[torch.Tensor]:
    """hidden_states[layer] at every draw, in draw order (float32, on the CPU)."""
    by_document: dict[int, list[int]] = {}
    for index, draw in enumerate(draws):
        by_document.setdefault(draw.document, []).append(index)
    vectors: list[torch.Tensor | None] = [None] * len(draws)
    device = next(model.parameters()).device
    order = list(by_document)
    for start in tqdm(range(0, len(order), batch_size), desc="reading activations", unit="batch", disable=None):
        chunk = order[start: start + batch_size]
        longest = max(len(documents[document]) for document in chunk)
        input_ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), longest), dtype=torch.long)
        for row, document in enumerate(chunk):  # right padding: the real tokens keep positions 0..n-1
            ids = documents[document]
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        hidden = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                       output_hidden_states=True).hidden_states[layer]
        for row, document in enumerate(chunk):
            for index in by_document[document]:
                vectors[index] = hidden[row, draws[index].position].float().cpu()
    return vectors


def prompt_messages(cfg: NLAExtractConfig, marker: Marker) -> Messages:
    """The actor's prompt of every row: prompt.messages with the marker written in."""
    return [{"role": message.get("role") or cfg.prompt.default_role,
             "content": message["template"].format(injection_token=marker.character)} for message in cfg.prompt.messages]


def output_paths(output: ExtractOutputConfig, layer: int) -> tuple[Path, Path | None]:
    """The main file and (when enabled) the control file."""
    stem = output.path_prefix.removesuffix(".parquet") + (f"_layer{layer}" if output.include_layer_suffix else "")
    variant = output.random_variant
    control = None
    if variant.enabled:
        control = Path(variant.path) if variant.path is not None else Path(stem + variant.suffix + ".parquet")
    return Path(stem + ".parquet"), control


def control_rows(rows: list[dict[str, Any]], variant: RandomVariantConfig, seed: int) -> list[dict[str, Any]]:
    """`rows` with `variant.columns` (the vector) taken from another row each, its `source_field` recorded in
    `source_column`: a random single-cycle permutation (Sattolo's), so no row keeps its own vector."""
    if len(rows) < 2:
        raise DatasetError("the _random control file needs at least 2 rows to move vectors between; "
                           "extract more rows or set output.random_variant.enabled=false")
    columns = variant.columns or [VECTOR_COLUMN]
    for column in [*columns, variant.source_field]:
        if column not in rows[0]:
            raise ConfigError(f"output.random_variant names column {column!r}, which the rows do not have "
                              f"({', '.join(rows[0])})")
    donors = list(range(len(rows)))
    rng = random.Random(variant.seed if variant.seed is not None else seed)
    for index in range(len(donors) - 1, 0, -1):
        other = rng.randrange(index)
        donors[index], donors[other] = donors[other], donors[index]
    return [{**row, **{column: rows[donor][column] for column in columns},
             variant.source_column: rows[donor][variant.source_field]} for row, donor in zip(rows, donors)]


def summarize(sources: list[str], summarizer: SummarizerConfig, dtype: str, device: torch.device, seed: int) -> list[str]:
    """One summary per source text, written by the summariser model on ember's engine (rollout interface)."""
    from ember.inference.config import EngineConfig
    from ember.models.loading import resolve_dtype
    from ember.rollout.base import SamplingParams
    from ember.rollout.ember_rollout import EmberRollout
    from ember.trainer.rank_setup import stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(summarizer.model_path)
    texts = [render_chat(tokenizer, [{"role": "user", "content": summarizer.prompt.format(source=source)}], True)
             for source in sources]
    prompts = encode_texts(tokenizer, texts)
    longest = max(len(ids) for ids in prompts) + summarizer.max_new_tokens
    config = EngineConfig(max_model_len=longest, max_num_seqs=min(len(prompts), 256),
                          max_num_batched_tokens=max(8192, longest), dtype=resolve_dtype(dtype), device=str(device))
    rollout = EmberRollout.from_pretrained(summarizer.model_path, config)
    sampling = SamplingParams(temperature=summarizer.temperature, do_sample=summarizer.temperature > 0,
                              max_new_tokens=summarizer.max_new_tokens,
                              stop_token_ids=tuple(stop_token_ids(summarizer.model_path, tokenizer)), seed=seed)
    logger.info("summarising %d texts with %s", len(prompts), summarizer.model_path)
    return [tokenizer.decode(output.token_ids, skip_special_tokens=True).strip()
            for output in rollout.generate(prompts, sampling)]


def needs_response(cfg: NLAExtractConfig) -> bool:
    return any(f"{{{name}}}" in cfg.response.template for name in ("processed_response", "response"))


def build_rows(cfg: NLAExtractConfig, rows: list[SourceRow], documents: list[list[int]], draws: list[Draw],
               vectors: list[torch.Tensor], layer: int, marker: Marker, tokenizer: PreTrainedTokenizerBase,
               device: torch.device) -> list[dict[str, Any]]:
    """The output rows of the mode, in draw order."""
    records = []
    for draw, vector in zip(draws, vectors):
        ids = documents[draw.document]
        records.append({VECTOR_COLUMN: vector.tolist(), "sample_uuid": draw.sample_uuid, "activation_layer": layer,
                        "activation_token_id": ids[draw.position],
                        "activation_token": tokenizer.decode([ids[draw.position]]),
                        "source_sequence_token_index": draw.position,
                        "immediate_prefix": tokenizer.decode(ids[: draw.position + 1])})
    if cfg.mode == "eval":
        return [{"source_prompt": rows[draw.document].values[cfg.dataset.text_column],
                 "expected_completions": rows[draw.document].values["expected_completions"],
                 "description": str(rows[draw.document].values.get("description") or "unknown"), **record}
                for draw, record in zip(draws, records)]
    messages = prompt_messages(cfg, marker)
    records = [{"prompt": messages, **record} for record in records]
    if cfg.mode == "rl":
        return records
    sources = [record["immediate_prefix"] for record in records]
    responses = [""] * len(records)
    if needs_response(cfg):
        if cfg.response.summarizer.model_path is not None:
            responses = summarize(sources, cfg.response.summarizer, cfg.model.model_dtype, device, cfg.seed)
        else:
            responses = [_response_column(rows[draw.document]) for draw in draws]
    for record, draw, source, response in zip(records, draws, sources, responses):
        if needs_response(cfg) and not response:
            raise DatasetError(f"{cfg.dataset.input_parquet}, row {rows[draw.document].row}: the summariser wrote an "
                               "empty response; raise response.summarizer.max_new_tokens or use another model")
        record["response"] = cfg.response.template.format(processed_response=response, response=response, source=source)
    return records


def _response_column(row: SourceRow) -> str:
    value = row.values.get("response")
    if value is None:
        raise row.error("response", "response.template needs a response: give the documents a response column, or "
                                    "set response.summarizer.model_path to a model that writes them")
    if not isinstance(value, str) or not value:
        raise row.error("response", f"expected a non-empty string, got {value!r:.120}")
    return value


def run_extract(cfg: NLAExtractConfig) -> int:
    """Read the documents, the model's vectors and write the files; returns the exit status."""
    from ember.distributed.device import current_device, request_device
    from ember.models.loading import load_model

    if cfg.model.name is None:
        raise ConfigError("model.name is not set; point it at the HF model folder (or hub id) whose activations to read")
    num_layers = model_layer_count(cfg.model.name, cfg.model.trust_remote_code)
    layer = resolve_layer_index("model.layer_index", cfg.model.layer_index, num_layers, cfg.model.name)
    main_path, control_path = output_paths(cfg.output, layer)
    for path in (main_path, control_path):
        if path is not None and path.exists() and not cfg.output.overwrite:
            raise ConfigError(f"{path} exists; set output.overwrite=true to replace it, or change output.path_prefix")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    marker = choose_marker(tokenizer, cfg.output.injection_token, key="output.injection_token")
    rows = read_documents(cfg)
    documents = [document_ids(row, cfg, tokenizer) for row in rows]
    draws = plan_draws(documents, cfg)
    request_device(cfg.device)
    device = current_device()
    model = load_model(cfg.model.name, dtype=cfg.model.model_dtype).to(device).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    vectors = read_vectors(model, documents, draws, layer, cfg.sampling.parallel_batch_size or DEFAULT_BATCH_SIZE, pad_id)
    del model
    records = build_rows(cfg, rows, documents, draws, vectors, layer, marker, tokenizer, device)
    files = {main_path: records}
    if control_path is not None:
        files[control_path] = control_rows(records, cfg.output.random_variant, cfg.seed)
    for path in write_parquet_files(files, metadata=marker_metadata(marker)):
        print(f"wrote {len(records)} {cfg.mode} rows (layer {layer}, marker {marker.character!r}) to {path}")
    return 0
