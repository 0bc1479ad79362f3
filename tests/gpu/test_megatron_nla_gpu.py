"""NLA's injection in the Megatron engine (TP = PP = 1, one GPU) against the FSDP2 engine's, on the same HF weights.

The vector goes over one prompt token's embedding output in both engines (`engines/injection.py`,
`engines/megatron/injection.py`); both compute in bf16, so log-probs agree to the tolerance of
tests/gpu/test_megatron_engine_gpu.py. The tiny model is initialised at std 0.07 (not the
default 0.02, whose near-uniform log-probs move by about the tolerance whatever is injected),
so that an injected vector moves each injected sample's log-probs by several tolerances and
replace and add differ by more than two: an engine that dropped the vector, or the mode,
would fail the comparison.
"""

import dataclasses

import pytest
import torch
from integration.fsdp_engine_worker import GRADIENT_REVEALING_OPTIM, engine_options, make_batch, mean_log_prob_loss
from transformers import AutoModelForCausalLM

from ember.engines.base import MicroBatchSpec
from ember.engines.fsdp.engine import FSDPEngine
from ember.models.tiny import tiny_model_config

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytestmark = pytest.mark.gpu

from ember.engines.megatron.engine import MegatronEngine  # noqa: E402
from ember.engines.megatron.options import MegatronOptions  # noqa: E402

TOLERANCE = 0.05
INIT_STD = 0.07  # the model's weights and the vectors alike, so that add differs from replace
HIDDEN = 64  # tiny_model_config's hidden size
POSITIONS = [1, 0, 2, -1, 1, 2, 0, 1]  # prompt tokens (every prompt has at least 3); sample 3 injects nothing


def make_responsive_model_dir(out_dir: str) -> str:
    """A tiny Qwen2 (tied head) initialised at std INIT_STD, saved as fp32 HF weights."""
    config = tiny_model_config("qwen2", vocab_size=128, tie_word_embeddings=True, initializer_range=INIT_STD)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


def injected_batch():
    """make_batch's 8 samples with a vector each at the prompt positions POSITIONS."""
    batch = make_batch(samples=8)
    generator = torch.Generator().manual_seed(1)
    vectors = INIT_STD * torch.randn(len(batch), HIDDEN, generator=generator)
    return batch.with_fields(activation_vectors=vectors, injection_positions=torch.tensor(POSITIONS))


def engines(model_dir: str, mode: str, role: str = "actor") -> tuple[FSDPEngine, MegatronEngine]:
    fsdp = FSDPEngine(engine_options(model_dir, role=role, param_dtype="bfloat16", injection_mode=mode,
                                     optim=GRADIENT_REVEALING_OPTIM))
    megatron = MegatronEngine(MegatronOptions(model_path=model_dir, role=role, injection_mode=mode,
                                              optim=GRADIENT_REVEALING_OPTIM))
    return fsdp, megatron


def test_injected_log_probs_match_the_fsdp_engine_in_both_modes(tmp_path):
    model_dir = make_responsive_model_dir(str(tmp_path / "model"))
    batch = injected_batch()
    plain_batch = dataclasses.replace(batch, injection_positions=None)
    mask = batch.response_mask.bool()
    injected = [row for row, position in enumerate(POSITIONS) if position >= 0]
    got = {}
    for mode in ("replace", "add"):
        fsdp, megatron = engines(model_dir, mode, role="ref")
        expected = fsdp.forward(batch, micro_batch_size=4).log_probs
        got[mode] = megatron.forward(batch, micro_batch_size=4).log_probs
        torch.testing.assert_close(got[mode][mask], expected[mask], atol=TOLERANCE, rtol=0)
        plain = megatron.forward(plain_batch, micro_batch_size=4).log_probs
        moved = [(got[mode][row] - plain[row])[mask[row]].abs().max() for row in injected]
        assert min(moved) > TOLERANCE and max(moved) > 4 * TOLERANCE, (mode, moved)  # every injected sample moves
        torch.testing.assert_close(got[mode][3][mask[3]], plain[3][mask[3]], atol=1e-6, rtol=0)  # position -1
        # token-budget micro-batches are trimmed of padding columns: the mask follows the trimmed tensors
        budget = megatron.forward(batch, MicroBatchSpec(max_token_len=24)).log_probs
        torch.testing.assert_close(budget[mask], got[mode][mask], atol=TOLERANCE, rtol=0)
        del fsdp, megatron
    assert (got["replace"] - got["add"])[mask].abs().max() > 2 * TOLERANCE  # the mode reaches the hook


def test_an_actor_trains_with_injection_like_the_fsdp_engine(tmp_path):
    model_dir = make_responsive_model_dir(str(tmp_path / "model"))
    batch = injected_batch()
    fsdp, megatron = engines(model_dir, "replace")
    fsdp_metrics = fsdp.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    megatron_metrics = megatron.train_mini_batch(batch, mean_log_prob_loss, micro_batch_size=2)
    assert torch.isfinite(torch.tensor(megatron_metrics["loss"])) and megatron_metrics["skipped"] == 0.0
    assert megatron_metrics["loss"] == pytest.approx(fsdp_metrics["loss"], abs=TOLERANCE)
    assert megatron_metrics["grad_norm"] == pytest.approx(fsdp_metrics["grad_norm"], rel=0.05)


