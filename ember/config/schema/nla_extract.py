"""`NLAExtractConfig`, the configuration of `ember nla extract`: activation vectors from text documents.

The keys are those of the NLA fork's extraction files (`defaults: [/nla_activation_dataset,
_self_]`, e.g. its runs/qwen_7b/rl_train.yaml); `nla_activation_dataset` is ember's copy of
their defaults. A base model reads each document; the vector of a row is transformers'
`hidden_states[model.layer_index]` at one token of it. Keys for hub datasets
(`dataset.name`, ...) are accepted, but ember reads local files only (`dataset.input_parquet`,
.parquet or .jsonl). `response.summarizer` is ember's: a local model writing SFT responses.
"""

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ember.config.schema.base import DType, field_, section

ExtractMode = Literal["rl", "sft", "eval"]

DEFAULT_MARKER_TEMPLATE = "Explain the following: <concept>{injection_token}</concept>\n"
DEFAULT_SUMMARY_PROMPT = "Summarize the following text in one or two sentences.\n\n{source}"


@dataclass
class ExtractDatasetConfig:
    """The documents."""

    input_parquet: str | None = field_(None, "the documents: a .parquet or .jsonl file")
    text_column: str | None = field_(None, "column of plain text documents (read as they are)")
    chat_column: str | None = field_(
        None, "column of chat documents (lists of {role, content}), rendered with the model's chat template")
    expect_chat: bool = field_(False, "the documents are chats: chat_column must be set")
    add_generation_prompt: bool = field_(True, "end each rendered chat with the assistant's turn opening")
    system_prompt: str | None = field_(None, "system message put before chats that have none; null = none")
    user_role: str = field_("user", "the fork's; role of the user turn of a chat (chats carry their own roles: no effect)")
    max_samples: int | None = field_(None, "read at most this many documents (after the slice); null = all")
    slice_start: int | None = field_(None, "first document read (0-based); null = 0")
    slice_length: int | None = field_(None, "documents read from slice_start; null = to the end")
    name: str | None = field_(None, "the fork's hub dataset name; ember reads dataset.input_parquet only (must be null)")
    config_name: str | None = field_(None, "the fork's hub dataset configuration; with dataset.name only (no effect)")
    split: str = field_("train", "the fork's hub dataset split; with dataset.name only (no effect)")


@dataclass
class ExtractModelConfig:
    """The base model whose activations are explained."""

    name: str | None = field_(None, "HF model folder or hub id")
    trust_remote_code: bool = field_(False, "allow model and tokenizer code shipped with the checkpoint to run")
    layer_index: int = field_(
        10, "hidden_states index of the vectors (transformers' indexing: 0 = embeddings, L = output of decoder layer L)")
    model_dtype: DType = field_("fp32", "dtype of the forward pass")


@dataclass
class ExtractSamplingConfig:
    """Which tokens give vectors."""

    total_activations: int | None = field_(256, "stop after this many rows; null = every document")
    activations_per_sample: int = field_(1, "tokens drawn per document (uniformly, never its first token unless it has one)")
    max_length: int = field_(1024, "documents are cut to their first this many tokens")
    parallel_batch_size: int | None = field_(1, "documents per forward pass; null = 8")


@dataclass
class RandomVariantConfig:
    """The `_random` control file: the same rows with vectors moved between them."""

    enabled: bool = field_(False, "also write the control file")
    path: str | None = field_(None, "where; null = the main file's path with suffix before .parquet")
    suffix: str = field_("_random", "what marks a control file's name (runs on it are tagged random)")
    seed: int | None = field_(None, "seed of the shuffle; null = seed")
    columns: list[str] | None = field_(None, "columns moved together; null = [activation_vector]")
    source_field: str = field_("sample_uuid", "column naming each row, recorded for the row its vector came from")
    source_column: str = field_("activation_vector_source_uuid", "column recording where each row's vector came from")


@dataclass
class ExtractOutputConfig:
    """Where the rows go."""

    path_prefix: str = field_("data/generated/activation_dataset", "output path without .parquet")
    overwrite: bool = field_(False, "replace files that exist; false = stop instead")
    include_layer_suffix: bool = field_(True, "append _layer{layer_index} to the file name")
    injection_token: str | None = field_(
        None, "the marker character; null = the first rare character the tokenizer keeps as one token")
    random_variant: RandomVariantConfig = section(RandomVariantConfig, "the _random control file")


@dataclass
class ExtractPromptConfig:
    """The actor's prompt stored in each row's `prompt` column."""

    default_role: str = field_("user", "role of messages that name none")
    add_generation_prompt: bool = field_(True, "the fork's; the trainers apply the chat template with it (no effect here)")
    chat_template: str | None = field_(None, "the fork's; the trainers use the actor tokenizer's template (no effect here)")
    messages: list[dict[str, str]] = field_(
        [{"role": "user", "template": DEFAULT_MARKER_TEMPLATE}],
        "the prompt's messages, each {role (default: default_role), template}; {injection_token} is the marker, "
        "written exactly once over all of them")


@dataclass
class SummarizerConfig:
    """ember's: a local model that writes the SFT responses from the source text."""

    model_path: str | None = field_(None, "HF model folder of the summariser; null = the documents' response column")
    prompt: str = field_(DEFAULT_SUMMARY_PROMPT, "the summariser's user turn; {source} is the text up to the vector's token")
    max_new_tokens: int = field_(128, "most tokens per summary")
    temperature: float = field_(0.0, "sampling temperature; 0 = greedy")


@dataclass
class ExtractResponseConfig:
    """The `response` column of SFT rows."""

    template: str = field_(
        "{source}", "response text: {processed_response} (= {response}) is the summariser's output or the "
        "documents' response column, {source} the text up to the vector's token")
    summarizer: SummarizerConfig = section(SummarizerConfig, "ember's summariser model")


@dataclass
class NLAExtractConfig:
    """Everything `ember nla extract` needs."""

    builtin_bases: ClassVar[dict[str, dict[str, Any]]] = {"nla_activation_dataset": {}}
    key_aliases: ClassVar[dict[str, str]] = {}

    mode: ExtractMode = field_("rl", "rows to write: rl (prompt + vector), sft (adds response) or eval (string-match sets)")
    dataset: ExtractDatasetConfig = section(ExtractDatasetConfig, "the documents")
    model: ExtractModelConfig = section(ExtractModelConfig, "the base model")
    sampling: ExtractSamplingConfig = section(ExtractSamplingConfig, "which tokens give vectors")
    output: ExtractOutputConfig = section(ExtractOutputConfig, "where the rows go")
    prompt: ExtractPromptConfig = section(ExtractPromptConfig, "the actor's prompt")
    response: ExtractResponseConfig = section(ExtractResponseConfig, "SFT responses")
    seed: int = field_(42, "seed of the token draws (and of the control file's shuffle)")
    source_indices_file: str | None = field_(None, "the fork's reuse of another file's documents; not supported (must be null)")
    device: Literal["auto", "cuda", "cpu"] = field_("auto", "where the model runs: auto = the accelerator if there is one")
