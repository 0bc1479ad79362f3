"""End-to-end RL runs on CPU with tiny models: GRPO, PPO with a critic, KL loss, KL in the
reward, several PPO epochs, the files a run leaves behind, HF export and reward errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember.cli import main as ember_main
from ember.config import load_config
from ember.data.batch import Batch
from ember.data.prompt_loader import PromptLoader
from ember.data.preprocess.synthetic import make_arithmetic_splits
from ember.trainer.export import export_checkpoint
from rl_helpers import (
    DATA_SOURCE,
    TEST_SIZE,
    TRAIN_SIZE,
    all_finite,
    build_trainer,
    close,
    engine_weights,
    fit,
    hf_weights,
    metrics_by_step,
    run_overrides,
    train,
)

STEP_METRICS = (
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
    "response_length/clip_ratio", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
    "actor/grad_norm", "actor/lr", "timing_s/gen", "timing_s/update_actor", "timing_s/step", "perf/throughput",
)
VALIDATION_METRIC = f"val-core/{DATA_SOURCE}/acc"


@pytest.fixture(scope="module")
def grpo_run(inputs, tmp_path_factory):
    """A finished 3-step GRPO run validating and saving every 2 steps (and at the end), and the
    batches its actor updated on."""
    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, "trainer.test_freq=2", "trainer.save_freq=2"))
    updated_batches = []
    update = trainer.parts.actor.update

    def recording_update(batch, step):
        updated_batches.append(batch)
        return update(batch, step)

    trainer.parts.actor.update = recording_update
    fit(trainer)
    return run_dir, trainer, updated_batches


def test_grpo_run_logs_every_metric_and_leaves_its_files(grpo_run, inputs):
    run_dir, trainer, _ = grpo_run
    metrics = metrics_by_step(run_dir)
    assert sorted(metrics) == [0, 1, 2, 3]  # validation before training, then three steps
    for step in (1, 2, 3):
        assert [key for key in STEP_METRICS if key not in metrics[step]] == [], step
        assert all_finite(metrics[step][key] for key in ("actor/pg_loss", "actor/loss", "actor/grad_norm"))
        assert metrics[step]["actor/grad_norm"] > 0
        assert metrics[step]["response_length/mean"] <= 8
    # Validation before training, every test_freq=2 steps and at the end.
    assert [step for step in metrics if VALIDATION_METRIC in metrics[step]] == [0, 2, 3]
    # The hashed reward differs between samples of a prompt, so GRPO's advantages are not all zero.
    assert any(metrics[step]["critic/score/max"] > metrics[step]["critic/score/min"] for step in (1, 2, 3))
    assert trainer.step == 3
    assert [path.name for path in sorted(run_dir.glob("global_step_*"))] == ["global_step_2", "global_step_3"]
    assert (run_dir / "global_step_3" / "trainer_state.json").is_file()
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "curves.png").stat().st_size > 0
    assert load_config([], config_path=str(run_dir), config_name="config") == trainer.cfg


def test_grpo_advantages_are_centred_within_each_prompts_samples(grpo_run):
    """The samples of one prompt share a uid (their GRPO group), so their advantages sum to 0;
    a group per sample would make each advantage the raw score."""
    _, trainer, updated_batches = grpo_run
    n = trainer.cfg.actor_rollout_ref.rollout.n
    assert len(updated_batches) == 3
    for batch in updated_batches:
        groups: dict[str, list[int]] = {}
        for index, uid in enumerate(batch.uids):
            groups.setdefault(uid, []).append(index)
        assert len(groups) == trainer.cfg.data.train_batch_size
        mask = batch.response_mask.bool()
        prompts = batch.input_ids[:, :batch.prompt_length]
        token_advantages = [batch.advantages[index][mask[index]] for index in range(len(batch))]
        assert all((tokens == tokens[0]).all() for tokens in token_advantages)  # one advantage per response
        per_sample = torch.stack([tokens[0] for tokens in token_advantages])
        for members in groups.values():
            assert len(members) == n
            assert all(torch.equal(prompts[members[0]], prompts[index]) for index in members)
            assert abs(per_sample[members].sum().item()) < 1e-4
    assert any(batch.advantages.abs().max() > 0.1 for batch in updated_batches)


def test_grpo_run_changes_the_policy_weights(grpo_run, inputs):
    run_dir, _, _ = grpo_run
    initial, trained = hf_weights(inputs.model_dir), hf_weights(run_dir / "hf_model")
    assert initial.keys() == trained.keys()
    changed = [name for name in initial if not torch.equal(initial[name], trained[name])]
    assert len(changed) > len(initial) // 2, changed
    assert all(torch.isfinite(tensor).all() for tensor in trained.values())


PROMPTS = ["What is 12 + 30?", "Tom has 3 apples."]
RESPONSES = [" 42 #### 42", " 3"]


def _plain_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log π of each response token from one unpadded transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_export_command_round_trips_to_transformers(grpo_run, tmp_path):
    run_dir, trainer, _ = grpo_run
    out_dir = tmp_path / "exported"
    assert ember_main(["export", str(run_dir / "global_step_3"), str(out_dir)]) == 0

    # Exported at the final step, the checkpoint equals the run's own final export.
    exported, final = hf_weights(out_dir), hf_weights(run_dir / "hf_model")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[name], final[name]) for name in final)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    tokenizer = trainer.parts.tokenizer
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    responses = [tokenizer(text)["input_ids"] for text in RESPONSES]
    batch = Batch.from_rollout(prompts, responses, pad_token_id=tokenizer.pad_token_id)
    engine_log_probs = trainer.parts.actor.compute_log_probs(batch)
    for row, (prompt, response) in enumerate(zip(prompts, responses)):
        torch.testing.assert_close(_plain_log_probs(model, prompt, response),
                                   engine_log_probs[row, :len(response)], atol=1e-5, rtol=0)
        with torch.no_grad():
            input_ids = torch.tensor([prompt + response])
            assert torch.equal(model(input_ids).logits, trainer.parts.actor.in_process().engine.module()(input_ids).logits)
    assert (out_dir / "tokenizer.json").is_file()

    # An earlier checkpoint is a different policy.
    earlier = export_checkpoint(str(run_dir / "global_step_2"), str(tmp_path / "step2"))
    assert any(not torch.equal(hf_weights(earlier)[name], final[name]) for name in final)


def test_export_of_a_folder_that_is_not_a_checkpoint_exits_2(tmp_path, capsys):
    assert ember_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "global_step_N" in capsys.readouterr().err


@pytest.mark.parametrize("variant", ["gae_two_epochs_two_mini_batches", "kl_loss", "kl_in_reward"])
def test_ppo_variants(variant, inputs, tmp_path):
    extra = {
        # GAE with a critic; each batch makes 2 epochs × 2 mini-batches of updates (old log-probs needed).
        "gae_two_epochs_two_mini_batches": ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.ppo_epochs=2",
                                            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_epochs=2",
                                            "critic.ppo_mini_batch_size=2"],
        "kl_loss": ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.1"],
        "kl_in_reward": ["algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=True",
                         "algorithm.kl_ctrl.kl_coef=0.1"],
    }[variant]
    run_dir = tmp_path / "run"
    trainer = build_trainer(run_overrides(inputs, run_dir, "trainer.total_training_steps=2",
                                          "trainer.val_before_train=False", *extra))
    critic_before = engine_weights(trainer.parts.critic.in_process().engine) if trainer.parts.critic is not None else None
    fit(trainer)
    steps = metrics_by_step(run_dir)
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        assert all_finite(value for key, value in metrics.items() if key.startswith(("actor/", "critic/")))
    if variant == "gae_two_epochs_two_mini_batches":
        assert all("timing_s/old_log_prob" in metrics and "critic/vf_loss" in metrics for metrics in steps.values())
        critic_after = engine_weights(trainer.parts.critic.in_process().engine)
        assert any(not torch.equal(critic_before[name], critic_after[name]) for name in critic_before)
        # Updates after the first one see a policy that moved away from the rollout's.
        assert any(metrics["actor/ppo_kl"] != 0 for metrics in steps.values())
    if variant == "kl_loss":
        assert trainer.parts.reference is not None and trainer.parts.critic is None
        assert all("actor/kl_loss" in metrics and "timing_s/ref" in metrics for metrics in steps.values())
        assert steps[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy = reference before any update
        assert steps[2]["actor/kl_loss"] > 0
    if variant == "kl_in_reward":
        assert all(metrics["actor/reward_kl_coef"] == 0.1 for metrics in steps.values())
        assert steps[1]["actor/reward_kl"] == pytest.approx(0.0, abs=1e-6)
        assert steps[2]["actor/reward_kl"] > 0
        # rewards = scores - kl_coef · KL: lower than the scores once the policy moved.
        assert steps[2]["critic/rewards/mean"] < steps[2]["critic/score/mean"]


@pytest.mark.parametrize("do_sample", [False, True])
def test_remax_subtracts_the_reward_of_the_greedy_response(do_sample, inputs, tmp_path):
    run_dir = tmp_path / "run"
    train(run_overrides(inputs, run_dir, "algorithm.adv_estimator=remax", "trainer.total_training_steps=2",
                        "trainer.val_before_train=False", f"actor_rollout_ref.rollout.do_sample={do_sample}"))
    steps = metrics_by_step(run_dir)
    assert all("timing_s/gen_max" in metrics for metrics in steps.values())
    advantages = [metrics[f"critic/advantages/{stat}"] for metrics in steps.values() for stat in ("min", "max")]
    if do_sample:
        assert all_finite(advantages) and any(value != 0 for value in advantages)
    else:  # every sample is the greedy response, so its reward equals its own prompt's baseline
        assert advantages == [0.0] * 4


@pytest.mark.parametrize("estimator, scored_per_prompt", [("grpo", 4), ("remax", 5)])
def test_reward_errors_are_counted_and_the_run_completes(inputs, tmp_path, estimator, scored_per_prompt):
    """The reward raises on even answers: the step counts n × (even answers among its prompts), and with ReMax
    its greedy baselines' failures too (one more response per prompt). (Step 2's prompts all have even answers: a
    step whose every sample failed stops the run, test_rl_reward_failures.py.)"""
    run_dir = tmp_path / "run"
    trainer = train(run_overrides(inputs, run_dir, "trainer.total_training_steps=1", "trainer.val_before_train=False",
                                  "reward_model.num_workers=1", "reward_model.failure_score=-1.0",
                                  f"algorithm.adv_estimator={estimator}",
                                  "+custom_reward_function.reward_kwargs.fail_even_answers=True"))
    rows = make_arithmetic_splits("add2", TRAIN_SIZE, TEST_SIZE, seed=0)["train"]  # the rows of inputs.train_file
    loader = iter(PromptLoader(rows, batch_size=4, shuffle=True, seed=trainer.cfg.data.seed))
    step = metrics_by_step(run_dir)[1]
    answers = [int(row["reward_model"]["ground_truth"]) for row in next(loader)]
    expected_errors = scored_per_prompt * sum(answer % 2 == 0 for answer in answers)
    assert step["reward/errors"] == expected_errors
    assert step["critic/score/min"] == -1.0
    assert 0 < expected_errors < 4 * scored_per_prompt  # this batch holds both even and odd answers
    assert (run_dir / "hf_model" / "model.safetensors").is_file()


def test_save_contents_hf_model_writes_a_transformers_folder_per_role_in_each_checkpoint(inputs, tmp_path):
    """verl's `checkpoint.save_contents: [..., hf_model]`: `<role>/huggingface` beside the resumable state."""
    from transformers import AutoModelForTokenClassification

    run_dir = tmp_path / "run"
    fit(build_trainer(run_overrides(inputs, run_dir, "trainer.total_training_steps=1", "trainer.save_freq=1",
                                    "trainer.val_before_train=False", "algorithm.adv_estimator=gae",
                                    "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
                                    "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]")))
    step = run_dir / "global_step_1"
    assert AutoModelForCausalLM.from_pretrained(step / "actor" / "huggingface").config.num_hidden_layers > 0
    assert AutoModelForTokenClassification.from_pretrained(step / "critic" / "huggingface").config.num_labels == 1
    export_checkpoint(str(step), str(tmp_path / "out"))  # the checkpoint itself is still whole
    assert (tmp_path / "out" / "config.json").is_file()


