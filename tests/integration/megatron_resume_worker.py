"""Worker: a Megatron engine (actor, then critic) trained three times, saved, trained once more; a second engine
loaded from the save and trained once. Writes, per role, how far the loaded engine's outputs are from the saved
one's, the two next updates' loss and grad norm, how far the outputs are after them, and the Adam step counts.

Usage: python megatron_resume_worker.py OUT_FILE PARAM_DTYPE (one process, CPU, megatron_on_cpu's stand-ins)."""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from megatron_on_cpu import stand_in_cuda  # noqa: E402

stand_in_cuda()

import torch  # noqa: E402
from fsdp_engine_worker import make_batch, make_model_dir, mean_log_prob_loss  # noqa: E402

from ember.engines.megatron.engine import MegatronEngine  # noqa: E402
from ember.engines.megatron.options import MegatronOptions  # noqa: E402
from ember.engines.optim import OptimOptions  # noqa: E402


def value_loss(output, batch, context):
    error = (output.values - 0.5) ** 2 * batch.response_mask
    return error.sum() / context.num_tokens, {}


def adam_steps(engine) -> list[float]:
    return sorted({float(state["step"]) for optimizer in getattr(engine.optimizer, "chained_optimizers",
                                                                 [engine.optimizer])
                   for state in optimizer.optimizer.state.values() if "step" in state})


def main(out_file: str, param_dtype: str) -> None:
    work = Path(out_file).parent
    model_dir = make_model_dir("qwen2", str(work / "model"))
    batch = make_batch(samples=8)
    results = {}
    for role, loss in (("actor", mean_log_prob_loss), ("critic", value_loss)):
        def build():
            return MegatronEngine(MegatronOptions(model_path=model_dir, role=role, param_dtype=param_dtype,
                                                  optim=OptimOptions(lr=1e-3, weight_decay=0.01, clip_grad=1.0)))

        def outputs(engine):
            output = engine.forward(batch, micro_batch_size=4)
            return output.values if role == "critic" else output.log_probs

        engine = build()
        for _ in range(3):
            engine.train_mini_batch(batch, loss, micro_batch_size=4)
        engine.save(str(work / f"checkpoint-{role}"))
        saved = outputs(engine)
        continued = engine.train_mini_batch(batch, loss, micro_batch_size=4)
        resumed = build()
        resumed.load(str(work / f"checkpoint-{role}"))
        loaded_steps = adam_steps(resumed)
        loaded = (outputs(resumed) - saved).abs().max().item()
        again = resumed.train_mini_batch(batch, loss, micro_batch_size=4)
        results[role] = {"loaded_diff": loaded, "next": (continued["loss"], continued["grad_norm"]),
                         "next_resumed": (again["loss"], again["grad_norm"]),
                         "after_diff": (outputs(resumed) - outputs(engine)).abs().max().item(),
                         "loaded_adam_steps": loaded_steps}
    torch.save(results, out_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
