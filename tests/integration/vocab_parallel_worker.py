"""Two gloo ranks, each holding half the vocabulary: vocab_parallel_log_probs against the full
log-softmax, values and gradients. Run by tests/integration/test_vocab_parallel_log_probs.py."""

import sys

import torch
import torch.distributed as dist

from ember.engines.megatron.log_probs import vocab_parallel_log_probs
from ember.distributed.device import shutdown_distributed

WEIGHT = 0.5  # the entropy term of the test loss


def main(out_file: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 16, generator=generator, dtype=torch.float64) * 3
    targets = torch.randint(0, 16, (3, 5), generator=generator)
    width = logits.shape[-1] // world
    local = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    log_probs, entropy = vocab_parallel_log_probs(local, targets, None, rank * width, compute_entropy=True,
                                                  entropy_grad=True)
    (log_probs.sum() + WEIGHT * entropy.sum()).backward()
    full = logits.clone().requires_grad_(True)
    expected_log_probs = torch.log_softmax(full, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probabilities = torch.softmax(full, -1)
    expected_entropy = -(probabilities * torch.log_softmax(full, -1)).sum(-1)
    (expected_log_probs.sum() + WEIGHT * expected_entropy.sum()).backward()
    torch.testing.assert_close(log_probs, expected_log_probs.float())
    torch.testing.assert_close(entropy, expected_entropy.float())
    torch.testing.assert_close(local.grad, full.grad[..., rank * width:(rank + 1) * width].to(local.grad.dtype),
                               rtol=1e-5, atol=1e-6)
    if rank == 0:
        with open(out_file, "w") as handle:
            handle.write("ok")
    shutdown_distributed()  # a barrier first: a rank tearing the group down while the other still uses it aborts


if __name__ == "__main__":
    main(sys.argv[1])
