"""What a run checks in a model path before any work: a Hugging Face model folder whose
config, weights and tokenizer load, or a hub id that is in the local cache or can be fetched.

Each problem stops the run as a `ConfigError` naming the key, the file and what to do, where
transformers would otherwise fail minutes later with a traceback (or, for a tokenizer
larger than the model's embedding table, with a device-side assert on a GPU). The checks
read only headers and JSON: safetensors shards are opened lazily, `pytorch_model.bin` is
mapped with `weights_only=True` (a pickle that carries code is refused here by name).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import zipfile

import huggingface_hub
import torch
from huggingface_hub.errors import RepositoryNotFoundError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from ember.config import ConfigError

HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "Qwen/Qwen2.5-0.5B": fetched by transformers, not a local path
MODEL_CONFIG_FILE = "config.json"  # what transformers reads first from a model folder (architecture, sizes)
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # sharded weights
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # one file of weights
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                        "vocab.json")
REDOWNLOAD = "download the model again (or copy the file from its release)"


def check_model_path(key: str, path: str, *, tokenizer_only: bool = False, trust_remote_code: bool = False) -> None:
    """A model path must be a Hugging Face model folder whose config and weights load (config.json,
    complete weight files), or a hub id found in the local hub cache or on the hub; a tokenizer path
    (`tokenizer_only`) any existing folder or such a hub id."""
    if os.path.isdir(path):
        if not tokenizer_only:
            check_model_folder(key, path, trust_remote_code)
        return
    if os.path.exists(path):
        raise ConfigError(f"{key}={path} is a file, not a folder; point it at a Hugging Face model folder "
                          f"(the one holding {MODEL_CONFIG_FILE}, the weights and the tokenizer)")
    if HUB_ID.fullmatch(path) and not path.startswith("."):
        check_hub_model(key, path)
        return
    raise ConfigError(f"{key}={path} does not exist; point it at a Hugging Face model folder (or a hub id)")


def check_hub_model(key: str, repo_id: str) -> None:
    """A path that is no folder but reads as a hub id must be in the local hub cache, or be fetchable:
    asked once, without transformers' minute of retries when there is no network."""
    if any(isinstance(huggingface_hub.try_to_load_from_cache(repo_id, name), str)
           for name in (MODEL_CONFIG_FILE, "tokenizer_config.json")):
        return
    absent = f"{key}={repo_id}: no such folder, and not in the local hub cache ({huggingface_hub.constants.HF_HUB_CACHE})"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{absent}, and HF_HUB_OFFLINE is set, so nothing is downloaded; point it at a model "
                          f"folder, or download it first (`hf download {repo_id}`)")
    try:
        exists = huggingface_hub.repo_exists(repo_id)
    except Exception as error:  # whatever keeps the hub from answering: DNS, a proxy, a firewall, TLS
        raise ConfigError(f"{absent}, and the hub ({huggingface_hub.constants.ENDPOINT}) cannot be reached "
                          f"({type(error).__name__}: {error}); point it at a model folder, or download it where "
                          f"there is network (`hf download {repo_id}`) and set HF_HUB_OFFLINE=1") from None
    if not exists:
        raise ConfigError(f"{absent}, nor a model on the hub; point it at a Hugging Face model folder or hub id")


