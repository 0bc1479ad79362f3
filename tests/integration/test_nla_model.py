"""NLA's model side on tiny fp32 models (CPU): the injected vector in training forwards and in ember's
engine's prefill, and the reconstructor's prediction, each against plain transformers."""

import dataclasses

import pytest
import torch
from fsdp_engine_worker import engine_options, make_batch, make_model_dir
from transformers import AutoModelForCausalLM

from ember.engines.fsdp.engine import FSDPEngine
from ember.engines.injection import injecting
from ember.inference import EngineConfig, LLMEngine
from ember.models.reconstructor import FULL_LAYERS_KEY
from ember.rollout.base import Injection, SamplingParams

HIDDEN = 64  # tiny_model_config's hidden size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir("qwen2", str(tmp_path_factory.mktemp("nla-model")))


def with_injections(batch, seed=1):
    """`batch` with a vector per sample at prompt token 1 of its own prompt (the last sample: none)."""
    generator = torch.Generator().manual_seed(seed)
    vectors = torch.randn(len(batch), HIDDEN, generator=generator)
    positions = torch.ones(len(batch), dtype=torch.long)
    positions[-1] = -1
    return batch.with_fields(activation_vectors=vectors, injection_positions=positions)


def log_probs_with_embeds(model, batch):
    """Response log-probs from transformers fed `inputs_embeds` with each vector written by hand."""
    with torch.no_grad():
        embeds = model.get_input_embeddings()(batch.input_ids).clone()
        for row in range(len(batch)):
            position = int(batch.injection_positions[row])
            if position >= 0:
                column = int(((batch.position_ids[row] == position) & batch.attention_mask[row].bool()).nonzero())
                embeds[row, column] = batch.activation_vectors[row]
        logits = model(inputs_embeds=embeds, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits.float()
    log_softmax = torch.log_softmax(logits[:, batch.prompt_length - 1:-1], dim=-1)
    return log_softmax.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("packed", [False, True])
def test_training_forward_injects_exactly_the_named_token(model_dir, packed):
    batch = with_injections(make_batch(samples=4))
    engine = FSDPEngine(engine_options(model_dir, use_remove_padding=packed))
    output = engine.forward(batch, micro_batch_size=2).log_probs
    plain = engine.forward(dataclasses.replace(batch, injection_positions=None), micro_batch_size=2).log_probs
    expected = log_probs_with_embeds(AutoModelForCausalLM.from_pretrained(model_dir), batch)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(output[mask], expected[mask], atol=1e-5, rtol=0)
    assert not torch.allclose(output[:3][mask[:3]], plain[:3][mask[:3]], atol=1e-3)  # the vector matters
    torch.testing.assert_close(output[3][mask[3]], plain[3][mask[3]], atol=1e-6, rtol=0)  # position -1: untouched


def test_injection_hook_rewrites_one_row_per_sample_and_adds_in_add_mode(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = with_injections(make_batch(samples=3))
    embedding = model.get_input_embeddings()
    plain = embedding(batch.input_ids).detach()
    for mode in ("replace", "add"):
        with injecting(model, batch, mode=mode):
            rewritten = embedding(batch.input_ids).detach()
        changed = (rewritten != plain).any(dim=-1)
        assert changed.sum() == 2 and changed[2].sum() == 0
        for row in range(2):
            column = int(changed[row].nonzero())
            assert int(batch.position_ids[row, column]) == 1
            expected = batch.activation_vectors[row] + (plain[row, column] if mode == "add" else 0)
            torch.testing.assert_close(rewritten[row, column], expected)


def test_a_position_past_the_prompt_is_refused(model_dir):
    batch = make_batch(samples=2)
    batch = batch.with_fields(activation_vectors=torch.zeros(2, HIDDEN), injection_positions=torch.tensor([1, 99]))
    engine = FSDPEngine(engine_options(model_dir))
    with pytest.raises(ValueError, match="sample 1: injection position 99 names no real token"):
        engine.forward(batch, micro_batch_size=2)


def test_engine_prefill_injection_matches_training_log_probs(model_dir):
    """What ember's engine samples with a vector in prefill, the training forward scores with the same vector:
    rollout log-probs equal the engine's (training) log-probs of those tokens."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = EngineConfig(max_model_len=64, max_num_seqs=3, max_num_batched_tokens=64, block_size=4, dtype=torch.float32)
    engine = LLMEngine(model.config, model.state_dict().items(), config)
    prompts = [[5, 9, 13, 20], [7, 3, 22, 40, 41, 90]]
    vectors = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(3)) * 3
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=0, ignore_eos=True)
    injections = [Injection(position=2, vector=vectors[0]), Injection(position=0, vector=vectors[1])]
    injected = engine.generate(prompts, sampling, injections)
    plain = engine.generate(prompts, sampling)
    assert [s.generated_token_ids for s in injected] != [s.generated_token_ids for s in plain]
    from ember.data.batch import Batch

    batch = Batch.from_rollout([s.token_ids[:s.prompt_length] for s in injected],
                               [s.generated_token_ids for s in injected], pad_token_id=0)
    batch = batch.with_fields(activation_vectors=vectors.repeat_interleave(2, dim=0),
                              injection_positions=torch.tensor([2, 2, 0, 0]))
    trained = FSDPEngine(engine_options(model_dir)).forward(batch, micro_batch_size=4).log_probs
    rollout = torch.tensor([s.log_probs for s in injected])
    torch.testing.assert_close(trained, rollout, atol=1e-4, rtol=0)


def test_engine_keeps_the_injection_through_chunked_prefill(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = list(range(3, 23))
    vector = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(4)) * 3
    sampling = SamplingParams(n=1, do_sample=False, max_new_tokens=5, ignore_eos=True)
    outputs = []
    for budget in (64, 8):  # one prefill step; chunks of 8 tokens (the vector sits in the second chunk)
        config = EngineConfig(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=budget, block_size=4,
                              dtype=torch.float32, enable_chunked_prefill=True)
        engine = LLMEngine(model.config, model.state_dict().items(), config)
        outputs.append(engine.generate([prompt], sampling, [Injection(position=11, vector=vector)])[0].generated_token_ids)
    assert outputs[0] == outputs[1]


def test_engine_refuses_a_vector_of_another_size(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = EngineConfig(max_model_len=32, max_num_seqs=1, max_num_batched_tokens=32, dtype=torch.float32)
    engine = LLMEngine(model.config, model.state_dict().items(), config)
    with pytest.raises(ValueError, match="hidden size is 64"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=2), [Injection(position=0, vector=torch.zeros(8))])


def hf_hidden_at_last_token(model, batch, layer):
    with torch.no_grad():
        hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                       output_hidden_states=True).hidden_states[layer]
    last = batch.attention_mask.shape[1] - 1 - batch.attention_mask.flip(dims=[1]).argmax(dim=1)
    return hidden[torch.arange(len(batch)), last]


@pytest.mark.parametrize("layer", [0, 1, 2, -1, -2])
@pytest.mark.parametrize("packed", [False, True])
def test_reconstructor_predicts_hidden_states_at_the_last_token(model_dir, layer, packed):
    batch = make_batch(samples=4)
    engine = FSDPEngine(engine_options(model_dir, role="reconstructor", output_layer_index=layer,
                                       use_remove_padding=packed))
    predicted = engine.forward(batch, micro_batch_size=3).predictions
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    expected = hf_hidden_at_last_token(model, batch, layer)
    assert predicted.shape == (4, HIDDEN)
    torch.testing.assert_close(predicted, expected, atol=1e-5, rtol=0)


def test_truncated_reconstructor_predicts_what_the_full_one_does_and_exports_its_cut(model_dir, tmp_path):
    batch = make_batch(samples=3)
    full = FSDPEngine(engine_options(model_dir, role="reconstructor", output_layer_index=1))
    cut = FSDPEngine(engine_options(model_dir, role="reconstructor", output_layer_index=1, truncate_at_layer=1))
    assert len(cut.model.model.layers) == 1 and len(full.model.model.layers) == 2
    torch.testing.assert_close(cut.forward(batch, micro_batch_size=3).predictions,
                               full.forward(batch, micro_batch_size=3).predictions, atol=1e-6, rtol=0)
    cut.export_hf(str(tmp_path / "cut"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "cut")
    assert reloaded.config.num_hidden_layers == 1 and getattr(reloaded.config, FULL_LAYERS_KEY) == 2
    again = FSDPEngine(engine_options(str(tmp_path / "cut"), role="reconstructor", output_layer_index=1))
    torch.testing.assert_close(again.forward(batch, micro_batch_size=3).predictions,
                               full.forward(batch, micro_batch_size=3).predictions, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="keeps only its first 1 layers"):
        FSDPEngine(engine_options(model_dir, role="reconstructor", output_layer_index=2,
                                  truncate_at_layer=1)).forward(batch, micro_batch_size=3)


def test_reward_is_minus_the_mse_of_the_critic_prompt_and_response_hidden_state(model_dir):
    """The reconstructor reads `critic_prompt + response` (EOS included) at its last token: by hand with transformers."""
    from ember.workers.reconstructor import reconstruction_batch, reconstruction_metrics, squared_errors

    critic_prompt, responses = [40, 41], [[5, 6, 7, 1], [9], [3, 4]]
    targets = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5))
    batch = reconstruction_batch(critic_prompt, responses, targets, pad_token_id=0)
    predicted = FSDPEngine(engine_options(model_dir, role="reconstructor", output_layer_index=1)).forward(
        batch, micro_batch_size=2).predictions
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    expected = []
    with torch.no_grad():
        for response in responses:
            hidden = model(input_ids=torch.tensor([critic_prompt + response]), output_hidden_states=True).hidden_states[1]
            expected.append(hidden[0, -1])
    expected = torch.stack(expected)
    torch.testing.assert_close(predicted, expected, atol=1e-5, rtol=0)
    rewards = -squared_errors(predicted, targets)
    torch.testing.assert_close(rewards, -((expected - targets) ** 2).mean(dim=-1), atol=1e-5, rtol=0)
    metrics = reconstruction_metrics(predicted, targets)
    variance = ((targets - targets.mean(0)) ** 2).mean()
    assert metrics["critic/fve"] == pytest.approx(1 - float(((expected - targets) ** 2).mean() / variance), rel=1e-4)
    assert metrics["critic/mse_with_zero_pred"] == pytest.approx(float((targets ** 2).mean()), rel=1e-5)


def test_reconstructor_trains_only_what_its_prediction_reads(model_dir):
    """Layer 1's prediction reads the embeddings and decoder layer 1: the optimizer holds those alone (so its
    checkpoint resumes), they move, and decoder layer 2, the final norm and the head stay as loaded."""
    from ember.workers.reconstructor import mse_loss

    engine = FSDPEngine(engine_options(model_dir, role="reconstructor", output_layer_index=1))
    held = {id(parameter) for group in engine.optimizer.param_groups for parameter in group["params"]}
    names = {name for name, parameter in engine.model.named_parameters() if id(parameter) in held}
    assert names and all(name.startswith(("model.embed_tokens", "model.layers.0.")) for name in names)
    before = {name: parameter.detach().clone().to_local() if hasattr(parameter, "to_local") else parameter.detach().clone()
              for name, parameter in engine.model.named_parameters()}
    batch = make_batch(samples=4).with_fields(activation_vectors=torch.randn(4, HIDDEN))
    engine.train_mini_batch(batch, mse_loss, micro_batch_size=2)
    for name, parameter in engine.model.named_parameters():
        now = parameter.detach().to_local() if hasattr(parameter, "to_local") else parameter.detach()
        assert torch.equal(now, before[name]) == (name not in names), name


def test_a_one_token_explanation_without_a_critic_prompt_is_read_at_that_token(model_dir):
    from ember.workers.reconstructor import reconstruction_batch

    responses = [[5], [6, 7, 8]]
    batch = reconstruction_batch([], responses, torch.zeros(2, HIDDEN), pad_token_id=0)
    predicted = FSDPEngine(engine_options(model_dir, role="reconstructor", output_layer_index=1)).forward(
        batch, micro_batch_size=2).predictions
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        expected = torch.stack([model(input_ids=torch.tensor([response]), output_hidden_states=True).hidden_states[1][0, -1]
                                for response in responses])
    torch.testing.assert_close(predicted, expected, atol=1e-5, rtol=0)


def test_sft_padding_copies_count_for_nothing():
    import dataclasses as dc

    from ember.nla.data import NLASFTExample
    from ember.nla.sft import PADDING_INDEX, critic_sft_batch, nla_sft_batch

    example = NLASFTExample([3, 4, 5], [6, 7, 1], 1, torch.ones(HIDDEN), 0, "x")
    padding = dc.replace(example, index=PADDING_INDEX)
    _, weights = critic_sft_batch([example, padding], pad_token_id=0)
    assert weights.tolist() == [1.0, 0.0]
    batch = nla_sft_batch([example, padding], pad_token_id=0)
    assert batch.response_mask[0].sum() == 3 and batch.response_mask[1].sum() == 0