def test_nla_grpo_with_the_actor_on_megatron_runs_end_to_end(tmp_path):
    """`ember nla train` on the fork's FSDP2 run file with the actor (and so the reference) on Megatron and
    the reconstructor on FSDP2: the vector reaches generation, the Megatron actor's update and the reward."""
    from fixtures import make_nla_model_dir
    from integration.test_nla_rl import metric_lines, nla, rows, run_overrides

    from ember.data.parquet import write_parquet

    model_dir = make_nla_model_dir(tmp_path / "model")
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    assert nla("train", "runs/qwen_7b/rl_grpo", *run_overrides(tmp_path, model_dir, train),
               "actor_rollout_ref.actor.strategy=megatron", "trainer.device=cuda") == 0
    lines = metric_lines(tmp_path / "run")
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[0]["nla/injections"] == 16
    for line in lines:
        assert torch.isfinite(torch.tensor([line["actor/pg_loss"], line["critic/fve"], line["actor/grad_norm"]])).all()
    assert (tmp_path / "run" / "global_step_2" / "actor").is_dir()


def test_the_forks_megatron_file_runs_with_both_roles_on_megatron_and_resumes(tmp_path):
    """The fork's 7B Megatron run file as written (its override_transformer_config included), shrunk to one GPU:
    actor and reconstructor on megatron-core, two steps with checkpoints, then a resume that continues to a
    third step from the second's checkpoint."""
    from fixtures import make_nla_model_dir
    from integration.test_nla_rl import metric_lines, nla, rows, run_overrides

    from ember.data.parquet import write_parquet

    model_dir = make_nla_model_dir(tmp_path / "model")
    train = write_parquet(rows(), tmp_path / "rl_train_layer1.parquet")
    one_gpu = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
               "critic.megatron.tensor_model_parallel_size=1", "trainer.device=cuda",
               "~ray_kwargs.resource_pool", "ray_kwargs.ray_init.num_gpus=null"]  # its 4 + 4 GPUs: shared
    assert nla("train", "runs/qwen_7b/rl_grpo_megatron", *run_overrides(tmp_path, model_dir, train), *one_gpu) == 0
    first = metric_lines(tmp_path / "run")
    assert [line["step"] for line in first] == [1, 2]
    for line in first:
        assert torch.isfinite(torch.tensor([line["actor/pg_loss"], line["critic/fve"], line["actor/grad_norm"]])).all()
    assert (tmp_path / "run" / "global_step_2" / "critic").is_dir()
    assert nla("train", "runs/qwen_7b/rl_grpo_megatron", *run_overrides(tmp_path, model_dir, train, steps=3), *one_gpu,
               "trainer.resume_mode=auto") == 0
    assert [line["step"] for line in metric_lines(tmp_path / "run")] == [1, 2, 3]


# --- the reconstructor (NLA's critic) on Megatron against FSDP2's ------------------------------------------------

RECONSTRUCTION_OPTIM = dataclasses.replace(GRADIENT_REVEALING_OPTIM, lr=0.1)  # an update of about 0.1 × gradient


def reconstruction_inputs(samples: int = 6):
    """A critic prompt and explanations of different lengths (so left padding differs), with target vectors."""
    from ember.workers.reconstructor import reconstruction_batch

    generator = torch.Generator().manual_seed(3)
    responses = [torch.randint(3, 120, (length,), generator=generator).tolist() for length in (5, 1, 9, 3, 7, 2)][:samples]
    targets = torch.randn(samples, HIDDEN, generator=generator)
    return reconstruction_batch([40, 41, 42], responses, targets, pad_token_id=0)


def reconstructors(model_dir: str, layer: int, **megatron_options) -> tuple[FSDPEngine, MegatronEngine]:
    fsdp = FSDPEngine(engine_options(model_dir, role="reconstructor", param_dtype="bfloat16", output_layer_index=layer,
                                     optim=RECONSTRUCTION_OPTIM))
    megatron = MegatronEngine(MegatronOptions(model_path=model_dir, role="reconstructor", output_layer_index=layer,
                                              optim=RECONSTRUCTION_OPTIM, **megatron_options))
    return fsdp, megatron


def assert_predictions_close(got, expected):
    """bf16 agreement relative to the predictions' scale (a final norm's output is about 1, an inner layer's not)."""
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=TOLERANCE * float(expected.abs().max()), rtol=0)


