"""A GGUF checkpoint (the PyPI-published releases machines without a model hub use, e.g. SmolLM2-135M-Instruct's)
as a plain Hugging Face folder: dequantised once by transformers' GGUF reader (needs the `gguf` package), saved
as safetensors with its tokenizer, so every later load (the engines, `ember train`) skips the GGUF reader.

transformers parses the file three times (for the config, the tokenizer and the weights) and builds gguf's
tensor-name table once per submodule (about 400 times for SmolLM2-135M): most of a minute on a GPU host's CPU.
Both are cached for the conversion (`_parsed_once`): the file is only read, and the table depends only on the
architecture and the number of layers."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@contextmanager
def _parsed_once() -> Iterator[None]:
    """Within: `gguf.GGUFReader` returns one reader per file and arguments, `gguf.get_tensor_name_map` one table
    per architecture and depth (transformers imports both from `gguf` where it calls them)."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def reader(path, *args, **kwargs):
        key = (os.path.abspath(os.fspath(path)), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader_class(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def save_gguf_as_hf(gguf_file: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write `gguf_file`'s model (in `dtype`) and tokenizer to `out_dir`; returns `out_dir`."""
    if not os.path.isfile(gguf_file):
        raise FileNotFoundError(f"{gguf_file} is not a file: name a GGUF model file (e.g. from fetch-models.sh)")
    folder, name = os.path.split(os.path.abspath(gguf_file))
    with _parsed_once():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.hf_quantizer = None  # the weights are dequantised: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
