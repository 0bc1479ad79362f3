"""Loading Hugging Face checkpoints as the models ember trains: causal LMs and value models.

A causal LM loads as `AutoModelForCausalLM`; a value model (critic) loads as
`AutoModelForTokenClassification` with one label, from either a causal-LM checkpoint (the
backbone is reused and the scalar head starts fresh) or a saved value model. Both can also
be built empty on the meta device with the same architecture, which the FSDP engine uses
on every rank but the first so that only one process reads the weights from disk.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedModel,
)

from ember.models.reconstructor import truncated_config
from ember.models.value_model import value_model_config

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config string such as "bfloat16" or "fp32"."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _auto_class(value_head: bool):
    return AutoModelForTokenClassification if value_head else AutoModelForCausalLM


def load_model_config(path: str, *, value_head: bool = False, keep_layers: int | None = None,
                      overrides: dict[str, Any] | None = None, trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's config; for a value model, turned into a one-label token classifier's; with
    `keep_layers`, cut after that many decoder layers (NLA's reconstructor, `models/reconstructor.py`);
    `overrides` (`model.override_config`) replace fields of it, each a field the config has."""
    config = truncated_config(AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code), keep_layers)
    for key, value in (overrides or {}).items():
        if not hasattr(config, key):
            raise ValueError(f"model.override_config.{key}: the model's config ({type(config).__name__}) has no "
                             f"field {key!r}; override a field it has (e.g. attention_dropout, output_router_logits)")
        setattr(config, key, value)
    return value_model_config(config) if value_head else config


def load_model(path: str, *, value_head: bool = False, dtype: str = "float32", attn_implementation: str = "sdpa",
               keep_layers: int | None = None, overrides: dict[str, Any] | None = None,
               trust_remote_code: bool = False) -> PreTrainedModel:
    """Read the checkpoint at `path` onto the CPU, its parameters in `dtype` (only the first `keep_layers`
    decoder layers when given; `overrides` as `load_model_config`; `trust_remote_code`: the model's own code
    may run, as transformers means it)."""
    config = load_model_config(path, value_head=value_head, keep_layers=keep_layers, overrides=overrides,
                               trust_remote_code=trust_remote_code)
    return _auto_class(value_head).from_pretrained(path, config=config, dtype=resolve_dtype(dtype),
                                                   attn_implementation=attn_implementation,
                                                   trust_remote_code=trust_remote_code)


def build_model_on_meta(config: PretrainedConfig, *, value_head: bool = False, dtype: str = "float32",
                        attn_implementation: str = "sdpa", trust_remote_code: bool = False) -> PreTrainedModel:
    """The architecture of `config` with parameters on the meta device (no memory, no values).

    `config` is copied: transformers sets the attention implementation on the config it is
    given, which would change a live model's (e.g. an engine's "ember_varlen") under it.
    """
    with torch.device("meta"):
        return _auto_class(value_head).from_config(copy.deepcopy(config), dtype=resolve_dtype(dtype),
                                                   attn_implementation=attn_implementation,
                                                   trust_remote_code=trust_remote_code)