@pytest.mark.parametrize("layer", [1, -1])
def test_reconstructor_predictions_match_the_fsdp_engine(tmp_path, layer):
    model_dir = make_responsive_model_dir(str(tmp_path / "model"))
    batch = reconstruction_inputs()
    fsdp, megatron = reconstructors(model_dir, layer)
    expected = fsdp.forward(batch, micro_batch_size=4).predictions
    assert_predictions_close(megatron.forward(batch, micro_batch_size=4).predictions, expected)
    budget = megatron.forward(batch, MicroBatchSpec(max_token_len=24)).predictions  # trimmed padding columns
    assert_predictions_close(budget, expected)


@pytest.mark.parametrize("layer", [1, -1])
def test_one_mse_update_moves_the_predictions_like_the_fsdp_engine(tmp_path, layer):
    from ember.workers.reconstructor import mse_loss, squared_errors

    model_dir = make_responsive_model_dir(str(tmp_path / "model"))
    batch = reconstruction_inputs()
    targets = batch.activation_vectors
    fsdp, megatron = reconstructors(model_dir, layer)
    before = megatron.forward(batch, micro_batch_size=6).predictions
    fsdp_metrics = fsdp.train_mini_batch(batch, mse_loss, micro_batch_size=2)
    megatron_metrics = megatron.train_mini_batch(batch, mse_loss, micro_batch_size=2)
    assert megatron_metrics["skipped"] == 0.0
    assert megatron_metrics["loss"] == pytest.approx(float(squared_errors(before, targets).mean()), rel=0.01)
    assert megatron_metrics["loss"] == pytest.approx(fsdp_metrics["loss"], rel=TOLERANCE)
    assert megatron_metrics["grad_norm"] == pytest.approx(fsdp_metrics["grad_norm"], rel=TOLERANCE)
    after = megatron.forward(batch, micro_batch_size=6).predictions
    fsdp_after = fsdp.forward(batch, micro_batch_size=6).predictions
    assert float(squared_errors(after, targets).mean()) < megatron_metrics["loss"]  # toward the targets
    assert float(squared_errors(after, targets).mean()) == pytest.approx(
        float(squared_errors(fsdp_after, targets).mean()), rel=TOLERANCE)
    assert_predictions_close(after, fsdp_after)


def test_reconstructor_trains_only_what_its_prediction_reads(tmp_path):
    """Layer 1 of 2: the embedding and decoder layer 1 train; decoder layer 2 and the final norm are frozen (no
    gradient buffer, no optimizer state) and stay as loaded through an update."""
    from ember.engines.megatron.bridge import unwrapped
    from ember.workers.reconstructor import mse_loss

    model_dir = make_responsive_model_dir(str(tmp_path / "model"))
    _, megatron = reconstructors(model_dir, layer=1)
    model = unwrapped(megatron.chunks[0])
    trained = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trained and all(name.startswith(("embedding.", "decoder.layers.0.")) for name in trained), trained
    assert any(name.startswith("decoder.layers.1.") for name, _ in model.named_parameters())
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    megatron.train_mini_batch(reconstruction_inputs(), mse_loss, micro_batch_size=3)
    moved = {name for name, parameter in model.named_parameters() if not torch.equal(parameter.detach(), before[name])}
    assert moved and moved <= trained, moved - trained
    assert any(name.startswith("embedding.") for name in moved) and any(name.startswith("decoder.layers.0.")
                                                                         for name in moved)


def test_a_cut_reconstructor_predicts_what_the_full_one_does_and_exports_its_cut(tmp_path):
    from ember.engines.megatron.bridge import unwrapped
    from ember.models.reconstructor import FULL_LAYERS_KEY

    model_dir = make_responsive_model_dir(str(tmp_path / "model"))
    batch = reconstruction_inputs()
    _, full = reconstructors(model_dir, layer=1)
    cut = MegatronEngine(MegatronOptions(model_path=model_dir, role="reconstructor", output_layer_index=1,
                                         truncate_at_layer=1, optim=RECONSTRUCTION_OPTIM))
    assert len(unwrapped(cut.chunks[0]).decoder.layers) == 1
    expected = full.forward(batch, micro_batch_size=6).predictions
    assert_predictions_close(cut.forward(batch, micro_batch_size=6).predictions, expected)
    cut.export_hf(str(tmp_path / "cut"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "cut")
    assert reloaded.config.num_hidden_layers == 1 and getattr(reloaded.config, FULL_LAYERS_KEY) == 2
    again = MegatronEngine(MegatronOptions(model_path=str(tmp_path / "cut"), role="reconstructor",
                                           output_layer_index=1, optim=RECONSTRUCTION_OPTIM))
    assert_predictions_close(again.forward(batch, micro_batch_size=6).predictions, expected)


def test_full_recompute_with_an_inner_layer_is_refused(tmp_path):
    from ember.errors import UserError

    model_dir = make_responsive_model_dir(str(tmp_path / "model"))
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    with pytest.raises(UserError, match="recompute_granularity=full"):
        MegatronEngine(MegatronOptions(model_path=model_dir, role="reconstructor", output_layer_index=1,
                                       override_transformer_config=recompute))
