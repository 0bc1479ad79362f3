"""`ember sft` end to end on a tiny model: the loss against transformers, learning and the
exported model, both config dialects, data errors through the command, a diverged loss kept out
of checkpoints, exact resume after SIGTERM and SIGKILL, and two torchrun ranks against one process."""

import os
from pathlib import Path
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from fixtures import PARQUET_CORRUPTIONS, corrupt_parquet, make_tiny_model_dir
from safetensors.torch import load_file
from two_ranks import run_two_ranks, worker_environment
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember.cli import main
from ember.config import ConfigError, SFTConfig, load_config
from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_rows, sft_row_from_rl_row
from ember.data.sft_dataset import SFTDataset, SFTExample, collate_sft
from ember.distributed.device import init_distributed
from ember.engines.fsdp.engine import EngineOptions, FSDPEngine
from ember.engines.optim import OptimOptions
from ember.trainer.checkpoint import list_checkpoints
from ember.trainer.loggers import read_jsonl_metrics
from ember.trainer.sft import check_sft_config, pad_to_multiple, rank_share
from ember.trainer.sft import main as sft_main
from ember.trainer.sft_step import sft_eval_sums, sft_update


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as in the subprocess runs: on a small shared CPU more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny model, 16 arithmetic conversations to train on and 5 to validate on."""
    root = tmp_path_factory.mktemp("sft")
    rows = [sft_row_from_rl_row(row) for row in make_arithmetic_rows("add2", 21, seed=0)]
    return {"model": str(make_tiny_model_dir(root)), "root": root,
            "train": str(write_parquet(rows[:16], root / "train.parquet")),
            "val": str(write_parquet(rows[16:], root / "val.parquet")), "rows": rows[:16]}


def run_args(workspace, run_dir, *extra):
    return ["data.multiturn.enable=true", f"data.train_files={workspace['train']}", f"data.val_files={workspace['val']}",
            "data.max_length=64", f"model.partial_pretrain={workspace['model']}", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[console]", *extra]


def train_losses(run_dir):
    return [record["train/loss"] for record in read_jsonl_metrics(os.path.join(run_dir, "metrics.jsonl"))]


def weights(run_dir):
    return load_file(os.path.join(run_dir, "hf_model", "model.safetensors"))


# --- the loss --------------------------------------------------------------------------------------


def _hf_loss(model, examples, pad_token_id):
    inputs = collate_sft(examples, pad_token_id)
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     labels=inputs["labels"]).loss.item()


def test_loss_is_the_transformers_token_mean_loss(workspace, tmp_path):
    answers = ["4", "It is 12 + 30 = 42, so the answer is 42.", "7", "The sum of 5 and 6 is 11.", "Yes"]
    path = write_parquet([{"question": f"Question {i}?", "answer": answer} for i, answer in enumerate(answers)],
                         tmp_path / "qa.parquet")
    tokenizer = AutoTokenizer.from_pretrained(workspace["model"])
    examples = SFTDataset(path, tokenizer, max_length=64, prompt_key="question", response_key="answer").examples
    reference_model = AutoModelForCausalLM.from_pretrained(workspace["model"], dtype=torch.float32)
    expected = _hf_loss(reference_model, examples, tokenizer.pad_token_id)
    # micro-batches of 2, 2 and 1 with different target counts: a mean of their means is another number
    mean_of_means = sum(_hf_loss(reference_model, examples[start:start + 2], tokenizer.pad_token_id)
                        for start in (0, 2, 4)) / 3
    assert abs(mean_of_means - expected) > 1e-2

    engine = FSDPEngine(EngineOptions(model_path=workspace["model"], param_dtype="float32",
                                      optim=OptimOptions(lr=1e-3, weight_decay=0.0)))
    nll, tokens = sft_eval_sums(engine, examples, tokenizer.pad_token_id, micro_batch_size=2)
    assert tokens == sum(sum(example.loss_mask) for example in examples)
    assert nll / tokens == pytest.approx(expected, abs=1e-5)
    update = sft_update(engine, examples, tokenizer.pad_token_id, micro_batch_size=2)
    assert update["loss"] == pytest.approx(expected, abs=1e-5)


def test_ranks_take_contiguous_blocks_and_evaluation_pads_without_targets():
    examples = [SFTExample([i, i + 1], [0, 1]) for i in range(5)]
    assert rank_share(examples[:4], 1, 2) == examples[2:4]
    padded = pad_to_multiple(examples, 4)
    assert len(padded) == 8 and padded[:5] == examples
    assert all(sum(example.loss_mask) == 0 for example in padded[5:])


# --- whole runs in this process --------------------------------------------------------------------


def test_a_diverged_loss_keeps_its_weights_out_of_checkpoints(workspace, tmp_path, monkeypatch, capsys):
    def update_with_a_planted_loss(engine, examples, *args):
        update = sft_update(engine, examples, *args)
        steps["count"] += 1
        return {**update, "loss": 3e9} if steps["count"] >= 2 else update

    steps = {"count": 0}
    monkeypatch.setattr("ember.trainer.sft.sft_update", update_with_a_planted_loss)
    run_dir = tmp_path / "run"
    status = main(["sft", *run_args(workspace, run_dir, "data.train_batch_size=4", "data.micro_batch_size_per_gpu=4",
                                    "trainer.total_training_steps=8", "trainer.save_freq=1")])
    assert status == 2  # a clean stop: the message, no traceback
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(r"^error: 3 updates in a row were bad \(last at step 4: train/loss=3e\+09 above "
                    r"trainer.max_loss_or_grad_norm=1e\+08\); the last sound checkpoint is "
                    + re.escape(str(run_dir / "global_step_1")), err, re.MULTILINE)
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [1]


def test_a_run_that_ends_on_diverged_weights_exports_no_final_model(workspace, tmp_path, monkeypatch, caplog):
    def update_diverging_at_the_last_step(engine, examples, *args):
        update = sft_update(engine, examples, *args)
        steps["count"] += 1
        return {**update, "loss": 3e9} if steps["count"] == 3 else update

    steps = {"count": 0}
    monkeypatch.setattr("ember.trainer.sft.sft_update", update_diverging_at_the_last_step)
    run_dir = tmp_path / "run"
    assert main(["sft", *run_args(workspace, run_dir, "data.train_batch_size=4", "data.micro_batch_size_per_gpu=4",
                                  "trainer.total_training_steps=3", "trainer.save_freq=1")]) == 0
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [1, 2]
    assert not (run_dir / "hf_model").exists()
    assert any(record.message.startswith(f"final model not exported to {run_dir / 'hf_model'}: the weights are unsound "
                                         "since step 3: train/loss=3e+09")
               and f"the last sound checkpoint is {run_dir / 'global_step_2'}" in record.message
               for record in caplog.records)


def test_a_stop_requested_during_the_last_step_still_finishes_the_run(workspace, tmp_path, monkeypatch):
    def update_then_receive_sigterm(engine, examples, *args):
        steps["count"] += 1
        if steps["count"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled: only sets the stop request
        return sft_update(engine, examples, *args)

    steps = {"count": 0}
    monkeypatch.setattr("ember.trainer.sft.sft_update", update_then_receive_sigterm)
    run_dir = tmp_path / "run"
    assert main(["sft", *run_args(workspace, run_dir, "data.train_batch_size=4", "data.micro_batch_size_per_gpu=4",
                                  "trainer.total_training_steps=2")]) == 0
    assert (run_dir / "hf_model" / "model.safetensors").is_file()  # the run finished: its final model is there
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [2]


def test_verls_train_max_samples_cuts_the_sft_rows(workspace, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level("INFO"):
        assert main(["sft", *run_args(workspace, run_dir, "data.train_batch_size=4", "data.micro_batch_size_per_gpu=4",
                                      "data.train_max_samples=8", "trainer.total_training_steps=1")]) == 0
    assert any(record.getMessage().startswith("using the first 8 of the ") for record in caplog.records)
    assert read_jsonl_metrics(str(run_dir / "metrics.jsonl"))[0]["train/epoch"] == pytest.approx(1 / 2)  # 2 steps an epoch


@pytest.mark.slow
def test_tiny_model_learns_and_the_exported_model_answers(workspace, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["sft", *run_args(workspace, run_dir, "data.train_batch_size=16", "data.micro_batch_size_per_gpu=16",
                                  "optim.lr=1e-2", "optim.warmup_steps_ratio=0.15", "trainer.total_training_steps=100",
                                  "trainer.test_freq=50")]) == 0
    records = read_jsonl_metrics(str(run_dir / "metrics.jsonl"))
    assert [record["step"] for record in records] == list(range(1, 101))
    assert records[0]["train/loss"] > 5.0 and records[-1]["train/loss"] < 0.05
    assert [record["step"] for record in records if "val/loss" in record] == [50, 100]
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/epoch"} <= records[-1].keys()
    assert records[0]["train/lr"] == 0.0 and records[15]["train/lr"] == pytest.approx(1e-2)  # warmup of 15 steps
    assert records[-1]["train/lr"] < records[50]["train/lr"] < records[20]["train/lr"]  # then cosine decay
    assert (run_dir / "curves.png").is_file() and (run_dir / "config.yaml").is_file()
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [100]

    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf_model"))
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "hf_model"))
    reproduced = 0
    for row in workspace["rows"]:
        prompt = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        output = model.generate(**prompt, max_new_tokens=24, do_sample=False)
        reply = tokenizer.decode(output[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
        reproduced += reply == row["messages"][1]["content"]
    assert reproduced >= 12, f"only {reproduced} of 16 trained answers reproduced"


def test_a_run_folder_keeps_another_runs_work(workspace, tmp_path, capsys):
    run_dir = tmp_path / "run"
    common = ["data.train_batch_size=8", "data.micro_batch_size_per_gpu=8", "trainer.total_training_steps=2",
              "trainer.save_freq=1"]
    assert main(["sft", *run_args(workspace, run_dir, *common)]) == 0
    before = {path: path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}
    capsys.readouterr()

    # a fresh run into it (issue 30): refused before its config.yaml or metrics.jsonl is rewritten
    assert main(["sft", *run_args(workspace, run_dir, *common, "trainer.resume_mode=disable")]) == 2
    error = capsys.readouterr().err
    assert f"trainer.default_local_dir={run_dir} holds the checkpoints" in error
    assert "trainer.overwrite_default_local_dir=true" in error
    # a resume with another architecture: refused by name, nothing rewritten
    llama = make_tiny_model_dir(tmp_path, "llama")
    assert main(["sft", *run_args(workspace, run_dir, *common, f"model.partial_pretrain={llama}")]) == 2
    error = capsys.readouterr().err
    assert f"{run_dir} holds a run of another model" in error and "LlamaForCausalLM" in error, error
    assert {path: path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()} == before

    assert main(["sft", *run_args(workspace, run_dir, *common, "trainer.resume_mode=disable",
                                  "trainer.max_ckpt_to_keep=1", "trainer.overwrite_default_local_dir=true")]) == 0
    assert [step for step, _ in list_checkpoints(str(run_dir))] == [2]
    assert [record["step"] for record in read_jsonl_metrics(str(run_dir / "metrics.jsonl"))] == [1, 2]


def test_megatron_style_dialect_runs_the_same_as_verl_keys(workspace, tmp_path):
    common = ["data.train_batch_size=8", "optim.lr=1e-2", "trainer.total_training_steps=3"]
    verl = run_args(workspace, tmp_path / "verl", *common, "data.micro_batch_size_per_gpu=2")
    megatron = run_args(workspace, tmp_path / "megatron", *common, "training.micro_batch_size_per_gpu=2",
                        "training.gradient_accumulation_steps=4", "data.sequence_length=64")
    assert main(["sft", *verl]) == 0 and main(["sft", *megatron]) == 0
    assert train_losses(tmp_path / "verl") == pytest.approx(train_losses(tmp_path / "megatron"), abs=1e-6)
    assert len(train_losses(tmp_path / "verl")) == 3


VERL_SFT_ENGINE = str(Path(__file__).resolve().parents[1] / "verl_sft_engine_configs")


def test_verls_newer_sft_file_runs_the_same_as_embers_keys(workspace, tmp_path):
    """verl's sft_trainer_engine.yaml (its groups at the top level) trains as ember's own keys of the same values."""
    common = ["data.train_batch_size=8", "data.max_length=64", "trainer.total_training_steps=2",
              "trainer.logger=[console]", "trainer.device=auto", f"data.train_files={workspace['train']}"]
    verl = ["sft", "--config-path", VERL_SFT_ENGINE, "--config-name", "sft_trainer_engine", *common,
            f"model.path={workspace['model']}", "optim.lr=1e-2", "engine.model_dtype=fp32",
            f"trainer.default_local_dir={tmp_path / 'verl'}"]
    ember = ["sft", *common, f"model.partial_pretrain={workspace['model']}", "optim.lr=1e-2", "optim.betas=[0.9,0.999]",
             "optim.warmup_steps_ratio=0", "optim.lr_scheduler=constant", "use_remove_padding=true",
             "data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=8192", "trainer.seed=1",
             f"trainer.default_local_dir={tmp_path / 'ember'}"]
    assert main(verl) == 0 and main(ember) == 0
    assert train_losses(tmp_path / "verl") == pytest.approx(train_losses(tmp_path / "ember"), abs=1e-6)
    assert len(train_losses(tmp_path / "verl")) == 2


def _conversation(*messages):
    return {"messages": [{"role": role, "content": content} for role, content in messages]}


MALFORMED = {
    "message_without_content": ([_conversation(("user", "hi"), ("assistant", "yo")),
                                 {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}],
                                ["data.multiturn.enable=true"], "row 1, column 'messages'"),
    "no_assistant_turn": ([_conversation(("user", "hi"))], ["data.multiturn.enable=true"],
                          "row 0, column 'messages': no assistant message"),
    "response_not_text": ([{"question": "2+2?", "answer": 4}], [], "row 0, column 'answer'"),
    "response_column_missing": ([{"question": "2+2?", "reply": "4"}], [], "cannot tell the SFT data form"),
    "too_long": ([{"question": "2+2?", "answer": "4 " * 80}], ["data.max_length=32"],
                 "row 0, column 'answer': sequence has"),
    "labels_not_input_ids": ([{"input_ids": [5, 6, 7], "labels": [-100, 6, 9]}], [], "row 0, column 'labels'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_data_exits_2_naming_file_row_and_column(case, workspace, tmp_path, capsys):
    rows, overrides, expected = MALFORMED[case]
    path = write_parquet(rows, tmp_path / f"{case}.parquet")
    status = main(["sft", f"data.train_files={path}", f"model.partial_pretrain={workspace['model']}",
                   f"trainer.default_local_dir={tmp_path / 'run'}", "data.train_batch_size=1",
                   "data.micro_batch_size_per_gpu=1", *overrides])
    error = capsys.readouterr().err
    assert status == 2
    assert error.startswith("error: ") and str(path) in error and expected in error


def test_malformed_validation_file_is_named_too(workspace, tmp_path, capsys):
    bad = write_parquet([_conversation(("user", "hi"))], tmp_path / "bad_val.parquet")
    status = main(["sft", *run_args(workspace, tmp_path / "run", "data.train_batch_size=4", f"data.val_files={bad}")])
    assert status == 2 and f"{bad}, row 0, column 'messages'" in capsys.readouterr().err


def test_missing_model_or_data_file_is_a_config_error(workspace, tmp_path, capsys):
    assert main(["sft", f"data.train_files={workspace['train']}", f"trainer.default_local_dir={tmp_path}"]) == 2
    assert "model.partial_pretrain is not set" in capsys.readouterr().err
    assert main(["sft", *run_args(workspace, tmp_path, f"data.val_files=[{workspace['val']},{tmp_path}/nope.parquet]")]) == 2
    assert f"data.val_files: file not found: {tmp_path}/nope.parquet" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["model_folder_without_config", "model_path_is_a_file", "output_folder_under_a_file"])
def test_unusable_model_or_output_path_exits_2_naming_the_key(case, workspace, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    overrides, expected = {
        "model_folder_without_config": ([f"model.partial_pretrain={tmp_path}/empty"],
                                        f"model.partial_pretrain={tmp_path}/empty holds no config.json"),
        "model_path_is_a_file": ([f"model.partial_pretrain={workspace['train']}"],
                                 f"model.partial_pretrain={workspace['train']} is a file, not a folder"),
        "output_folder_under_a_file": ([f"trainer.default_local_dir={workspace['train']}/run"],
                                       f"trainer.default_local_dir={workspace['train']}/run cannot be created"),
    }[case]
    assert main(["sft", *run_args(workspace, tmp_path / "run", *overrides)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and expected in error and "Traceback" not in error


def test_the_torchrun_entry_point_exits_2_the_same_way(workspace, tmp_path, capsys):
    assert sft_main(run_args(workspace, tmp_path / "run", f"model.partial_pretrain={tmp_path}")) == 2
    assert capsys.readouterr().err.startswith(f"error: model.partial_pretrain={tmp_path} holds no config.json")


@pytest.mark.parametrize("corruption", PARQUET_CORRUPTIONS)
def test_an_unreadable_sft_file_exits_2_naming_it(corruption, workspace, tmp_path, capsys):
    rows = [sft_row_from_rl_row(row) for row in make_arithmetic_rows("add2", 400, seed=1)]
    broken = corrupt_parquet(write_parquet(rows, tmp_path / "broken.parquet"), corruption)
    assert main(["sft", *run_args(workspace, tmp_path / "run", f"data.train_files={broken}")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {broken} cannot be read as parquet")


def test_more_gpus_than_processes_asks_for_torchrun(workspace):
    init_distributed()  # this process is a world of one
    cfg = load_config(["trainer.n_gpus_per_node=2", f"model.partial_pretrain={workspace['model']}",
                       f"data.train_files={workspace['train']}"], schema=SFTConfig)
    with pytest.raises(ConfigError, match=r"= 2 but this run has 1 process\(es\); launch several with "
                                          r"`torchrun --nproc_per_node=2 -m ember.trainer.sft"):
        check_sft_config(cfg)


# --- subprocesses: interruption and torchrun ----------------------------------------------------------


def _start(args, log_path):
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "ember", "sft", *args], env=worker_environment(),
                                stdout=log, stderr=subprocess.STDOUT)


def _interrupt_after_checkpoint(process, run_dir, after_step, signal_number):
    """Send `signal_number` once a checkpoint past `after_step` exists; wait for the process to end."""
    deadline = time.monotonic() + 90
    while not any(step > after_step for step, _ in list_checkpoints(str(run_dir))):
        assert process.poll() is None, "the run ended before it could be interrupted"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    process.send_signal(signal_number)
    return process.wait(timeout=60)


@pytest.mark.slow
def test_resume_after_sigterm_and_sigkill_equals_an_uninterrupted_run(workspace, tmp_path):
    def args(run_dir):
        return run_args(workspace, run_dir, "data.train_batch_size=4", "data.micro_batch_size_per_gpu=2",
                        "optim.lr=1e-2", "trainer.total_training_steps=24", "trainer.save_freq=4",
                        "trainer.test_freq=8", "trainer.max_ckpt_to_keep=2")

    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    log = tmp_path / "log.txt"
    assert main(["sft", *args(straight)]) == 0

    # SIGTERM: the run stops after its current step with a checkpoint of that step, and exits cleanly
    assert _interrupt_after_checkpoint(_start(args(interrupted), log), interrupted, 0, signal.SIGTERM) == 0
    stopped_at = list_checkpoints(str(interrupted))[-1][0]
    assert stopped_at == read_jsonl_metrics(str(interrupted / "metrics.jsonl"))[-1]["step"] < 24
    # SIGKILL after the resumed run's next checkpoint: nothing is written on the way out
    assert _interrupt_after_checkpoint(_start(args(interrupted), log), interrupted, stopped_at,
                                       signal.SIGKILL) == -signal.SIGKILL
    assert not (interrupted / "hf_model").exists()
    assert _start(args(interrupted), log).wait(timeout=120) == 0, log.read_text()[-3000:]

    expected = read_jsonl_metrics(str(straight / "metrics.jsonl"))
    resumed = read_jsonl_metrics(str(interrupted / "metrics.jsonl"))
    for key in ("train/loss", "train/grad_norm", "train/lr", "val/loss"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in expected], key
    final, reference = weights(interrupted), weights(straight)
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[name], reference[name]) for name in reference)
    assert [step for step, _ in list_checkpoints(str(interrupted))] == [20, 24]


@pytest.mark.slow
@pytest.mark.slow
def test_a_stop_signal_on_one_rank_stops_both_at_the_same_step_with_one_checkpoint(workspace, tmp_path):
    """A signal reaches the ranks at different moments (here only one gets it): they agree each step on whether
    to stop, so both save the same step and end; a rank deciding alone would save while the other trained on
    (mismatched collectives: a hang, or a crash)."""
    psutil = pytest.importorskip("psutil")
    run_dir = tmp_path / "run"
    args = run_args(workspace, run_dir, "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2",
                    "optim.lr=1e-2", "trainer.total_training_steps=200", "trainer.save_freq=2", "trainer.test_freq=-1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "ember.trainer.sft", *args]
    for attempt in range(2):  # a launch can lose a rank as its process group starts (two_ranks.run_two_ranks)
        with open(tmp_path / "log.txt", "ab") as log:
            launch = subprocess.Popen(command, env=worker_environment(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while launch.poll() is None and not list_checkpoints(str(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if launch.poll() is None:
            break
        assert attempt == 0, (tmp_path / "log.txt").read_text()[-3000:]
    ranks = psutil.Process(launch.pid).children()
    try:
        assert len(ranks) == 2
        ranks[1].send_signal(signal.SIGTERM)
        assert launch.wait(timeout=120) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    finally:  # ranks that hang (the failure this test looks for) must not outlive it
        for process in [*ranks, psutil.Process(launch.pid)] if launch.poll() is None else ranks:
            if process.is_running():
                process.kill()
    stopped_at = list_checkpoints(str(run_dir))[-1][0]
    assert stopped_at == read_jsonl_metrics(str(run_dir / "metrics.jsonl"))[-1]["step"] < 200


def test_two_torchrun_ranks_equal_one_process(workspace, tmp_path):
    # 5 validation conversations over 2 ranks: one rank evaluates a padding copy without targets
    common = ["data.train_batch_size=8", "data.micro_batch_size_per_gpu=2", "optim.lr=1e-2",
              "trainer.total_training_steps=4", "trainer.test_freq=2"]
    run_two_ranks("-m", "ember.trainer.sft", *run_args(workspace, tmp_path / "two", *common), timeout=180)
    assert "n_gpus_per_node: 2" in (tmp_path / "two" / "config.yaml").read_text()  # filled in from torchrun
    assert main(["sft", *run_args(workspace, tmp_path / "one", *common)]) == 0

    one = read_jsonl_metrics(str(tmp_path / "one" / "metrics.jsonl"))
    two = read_jsonl_metrics(str(tmp_path / "two" / "metrics.jsonl"))
    for key in ("train/loss", "val/loss"):
        assert [r.get(key) for r in two] == pytest.approx([r.get(key) for r in one], abs=1e-5), key
    reference = weights(tmp_path / "one")
    for name, weight in weights(tmp_path / "two").items():
        torch.testing.assert_close(weight, reference[name], atol=1e-5, rtol=0, msg=name)
