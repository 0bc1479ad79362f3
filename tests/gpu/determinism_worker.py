"""One process: three updates of the FSDP2 engine (bf16 over fp32 masters, packed micro-batches on the flash
varlen kernel, fused log-probs) on a fixed batch, from the same weights; prints a JSON line of every update's
grad norm and the final log-probs' hash. Arguments: the model folder, "deterministic" or "default"."""

import hashlib
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1])]

from integration.fsdp_engine_worker import engine_options, make_batch, mean_log_prob_loss  # noqa: E402

from ember.engines.base import MicroBatchSpec  # noqa: E402
from ember.engines.fsdp.engine import FSDPEngine  # noqa: E402


def main(model_dir: str, mode: str) -> None:
    engine = FSDPEngine(engine_options(model_dir, param_dtype="bfloat16", use_remove_padding=True,
                                       use_fused_kernels=True, full_determinism=mode == "deterministic"))
    batch = make_batch(samples=8)
    norms = []
    for _ in range(3):
        metrics = engine.train_mini_batch(batch, mean_log_prob_loss, MicroBatchSpec(size=2))
        norms.append(float(metrics["grad_norm"]))
    log_probs = engine.forward(batch, MicroBatchSpec(size=4)).log_probs.float().cpu().numpy().tobytes()
    print(json.dumps({"grad_norms": norms, "log_probs": hashlib.sha256(log_probs).hexdigest()}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
