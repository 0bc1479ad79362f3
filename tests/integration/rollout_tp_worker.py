"""Two gloo ranks: ember's generation engine split over both (tensor parallel 2) against the whole engine
on each rank, on tiny fp32 models (dense, one key-value head shared by both ranks, tied embeddings over an
odd vocabulary (each rank holds half the rows, one padded), Qwen2-MoE with its shared expert, Qwen3-MoE): greedy tokens, sampled tokens (T=0.7, top-p 0.9) and every token's log-prob
must agree; an update of the weights reaches both halves, sent whole or as each rank's part; NLA's injected
vectors and AQN's noised weights give the same tokens too, and unseeded draws agree over the ranks. FP8 generation split over both ranks quantises
each rank's own part (`check_fp8`). The MoE models' split engines load from a
saved directory (one tensor per expert), their whole engines from the fused parameters. Arguments: a
scratch folder; rank 0 writes "ok" to its `done` file."""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ember.inference import LLMEngine  # noqa: E402
from ember.inference.models.weights import read_safetensors  # noqa: E402
from ember.rollout.base import Injection, SamplingParams  # noqa: E402
from ember.workers.noise_injection import NoiseInjection  # noqa: E402
from ember.distributed.device import shutdown_distributed  # noqa: E402
from test_inference_engine import PROMPTS, engine_config, tiny_model  # noqa: E402
from test_inference_moe import MOE_OVERRIDES  # noqa: E402

SAMPLINGS = {"greedy": SamplingParams(n=1, do_sample=False, max_new_tokens=12, seed=3),  # drawn from the ranks' partials
             "sampled": SamplingParams(n=3, temperature=0.9, max_new_tokens=12, seed=3),  # from the ranks' partials
             "sampled, top-p": SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3)}  # gathered
MODELS = {
    "qwen2": ("qwen2", {}),
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "llama, one key-value head": ("llama", dict(num_key_value_heads=1)),
    "qwen2, tied embeddings, odd vocabulary": ("qwen2", dict(tie_word_embeddings=True, vocab_size=127)),
    "qwen2_moe": ("qwen2_moe", MOE_OVERRIDES["qwen2_moe"]),
    "qwen3_moe": ("qwen3_moe", MOE_OVERRIDES["qwen3_moe"]),
}


def outputs(engine: LLMEngine) -> dict:
    result = {}
    for name, sampling in SAMPLINGS.items():
        sequences = engine.generate(PROMPTS, sampling)
        result[name] = [(sequence.generated_token_ids, torch.tensor(sequence.log_probs)) for sequence in sequences]
    return result


def compare(split: dict, whole: dict, what: str) -> None:
    for name in SAMPLINGS:
        for index, ((tokens, log_probs), (expected_tokens, expected_log_probs)) in enumerate(zip(split[name], whole[name])):
            assert tokens == expected_tokens, (what, name, index, tokens, expected_tokens)
            torch.testing.assert_close(log_probs, expected_log_probs, atol=1e-5, rtol=0, msg=f"{what} {name} {index}")


