"""The built-in demo's warm start: its accuracy check counts the replies greedy decoding
reproduces, and training stops at the first check that reaches the target (or at max_steps)."""

import torch
from fixtures import make_tiny_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_rows
from ember.data.sft_dataset import SFTExample
from ember.trainer.builtin import sft_row
from ember.trainer.sft_step import sft_batch
from ember.trainer.warm_start import WarmStartOptions, greedy_accuracy, warm_start


def test_greedy_accuracy_is_the_share_of_replies_greedy_decoding_reproduces(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path, arch="llama", seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(text).input_ids for text in ("What is 1 + 2?", "Seven plus", "12 34", "The sum")]
    examples = []
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        if row % 2:  # every other reply is changed at its fourth token: greedy decoding would not write it
            generated[3] = (generated[3] + 1) % len(tokenizer)
        examples.append(SFTExample(prompt + generated, [0] * len(prompt) + [1] * len(generated)))
    assert greedy_accuracy(model, sft_batch(examples, tokenizer.pad_token_id)) == 0.5


def warm_start_run(tmp_path, capsys, **options):
    model_dir = make_tiny_model_dir(tmp_path, arch="llama")
    rows = [sft_row(row) for row in make_arithmetic_rows("add2", 16, seed=0)]
    sft_file = str(write_parquet(rows, tmp_path / "sft.parquet"))
    settings = dict(target_accuracy=0.0, max_steps=6, batch_size=4, lr=1e-3, warmup_steps=0, check_every=2,
                    probe_size=8, max_length=96)
    accuracy = warm_start(str(model_dir), str(tmp_path / "warm"), sft_file, 0, WarmStartOptions(**dict(settings, **options)))
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warm start step")]
    assert (tmp_path / "warm" / "config.json").is_file()
    return accuracy, progress


def test_warm_start_stops_at_the_first_check_that_reaches_the_target(tmp_path, capsys):
    accuracy, progress = warm_start_run(tmp_path, capsys, target_accuracy=0.0)
    assert accuracy >= 0.0 and len(progress) == 1 and progress[0].startswith("warm start step 2 |")


def test_warm_start_ends_at_max_steps_when_the_target_is_out_of_reach(tmp_path, capsys):
    accuracy, progress = warm_start_run(tmp_path, capsys, target_accuracy=1.0, max_steps=5)
    assert accuracy < 1.0
    assert [line.split(" |")[0] for line in progress] == ["warm start step 2", "warm start step 4", "warm start step 5"]
