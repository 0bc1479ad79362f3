"""A model folder the user names is checked before any work (`trainer/model_folder.py`): a damaged or
empty config.json, an unknown model_type, missing or cut-short weights, a pickle carrying code, a missing or
damaged tokenizer, a tokenizer larger than the embedding table and a hub id with no cache and no network
each stop the run with a ConfigError naming the file, not a traceback minutes later."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import huggingface_hub
import pytest
import torch
from fixtures import make_tiny_model_dir, make_tokenizer
from safetensors.torch import load_file

from ember.config import ConfigError, SFTConfig, load_config
from ember.errors import UserError
from ember.trainer.rl_setup import check_model_path
from ember.trainer.sft import check_sft_config

KEY = "actor_rollout_ref.model.path"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("model"))


def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    return copy


def test_a_sound_folder_passes(model_dir):
    check_model_path(KEY, str(model_dir))


@pytest.mark.parametrize("content, said", [("", "is empty"), ('{"model_type": "qwen2",', "not valid JSON"),
                                           ("[1, 2]", "not an object"), ('{"hidden_size": 64}', "no model_type")])
def test_a_damaged_config_json_is_named(model_dir, tmp_path, content, said):
    folder = copy_of(model_dir, tmp_path)
    (folder / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=f"config.json .*{said}"):
        check_model_path(KEY, str(folder))


def test_an_unknown_model_type_says_what_to_do(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, model_type="qwen9")))
    with pytest.raises(ConfigError, match="model_type='qwen9'.*upgrade transformers.*trust_remote_code"):
        check_model_path(KEY, str(folder))


def test_missing_weights_are_named(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    os.remove(folder / "model.safetensors")
    with pytest.raises(ConfigError, match="holds no weights"):
        check_model_path(KEY, str(folder))


def test_cut_short_weights_are_named(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ConfigError, match="model.safetensors is cut short or damaged"):
        check_model_path(KEY, str(folder))


def test_a_missing_shard_of_an_index_is_named(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    names = list(load_file(folder / "model.safetensors"))
    os.remove(folder / "model.safetensors")
    index = {"metadata": {}, "weight_map": {name: "model-00001-of-00002.safetensors" for name in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="model-00001-of-00002.safetensors .*named by .*is missing"):
        check_model_path(KEY, str(folder))


class Payload:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_pytorch_model_bin_carrying_code_is_refused_by_name(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    weights = load_file(folder / "model.safetensors")
    os.remove(folder / "model.safetensors")
    torch.save({**weights, "payload": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(ConfigError, match="pytorch_model.bin holds pickled Python objects"):
        check_model_path(KEY, str(folder))


def test_a_plain_pytorch_model_bin_passes_and_a_cut_one_is_named(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    os.remove(folder / "model.safetensors")
    check_model_path(KEY, str(folder))
    os.truncate(folder / "pytorch_model.bin", (folder / "pytorch_model.bin").stat().st_size // 2)
    with pytest.raises(ConfigError, match="pytorch_model.bin is cut short or damaged"):
        check_model_path(KEY, str(folder))


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    """An empty hub cache and a hub that refuses connections at once."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")

    def unreachable(*args, **kwargs):
        raise ConnectionError("connection refused")

    monkeypatch.setattr(huggingface_hub, "repo_exists", unreachable)


def test_a_hub_id_offline_and_not_cached_is_no_such_folder(no_hub, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="models/qwen: no such folder, and not in the local hub cache.*HF_HUB_OFFLINE"):
        check_model_path(KEY, "models/qwen")
    assert time.monotonic() - start < 5


def test_a_hub_id_with_no_network_is_said_at_once(no_hub):
    with pytest.raises(ConfigError, match="no such folder, and not in the local hub cache.*cannot be reached"):
        check_model_path(KEY, "Qwen/Qwen2.5-0.5B")


def test_a_relative_folder_the_hub_does_not_know_is_no_such_folder(no_hub, monkeypatch, tmp_path):
    """`models/qwen` (one slash, relative, no such folder) reads as a hub id only until the hub says it has none."""
    monkeypatch.setattr(huggingface_hub, "repo_exists", lambda repo_id, *args, **kwargs: False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ConfigError, match=f"^{KEY}=models/qwen: no such folder, .*nor a model on the hub"):
        check_model_path(KEY, "models/qwen")


def test_a_hub_id_in_the_cache_or_on_the_hub_passes(no_hub, monkeypatch):
    snapshot = Path(huggingface_hub.constants.HF_HUB_CACHE) / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    check_model_path(KEY, "Qwen/Qwen2.5-0.5B")  # cached: the hub (unreachable here) is not asked
    monkeypatch.setattr(huggingface_hub, "repo_exists", lambda repo_id, *args, **kwargs: repo_id == "Qwen/Qwen3-8B")
    check_model_path(KEY, "Qwen/Qwen3-8B")


# --- the tokenizer, checked with the run's other inputs (here `ember sft`'s) ------------------------------


def sft_config(tmp_path: Path, model: Path, *extra: str) -> SFTConfig:
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")  # only its existence is checked here
    return load_config([f"model.partial_pretrain={model}", f"data.train_files={data}",
                        f"trainer.default_local_dir={tmp_path / 'run'}", *extra], schema=SFTConfig)


def test_a_sound_run_passes(model_dir, tmp_path):
    check_sft_config(sft_config(tmp_path, model_dir))


def test_a_folder_without_a_tokenizer_is_named(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(folder / name)
    with pytest.raises(UserError, match="model.partial_pretrain=.* holds no tokenizer"):
        check_sft_config(sft_config(tmp_path, folder))


def test_a_damaged_tokenizer_is_named(model_dir, tmp_path):
    folder = copy_of(model_dir, tmp_path)
    (folder / "tokenizer.json").write_text((folder / "tokenizer.json").read_text()[:500])
    with pytest.raises(UserError, match="tokenizer.json is not valid JSON"):
        check_sft_config(sft_config(tmp_path, folder))


def test_a_tokenizer_beyond_the_embedding_table_is_refused(model_dir, tmp_path):
    tokenizer = make_tokenizer()
    folder = copy_of(model_dir, tmp_path)  # its own tokenizer, the embedding of a smaller one
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, vocab_size=len(tokenizer) - 10)))
    with pytest.raises(UserError, match=f"ids up to {len(tokenizer) - 1} .*has {len(tokenizer) - 10} rows"):
        check_sft_config(sft_config(tmp_path, folder))