def test_a_data_source_without_a_built_in_scorer_stops_the_run_when_its_file_loads(inputs, tmp_path):
    """With the built-in reward function, every data_source of the train and validation files needs a scorer: one
    row of an unknown source stops the run at its start (naming the source and the fix), not hours in, at the
    first batch that draws the row."""
    from ember.data.parquet import write_parquet
    from ember.rewards.contract import RewardConfigError

    rows = make_arithmetic_splits("add2", TRAIN_SIZE, TEST_SIZE, seed=0)["test"]
    rows[-1] = dict(rows[-1], data_source="numina_x")
    val_file = write_parquet(rows, tmp_path / "mixed.parquet")
    overrides = run_overrides(inputs, tmp_path / "run", "custom_reward_function.path=null",
                              f"data.val_files={val_file}")
    with pytest.raises(RewardConfigError, match=r"data.val_files: no built-in reward function for data_source "
                                                r"'numina_x'.*custom_reward_function.path"):
        build_trainer(overrides)


def test_verls_loss_scale_factor_sets_the_seq_mean_token_sum_norm_divisor(inputs, tmp_path):
    # the divisor each sequence's token sum is divided by; null (verl's default) keeps the padded response length
    for extra, expected in ((["actor_rollout_ref.actor.loss_scale_factor=4096"], 4096),
                            ([], load_config(run_overrides(inputs, tmp_path / "b")).data.max_response_length)):
        trainer = build_trainer(run_overrides(inputs, tmp_path / str(expected), "trainer.val_before_train=False",
                                              "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", *extra))
        try:
            assert trainer.parts.actor.in_process().options.norm_length == expected
        finally:
            close(trainer)


def test_verls_max_samples_keys_cut_the_train_and_validation_sets(inputs, tmp_path):
    trainer = build_trainer(run_overrides(inputs, tmp_path / "run", "data.train_max_samples=8", "data.val_max_samples=3",
                                          "trainer.val_before_train=False"))
    try:
        assert len(trainer.parts.train_loader.dataset) == 8 and len(trainer.parts.val_dataset) == 3
        assert len({sample.index for sample in trainer.parts.train_loader.dataset}) == 8
    finally:
        close(trainer)
