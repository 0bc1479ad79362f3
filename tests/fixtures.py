"""Test helpers shared by every tier: the tiny tokenizer (trained once per session) and tiny model folders.

Plain functions, so that tests and conftest fixtures can both call them; pytest puts
`tests/` on the import path (tests/conftest.py lives there), so `from fixtures import ...`
works from any test file.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ember.models.tiny import build_tiny_model, train_tiny_tokenizer


@functools.cache
def tiny_tokenizer_dir() -> Path:
    """A folder holding the tiny tokenizer, trained on first use and removed when the session ends."""
    directory = Path(tempfile.mkdtemp(prefix="ember-tiny-tokenizer-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    train_tiny_tokenizer().save_pretrained(directory)
    return directory


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh copy of the session's tiny tokenizer; a test may change it without touching others."""
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir())


def make_tiny_model_dir(tmp_path: Path, arch: str = "qwen2", seed: int = 0, **overrides: Any) -> Path:
    """A Hugging Face folder (model, tokenizer, generation config) of a tiny `arch` model under `tmp_path`."""
    directory = Path(tmp_path) / f"tiny-{arch}"
    build_tiny_model(arch, make_tokenizer(), out_dir=directory, seed=seed, **overrides)
    return directory


# The tiny tokenizer splits the fork's circled ideographs into bytes; trained on these it keeps 囍 (the
# 26th marker candidate) as one token, so NLA tests see ember skip the 25 candidates before it.
NLA_MARKER = "囍"


@functools.cache
def nla_tokenizer_dir() -> Path:
    """A folder holding a tiny tokenizer that keeps NLA_MARKER as one token (trained once per session)."""
    directory = Path(tempfile.mkdtemp(prefix="ember-nla-tokenizer-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    train_tiny_tokenizer(texts=[NLA_MARKER] * 200).save_pretrained(directory)
    return directory


def make_nla_tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(nla_tokenizer_dir())


def make_nla_model_dir(tmp_path: Path, arch: str = "qwen2", seed: int = 0, **overrides: Any) -> Path:
    """A tiny `arch` model folder (hidden size 64, 2 layers) whose tokenizer has an NLA marker."""
    directory = Path(tmp_path) / f"nla-{arch}"
    build_tiny_model(arch, make_nla_tokenizer(), out_dir=directory, seed=seed, **overrides)
    return directory


def nla_rl_row(vector: list[float], content: str = f"Explain the following: <concept>{NLA_MARKER}</concept>\n",
               **columns: Any) -> dict[str, Any]:
    """One row of an NLA RL parquet in the fork's form, with `columns` added or replaced."""
    row = {"prompt": [{"role": "user", "content": content}], "activation_vector": vector, "sample_uuid": "u0",
           "activation_layer": 1, "activation_token_id": 7, "source_sequence_token_index": 3,
           "immediate_prefix": "The quick"}
    return {**row, **columns}


def rl_row(question: str, ground_truth: str, data_source: str = "test/arithmetic", **columns: Any) -> dict[str, Any]:
    """One row of an RL parquet in verl's format, with `columns` added or replaced."""
    row = {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": "train", "index": 0},
    }
    return {**row, **columns}


PARQUET_CORRUPTIONS = ("empty", "truncated", "not_parquet", "corrupt_page")


def corrupt_parquet(path: Path, corruption: str) -> Path:
    """Damage the parquet file at `path` in place, as one of PARQUET_CORRUPTIONS: a 0-byte file, its
    first half, CSV text under the parquet name, or 32 bytes flipped in the middle of its largest
    column chunk (a page pyarrow then cannot decode; write enough varied rows that the chunk is
    compressed). Returns `path`."""
    data = bytearray(path.read_bytes())
    if corruption == "empty":
        data = bytearray()
    elif corruption == "truncated":
        data = data[: len(data) // 2]
    elif corruption == "not_parquet":
        data = bytearray(b"question,answer\nwhat is 1+1?,2\n")
    elif corruption == "corrupt_page":
        import pyarrow.parquet as pq

        row_group = pq.read_metadata(path).row_group(0)
        chunk = max((row_group.column(i) for i in range(row_group.num_columns)),
                    key=lambda column: column.total_compressed_size)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        middle = start + chunk.total_compressed_size // 2
        for offset in range(middle, middle + 32):
            data[offset] ^= 0xFF
    else:
        raise ValueError(f"unknown corruption {corruption!r}; one of {PARQUET_CORRUPTIONS}")
    path.write_bytes(bytes(data))
    return path
