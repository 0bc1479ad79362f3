"""torchrun --nproc_per_node=N: ember's engine on real weights split over N GPUs (rollout tensor parallel N,
NCCL) against the whole engine on each GPU, greedy and sampled. Arguments: the model's HF folder, a JSON file of
prompt token ids, the JSON file rank 0 writes: {"whole"|"split": {"greedy"|"sampled": [[tokens, log-probs], ...]}}."""

import json
import os
import sys

import torch
import torch.distributed as dist

from ember.inference import EngineConfig, LLMEngine
from ember.rollout.base import SamplingParams

NEW_TOKENS = 64


def generate(model_dir: str, prompts: list[list[int]], stop: list[int], tensor_parallel_size: int) -> dict:
    engine = LLMEngine.from_pretrained(model_dir, EngineConfig(
        max_model_len=512, max_num_seqs=16, device=f"cuda:{dist.get_rank()}", gpu_memory_utilization=0.3,
        tensor_parallel_size=tensor_parallel_size))
    samplings = {"greedy": SamplingParams(do_sample=False, max_new_tokens=NEW_TOKENS, stop_token_ids=tuple(stop)),
                 "sampled": SamplingParams(n=2, temperature=0.7, top_p=0.9, max_new_tokens=NEW_TOKENS, seed=7,
                                           stop_token_ids=tuple(stop)),
                 "sampled, no cut": SamplingParams(n=2, temperature=0.7, max_new_tokens=NEW_TOKENS, seed=7,
                                                   stop_token_ids=tuple(stop))}  # drawn from the ranks' partials
    result = {name: [[sequence.generated_token_ids, list(sequence.log_probs)]
                     for sequence in engine.generate(prompts, sampling)] for name, sampling in samplings.items()}
    del engine
    torch.cuda.empty_cache()
    return result


def main(model_dir: str, prompts_file: str, out_file: str) -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    with open(prompts_file, encoding="utf-8") as handle:
        given = json.load(handle)
    whole = generate(model_dir, given["prompts"], given["stop"], 1)
    split = generate(model_dir, given["prompts"], given["stop"], dist.get_world_size())
    if dist.get_rank() == 0:
        with open(out_file, "w", encoding="utf-8") as handle:
            json.dump({"whole": whole, "split": split}, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
