"""Two gloo ranks: ember's generation engine split over both (tensor parallel 2) against the whole engine
on each rank, on tiny fp32 models: greedy tokens, sampled tokens (T=0.7, top-p 0.9) and every token's
log-prob must agree; an update of the weights reaches both halves; a model the ranks cannot split
(MoE) is refused by name. Arguments: the output file (rank 0 writes the results there)."""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ember.errors import UserError  # noqa: E402
from ember.inference import LLMEngine  # noqa: E402
from ember.rollout.base import SamplingParams  # noqa: E402
from test_inference_engine import PROMPTS, engine_config, tiny_model  # noqa: E402

SAMPLINGS = {"greedy": SamplingParams(n=1, do_sample=False, max_new_tokens=12, seed=3),
             "sampled": SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=12, seed=3)}


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


def main(out_file: str) -> None:
    dist.init_process_group("gloo")
    for arch in ("qwen2", "llama", "qwen3"):
        model = tiny_model(arch, num_attention_heads=4, num_key_value_heads=2)
        weights = dict(model.state_dict())
        whole = LLMEngine(model.config, weights.items(), engine_config(max_num_seqs=4))
        split = LLMEngine(model.config, weights.items(), engine_config(max_num_seqs=4, tensor_parallel_size=2))
        assert split.model.num_kv_heads == 1 and split.kv_cache.block_shape[2] == 1
        compare(outputs(split), outputs(whole), arch)
        changed = {name: tensor * 1.5 for name, tensor in weights.items() if "mlp" in name or "o_proj" in name}
        whole.load_weights(changed.items())
        split.load_weights(changed.items())
        compare(outputs(split), outputs(whole), f"{arch} after update_weights")
    moe = tiny_model("qwen2_moe")
    try:
        LLMEngine(moe.config, moe.state_dict().items(), engine_config(tensor_parallel_size=2))
        raise AssertionError("a MoE model was split")
    except UserError as error:
        assert "mixture-of-experts" in str(error), error
    if dist.get_rank() == 0:
        Path(out_file).write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
