"""The RL prompt data (`data`): which parquet files, which columns, how long, how many per step.

Each row holds a prompt (a chat message list under `prompt_key`), the data source named by
`reward_fn_key` and whatever the reward function needs (`reward_model.ground_truth`,
`extra_info`), as written by `ember preprocess`.
"""

from dataclasses import dataclass
from typing import Any, Literal

from ember.config.schema.base import field_, section

Truncation = Literal["error", "left", "right", "middle"]


@dataclass
class CustomClassConfig:
    """A dataset class loaded from a user's Python file."""

    path: str | None = field_(None, "Python file defining the class; null = ember's dataset")
    name: str | None = field_(None, "name of the class in that file")


@dataclass
class DataConfig:
    """Prompt datasets and the batch size of a training step."""

    tokenizer: str | None = field_(None, "tokenizer used to build prompts; null = the policy model's")
    train_files: str | list[str] | None = field_(None, "parquet file(s) of training prompts; null = ember's built-in task")
    val_files: str | list[str] | None = field_(None, "parquet file(s) of validation prompts; null = no validation set")
    prompt_key: str = field_("prompt", "column holding the prompt (a list of chat messages)")
    reward_fn_key: str = field_("data_source", "column that selects the reward function of each row")
    max_prompt_length: int = field_(512, "longest prompt in tokens; longer ones are handled by truncation")
    max_response_length: int = field_(512, "most tokens generated per response")
    train_batch_size: int = field_(1024, "prompts per training step")
    gen_batch_size: int | None = field_(
        None, "prompts per generation round with algorithm.filter_groups (DAPO); null = train_batch_size")
    val_batch_size: int | None = field_(None, "prompts per validation rollout call; null = 512")
    return_raw_input_ids: bool = field_(
        False, "verl: prompt ids before the chat template for a reward model with another tokenizer; ember's "
               "reward functions get the decoded text (no effect)")
    return_raw_chat: bool = field_(False, "verl: hand the rollout the chat messages; ember's engine takes the "
                                          "templated token ids (no effect)")
    return_full_prompt: bool = field_(False, "verl: also keep the templated prompt text; ember keeps it always (no effect)")
    shuffle: bool = field_(True, "shuffle the training prompts each epoch")
    seed: int | None = field_(
        1, "seed of the shuffle (and of the train/val_max_samples choice); null (verl's default, an unseeded order "
           "there) is read as 1: ember's order is always reproducible")
    train_max_samples: int = field_(
        -1, "use only this many rows of data.train_files (-1: all): with data.shuffle a random choice seeded by "
            "data.seed, as verl draws it, else the first ones; taken before the over-long filter (ember nla train: "
            "of the rows it reads)")
    val_max_samples: int = field_(-1, "the same for data.val_files")
    filter_overlong_prompts: bool = field_(False, "drop prompts longer than max_prompt_length when loading")
    filter_overlong_prompts_workers: int = field_(
        1, "verl: processes that tokenize prompts for the overlong filter; ember filters in the driver process "
           "(no effect)")
    truncation: Truncation = field_(
        "error", "what to do with a prompt over max_prompt_length: error, or cut it on the left, right or middle")
    dataloader_num_workers: int = field_(
        8, "verl: worker processes of the training dataloader; ember's prompt loader indexes the tokenized "
           "prompts in the driver process (no effect)")
    trust_remote_code: bool = field_(False, "allow tokenizer code shipped with the checkpoint to run (as "
                                            "actor_rollout_ref.model.trust_remote_code does; either allows it)")
    custom_cls: CustomClassConfig = section(CustomClassConfig, "a user-defined dataset class")
    reward_fn: dict[str, Any] = field_(
        {}, "reward function built from this mapping: _target_ (import path) plus its keyword arguments")