def check_model_folder(key: str, path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """The folder's config, read as transformers reads it, once its weight files were found complete."""
    config_file = os.path.join(path, MODEL_CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise ConfigError(f"{key}={path} holds no {MODEL_CONFIG_FILE}, so it is not a Hugging Face model folder; "
                          f"point it at the folder with the model's {MODEL_CONFIG_FILE} and weights")
    fields = read_json_object(key, config_file)
    if "model_type" not in fields:
        raise ConfigError(f"{key}={path}: {config_file} has no model_type, so transformers cannot tell the "
                          f"architecture; {REDOWNLOAD}")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as error:  # a model_type this transformers does not know, or code it may not run
        raise ConfigError(f"{key}={path}: {config_file} has model_type={fields['model_type']!r}, which transformers "
                          f"{transformers_version()} cannot build ({first_line(error)}); upgrade transformers, or set "
                          f"{key.rsplit('.', 1)[0]}.trust_remote_code=true if the model ships its own code and you "
                          "trust it") from None
    check_weight_files(key, path)
    return config


def check_weight_files(key: str, path: str) -> None:
    """The folder's weights exist and are complete: a single file, or every shard its index names."""
    for index in WEIGHT_INDEXES:
        index_file = os.path.join(path, index)
        if os.path.isfile(index_file):
            weight_map = read_json_object(key, index_file).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConfigError(f"{key}={path}: {index_file} has no weight_map; {REDOWNLOAD}")
            for shard in sorted(set(weight_map.values())):
                check_weight_file(key, os.path.join(path, str(shard)), f"named by {index}")
            return
    for name in WEIGHT_FILES:
        if os.path.isfile(os.path.join(path, name)):
            check_weight_file(key, os.path.join(path, name), "")
            return
    raise ConfigError(f"{key}={path} holds no weights ({', '.join(WEIGHT_FILES + WEIGHT_INDEXES)}); the download "
                      f"or copy is incomplete: {REDOWNLOAD}")


def check_weight_file(key: str, file: str, named_by: str) -> None:
    """One weight file opens: a safetensors header that covers the file, or a torch zip archive whose
    pickle holds only tensors (loaded mapped, as `weights_only=True` allows)."""
    where = f"{key}: {file}{f' ({named_by})' if named_by else ''}"
    if not os.path.isfile(file):
        raise ConfigError(f"{where} is missing; {REDOWNLOAD}")
    if file.endswith(".safetensors"):
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError as error:
            raise ConfigError(f"{where} is cut short or damaged ({error}); {REDOWNLOAD}") from None
        return
    try:
        torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except pickle.UnpicklingError as error:
        raise ConfigError(f"{where} holds pickled Python objects beyond tensors, which are not loaded since "
                          f"unpickling runs code from the file ({first_line(error)}); use the model's safetensors "
                          "weights, or convert this file where you trust its source") from None
    except (RuntimeError, OSError, EOFError, ValueError, zipfile.BadZipFile) as error:
        raise ConfigError(f"{where} is cut short or damaged ({first_line(error)}); {REDOWNLOAD}") from None


def check_tokenizer(key: str, path: str, vocab_size: int | None, model_key: str,
                    trust_remote_code: bool = False) -> None:
    """The tokenizer of a local folder loads, holds a vocabulary file, and has no id beyond the model's
    embedding table (`vocab_size` rows; None: not checked)."""
    if not os.path.isdir(path):
        return
    for name in TOKENIZER_JSON_FILES:
        if os.path.isfile(os.path.join(path, name)):
            read_json_object(key, os.path.join(path, name))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # the tokenizers library raises bare Exceptions for files it cannot parse
        raise ConfigError(f"{key}={path}: the tokenizer does not load ({type(error).__name__}: {first_line(error)}); "
                          f"{REDOWNLOAD}") from None
    files = sorted(set(getattr(tokenizer, "vocab_files_names", {}).values()))
    if files and not any(os.path.isfile(os.path.join(path, name)) for name in files):
        raise ConfigError(f"{key}={path} holds no tokenizer (none of {', '.join(files)}); copy the model's "
                          "tokenizer files into it, or set the tokenizer's key to a folder that has them")
    size = max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)
    if vocab_size is not None and size > vocab_size:
        raise ConfigError(f"{key}={path}: the tokenizer has ids up to {size - 1} but the model's embedding table "
                          f"({model_key}, {MODEL_CONFIG_FILE} vocab_size) has {vocab_size} rows, so those tokens "
                          "cannot be embedded (a device-side assert on a GPU); use the model's own tokenizer, or a "
                          "model whose vocab_size covers this one")


def model_vocab_size(path: str, trust_remote_code: bool = False) -> int | None:
    """The rows of the embedding table of the model folder at `path` (None for a hub id)."""
    if not os.path.isdir(path):
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return getattr(config.get_text_config(), "vocab_size", None)


def read_json_object(key: str, file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as handle:
            value = json.load(handle)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        state = "empty" if os.path.getsize(file) == 0 else f"not valid JSON ({error})"
        raise ConfigError(f"{key}: {file} is {state}; {REDOWNLOAD}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: {file} holds a JSON {type(value).__name__}, not an object; {REDOWNLOAD}")
    return value


def first_line(error: BaseException) -> str:
    return str(error).strip().split("\n", 1)[0]


def transformers_version() -> str:
    import transformers

    return transformers.__version__
