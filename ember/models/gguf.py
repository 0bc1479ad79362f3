"""A GGUF checkpoint (the PyPI-published releases machines without a model hub use, e.g. SmolLM2-135M-Instruct's)
as a plain Hugging Face folder: dequantised once by transformers' GGUF reader (needs the `gguf` package), saved
as safetensors with its tokenizer, so every later load (the engines, `ember train`) skips the GGUF reader."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def save_gguf_as_hf(gguf_file: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write `gguf_file`'s model (in `dtype`) and tokenizer to `out_dir`; returns `out_dir`."""
    if not os.path.isfile(gguf_file):
        raise FileNotFoundError(f"{gguf_file} is not a file: name a GGUF model file (e.g. from fetch-models.sh)")
    folder, name = os.path.split(os.path.abspath(gguf_file))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.hf_quantizer = None  # the weights are dequantised: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
