"""Inputs of tiny RL runs whose samples differ in length, and ways to look at what a run trained on.

The default tiny run (`rl_helpers`) has prompts of one length and responses that all run to the
limit, so anything that depends on a sample's length (batch balancing over ranks, DAPO's overlong
penalty) sees equal lengths and leaves every sample in place. Here prompts get 0 to 14 filler
words before the question (in a fixed, unshuffled order), and the model's generation config names
every fourth token id a stop token, so responses end anywhere from 1 token to the limit.

`record_updates` keeps the batches the actor updates on; `rewards_of_responses` recomputes the
test reward of each of their decoded responses, so a test can check that every sample trained
with its own reward.
"""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import torch

from ember.data.batch import Batch
from ember.data.parquet import write_parquet
from ember.data.preprocess.synthetic import make_arithmetic_splits
from rl_helpers import TEST_SIZE, TRAIN_SIZE, RunInputs

FILLERS = (0, 9, 3, 14, 6, 1, 11, 4)  # filler words before prompt i's question: FILLERS[i % 8]
STOP_EVERY = 4  # token ids divisible by this end a response


def varied_inputs(directory: Path, inputs: RunInputs) -> RunInputs:
    """`inputs` with prompts of different lengths and a copy of its model that stops at varied lengths."""
    directory.mkdir(parents=True, exist_ok=True)
    model_dir = directory / "model"
    shutil.copytree(inputs.model_dir, model_dir)
    generation_config = json.loads((model_dir / "generation_config.json").read_text())
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    generation_config["eos_token_id"] = sorted({*generation_config["eos_token_id"], *range(0, vocab_size, STOP_EVERY)})
    (model_dir / "generation_config.json").write_text(json.dumps(generation_config))
    splits = make_arithmetic_splits("add2", TRAIN_SIZE, TEST_SIZE, seed=0)
    for index, row in enumerate(splits["train"]):
        message = row["prompt"][0]
        message["content"] = "please " * FILLERS[index % len(FILLERS)] + message["content"]
    return RunInputs(model_dir=model_dir, train_file=write_parquet(splits["train"], directory / "train.parquet"),
                     val_file=inputs.val_file, reward_file=inputs.reward_file)


VARIED_RUN = ["data.shuffle=False", "data.max_prompt_length=128"]
"""Overrides a run on `varied_inputs` needs: its prompts in file order, and room for the longest."""


def record_updates(trainer) -> list[Batch]:
    """The batches `trainer`'s actor will update on, appended as the run goes."""
    batches: list[Batch] = []
    update = trainer.parts.actor.update

    def recording_update(batch, step):
        batches.append(batch)
        return update(batch, step)

    trainer.parts.actor.update = recording_update
    return batches


def decoded_responses(batch: Batch, tokenizer) -> list[str]:
    """Each sample's response text, decoded as the trainer decodes it for the reward."""
    lengths = batch.response_mask.sum(dim=1).tolist()
    return tokenizer.batch_decode([row[:int(length)] for row, length in zip(batch.responses.tolist(), lengths)],
                                  skip_special_tokens=True)


def reward_function(reward_file: Path):
    """The `compute_score` of a reward file, called here in the test's process."""
    return runpy.run_path(str(reward_file))["compute_score"]


def rewards_of_responses(batch: Batch, tokenizer, reward_file: Path) -> list[float]:
    """The reward file's score of each sample of `batch`, recomputed from its decoded response."""
    compute_score = reward_function(reward_file)
    scores = []
    for text, data_source, truth in zip(decoded_responses(batch, tokenizer), batch.data_sources, batch.ground_truths):
        score = compute_score(data_source, text, truth)
        scores.append(float(score["score"] if isinstance(score, dict) else score))
    return scores


def trained_scores(batch: Batch) -> torch.Tensor:
    """[B] the score each sample trained with (its token-level scores summed)."""
    return (batch.token_level_scores * batch.response_mask).sum(dim=1)
