"""`ember nla sft` (actor and critic) on a tiny model, and the whole path a user takes: extract → SFT of both →
NLA GRPO from the two SFT folders."""

import json
import random
from pathlib import Path

import pytest
import torch
from fixtures import make_nla_model_dir, nla_rl_row
from transformers import AutoModelForCausalLM

from ember.cli import main
from ember.data.parquet import write_parquet

RUNS = str(Path(__file__).resolve().parents[1] / "nla_configs")
RESPONSES = ["the fox runs", "a cat sleeps here", "numbers add up", "rain falls down today"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_nla_model_dir(tmp_path_factory.mktemp("nla-sft"))


def sft_rows(count, seed):
    """Rows whose vector is fixed by their response (4 kinds), so the critic can learn it from the text."""
    generator = torch.Generator().manual_seed(0)
    kinds = [torch.randn(64, generator=generator).tolist() for _ in RESPONSES]
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        kind = rng.randrange(len(RESPONSES))
        rows.append({**nla_rl_row(kinds[kind], sample_uuid=f"s{seed}-{index}"), "response": RESPONSES[kind]})
    return rows


def sft_overrides(tmp_path, model_dir, train, val, mode, steps=None):
    run = [f"model.partial_pretrain={model_dir}", f"data.train_files={train}", f"data.val_files={val}",
           "trainer.n_gpus_per_node=1", "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path}/{mode}",
           "data.train_batch_size=8", "data.micro_batch_size_per_gpu=4", "data.max_length=128",
           f"nla.train_mode={mode}", "nla.critic.model_path=null", "nla.critic.output_layer_index=1",
           "optim.lr=3e-3", "nla.critic_lr=3e-3", "trainer.test_freq=1", "model.trust_remote_code=false",
           "model.fsdp_config.model_dtype=fp32", "trainer.device=auto"]
    return run + ([f"trainer.total_training_steps={steps}"] if steps else [])


def losses(run_dir, key):
    return [line[key] for line in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines())
            if key in line]


@pytest.mark.parametrize("mode", ["critic", "actor"])
def test_sft_lowers_the_held_out_loss_and_writes_an_hf_folder(tmp_path, model_dir, mode):
    train = write_parquet(sft_rows(32, seed=1), tmp_path / "sft_layer1.parquet")
    val = write_parquet(sft_rows(8, seed=2), tmp_path / "sft_val_layer1.parquet")
    assert main(["nla", "sft", "--config-path", RUNS, "--config-name", "nla_sft_7b_8gpu",
                 *sft_overrides(tmp_path, model_dir, train, val, mode, steps=12)]) == 0
    val_losses = losses(tmp_path / mode, "val/loss")
    assert len(val_losses) == 12 and val_losses[-1] < 0.8 * val_losses[0], val_losses
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / mode / "hf_model")
    assert exported.config.num_hidden_layers == 2


def test_extract_then_sft_both_then_nla_grpo(tmp_path, model_dir):
    documents = write_parquet([{"text": f"{text} and more words follow here", "response": text} for text in RESPONSES * 4],
                              tmp_path / "documents.parquet")
    common = [f"model.name={model_dir}", f"dataset.input_parquet={documents}", "dataset.text_column=text",
              "model.layer_index=1", "device=cpu", "sampling.parallel_batch_size=4"]
    assert main(["nla", "extract", *common, "mode=sft", f"output.path_prefix={tmp_path}/sft"]) == 0
    assert main(["nla", "extract", *common, "mode=rl", f"output.path_prefix={tmp_path}/rl",
                 "output.random_variant.enabled=true"]) == 0
    sft_file, rl_file = tmp_path / "sft_layer1.parquet", tmp_path / "rl_layer1.parquet"
    assert sft_file.is_file() and rl_file.is_file() and (tmp_path / "rl_layer1_random.parquet").is_file()
    for mode in ("actor", "critic"):
        assert main(["nla", "sft", "--config-path", RUNS, "--config-name", "nla_sft_7b_8gpu",
                     *sft_overrides(tmp_path, model_dir, sft_file, sft_file, mode, steps=2)]) == 0
    rl = [f"actor_rollout_ref.model.path={tmp_path}/actor/hf_model", f"critic.model.path={tmp_path}/critic/hf_model",
          "critic.output_layer_index=1", f"data.train_files=[{rl_file}]", "data.val_files=null",
          "trainer.n_gpus_per_node=1", "trainer.logger=[console]", "trainer.rollout_data_dir=null",
          "nla_eval.enabled=false", f"trainer.default_local_dir={tmp_path}/rl_run", "data.train_batch_size=4",
          "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.rollout.n=4",
          "trainer.total_training_steps=2", "data.max_response_length=8", "data.max_prompt_length=64",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]
    assert main(["nla", "train", "--config-path", RUNS, "--config-name", "runs/qwen_7b/rl_grpo", *rl]) == 0
    assert len(losses(tmp_path / "rl_run", "critic/fve")) == 2


def test_disable_checkpointing_writes_no_checkpoint_but_the_hf_folder(tmp_path, model_dir):
    train = write_parquet(sft_rows(16, seed=1), tmp_path / "sft_layer1.parquet")
    assert main(["nla", "sft", "--config-path", RUNS, "--config-name", "nla_sft_7b_8gpu",
                 *sft_overrides(tmp_path, model_dir, train, train, "critic", steps=2),
                 "trainer.disable_checkpointing=true"]) == 0
    assert not list((tmp_path / "critic").glob("global_step_*")) and (tmp_path / "critic" / "hf_model").is_dir()


def test_the_forks_hf_model_save_contents_put_a_transformers_folder_in_each_checkpoint(tmp_path, model_dir):
    train = write_parquet(sft_rows(16, seed=1), tmp_path / "sft_layer1.parquet")
    assert main(["nla", "sft", "--config-path", RUNS, "--config-name", "nla_sft_7b_8gpu",
                 *sft_overrides(tmp_path, model_dir, train, train, "actor", steps=2), "trainer.save_freq=1"]) == 0
    for step in (1, 2):  # the fork's file lists hf_model in trainer.checkpoint.save_contents
        assert (tmp_path / "actor" / f"global_step_{step}" / "actor" / "huggingface" / "config.json").is_file()