def split_and_whole(what: str, arch: str, overrides: dict, scratch: Path) -> tuple[LLMEngine, LLMEngine, dict]:
    """The engine split over both ranks and the whole one, and the model's weights by name."""
    model = tiny_model(arch, num_attention_heads=4, **dict(dict(num_key_value_heads=2), **overrides))
    weights = dict(model.state_dict())
    whole = LLMEngine(model.config, weights.items(), engine_config(max_num_seqs=4))
    split_source = weights.items()
    if "moe" in arch:  # one tensor per expert, as a saved checkpoint names them
        folder = scratch / arch
        if dist.get_rank() == 0:
            model.save_pretrained(folder)
        dist.barrier()
        split_source = read_safetensors(folder)
        assert any(".experts.0.gate_proj." in name for name, _ in read_safetensors(folder))
    split = LLMEngine(model.config, split_source, engine_config(max_num_seqs=4, tensor_parallel_size=2))
    kv_heads = model.config.num_key_value_heads
    assert split.model.num_kv_heads == max(kv_heads // 2, 1) and split.kv_cache.block_shape[2] == split.model.num_kv_heads
    vocab = model.config.vocab_size  # each rank holds half the vocabulary's rows (padded to an even count)
    assert split.model.model.embed_tokens.weight.shape[0] == split.model.lm_head.weight.shape[0] == (vocab + 1) // 2
    assert (split.model.lm_head.weight is split.model.model.embed_tokens.weight) == model.config.tie_word_embeddings
    assert split.model.logits(torch.zeros(2, model.config.hidden_size)).shape == (2, vocab)  # padding never sampled
    return split, whole, weights


def rank_part(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's half of a dense model's weight, cut as a trainer sharded like the engine holds it."""
    if any(part in name for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")):
        return tensor.chunk(2, dim=0)[dist.get_rank()]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return tensor.chunk(2, dim=1)[dist.get_rank()]
    return tensor


def injected_outputs(engine: LLMEngine, hidden_size: int) -> list[list[int]]:
    """NLA: sampled tokens with vectors written over (or added to) some prompt tokens' embeddings."""
    vectors = torch.randn(len(PROMPTS), hidden_size, generator=torch.Generator().manual_seed(5))
    injections = [Injection(position=len(prompt) // 2, vector=vector, mode=("replace", "add")[index % 2])
                  if index != 2 else None for index, (prompt, vector) in enumerate(zip(PROMPTS, vectors))]
    sequences = engine.generate(PROMPTS, SAMPLINGS["sampled"], injections)
    return [sequence.generated_token_ids for sequence in sequences]


def check_injection_and_noise(split: LLMEngine, whole: LLMEngine, weights: dict) -> None:
    """NLA's injected vectors and AQN's noised weights (each rank noises the whole tensors, then keeps its
    part, as PolicyRollout does) give the split engine the whole engine's tokens."""
    hidden = whole.model.config.hidden_size
    injected = injected_outputs(split, hidden)
    assert injected == injected_outputs(whole, hidden)
    assert injected != [sequence.generated_token_ids for sequence in whole.generate(PROMPTS, SAMPLINGS["sampled"])]
    clean = outputs(whole)
    noise = NoiseInjection(weights={name: tensor.numel() for name, tensor in weights.items() if "proj" in name},
                           total_steps=4, sigma_start=0.05, sigma_end=0.01, num_stages=2, seed=7)
    whole.load_weights(noise.apply(list(weights.items()), step=3))
    split.load_weights(noise.apply(list(weights.items()), step=3))
    noisy = outputs(split)
    compare(noisy, outputs(whole), "noised weights")
    assert [tokens for tokens, _ in noisy["sampled"]] != [tokens for tokens, _ in clean["sampled"]]


def check_fp8(scratch: Path) -> None:
    """FP8 generation split over both ranks: each rank quantises its own part as it loads and at an update
    (a column-parallel weight's scales are the whole engine's rows; a row-parallel weight's come from the
    rank's own columns), and the tokens are the whole FP8 engine's up to that difference in scales."""
    model = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    weights = dict(model.state_dict())
    for step, factor in enumerate((1.0, 0.8)):
        sent = {name: tensor * factor for name, tensor in weights.items()}
        if step == 0:
            whole = LLMEngine(model.config, sent.items(), engine_config(max_num_seqs=4, quantization="fp8"))
            split = LLMEngine(model.config, sent.items(),
                              engine_config(max_num_seqs=4, tensor_parallel_size=2, quantization="fp8"))
        else:
            whole.load_weights(sent.items())
            split.load_weights(sent.items())
        rank, attention = dist.get_rank(), split.model.model.layers[1].self_attn
        whole_attention = whole.model.model.layers[1].self_attn
        assert attention.q_proj.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(attention.q_proj.weight_scale, whole_attention.q_proj.weight_scale.chunk(2)[rank])
        own_columns = sent["model.layers.1.self_attn.o_proj.weight"].chunk(2, dim=1)[rank]
        assert torch.equal(attention.o_proj.weight_scale, own_columns.abs().amax(dim=1) / 448)
        split_out, whole_out = outputs(split)["greedy"], outputs(whole)["greedy"]
        first_tokens = [(a[0][0], b[0][0]) for a, b in zip(split_out, whole_out)]
        assert sum(a == b for a, b in first_tokens) >= len(first_tokens) - 1, first_tokens
        gaps = [abs(a[1][0] - b[1][0]).item() for a, b in zip(split_out, whole_out)]
        assert max(gaps) < 0.2, gaps


def check_unseeded(split: LLMEngine) -> None:
    """Without a seed, the ranks (their random states apart, as in a run) still draw the same tokens: the replica
    takes one seed for the call. Else the prefill's draws (from the gathered logits) part them."""
    torch.manual_seed(1000 + dist.get_rank())
    for sampling in (SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=6),
                     SamplingParams(n=2, temperature=1.0, max_new_tokens=6)):
        tokens = [sequence.generated_token_ids for sequence in split.generate(PROMPTS, sampling)]
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, tokens)
        assert every_rank[0] == every_rank[1], (sampling, every_rank)


def main(scratch: str) -> None:
    dist.init_process_group("gloo")
    for what, (arch, overrides) in MODELS.items():
        split, whole, weights = split_and_whole(what, arch, overrides, Path(scratch))
        compare(outputs(split), outputs(whole), what)
        changed = {name: tensor * 1.5 for name, tensor in weights.items()
                   if any(part in name for part in ("mlp", "o_proj", "embed_tokens", "lm_head"))}
        whole.load_weights(changed.items())
        split.load_weights(changed.items())
        compare(outputs(split), outputs(whole), f"{what} after update_weights")
        if what == "qwen2":  # every weight sent as each rank's own part
            changed = {name: tensor * 0.9 for name, tensor in weights.items()}
            whole.load_weights(changed.items())
            split.load_weights((name, rank_part(name, tensor)) for name, tensor in changed.items())
            compare(outputs(split), outputs(whole), f"{what} after update_weights with each rank's part")
            check_injection_and_noise(split, whole, changed)
            check_unseeded(split)
    check_fp8(Path(scratch))
    if dist.get_rank() == 0:
        (Path(scratch) / "done").write_text("ok")
    shutdown_distributed()  # a barrier first: a rank tearing the group down while the other still uses it aborts


if __name__ == "__main__":
    main(sys.argv[1])
