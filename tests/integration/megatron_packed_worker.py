"""Worker: the Megatron engine padded and packed (`use_remove_padding`) on the same weights, in fp32, one process on
a CPU behind megatron_on_cpu's stand-ins (megatron-core's own GPTModel, rotary embedding, DDP and optimizer).

For each case (the actor with fixed-size and token-budget micro-batches, the critic, NLA's reconstructor, the actor
with NLA's injection) a fresh engine computes its outputs, makes one update and computes them again; the case's
padded run and its packed runs start from the same HF weights. Writes {case: {variant: result}} to OUT_FILE, a
result holding the outputs before and after, the update's metrics and (actor) the updated weights.

Usage: python megatron_packed_worker.py MODEL_DIR OUT_FILE
"""

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from megatron_on_cpu import stand_in_cuda  # noqa: E402

stand_in_cuda()

import dataclasses  # noqa: E402

import torch  # noqa: E402
from fsdp_engine_worker import GRADIENT_REVEALING_OPTIM, make_batch, mean_log_prob_loss  # noqa: E402

from ember.data.batch import Batch  # noqa: E402
from ember.engines.base import MicroBatchSpec  # noqa: E402
from ember.engines.megatron import engine as engine_module  # noqa: E402
from ember.engines.megatron.engine import MegatronEngine  # noqa: E402
from ember.engines.megatron.model_inputs import model_inputs  # noqa: E402
from ember.engines.megatron.options import MegatronOptions  # noqa: E402
from ember.workers.reconstructor import mse_loss, reconstruction_batch  # noqa: E402

HIDDEN = 64  # tiny_model_config's hidden size
BUDGET = MicroBatchSpec(max_token_len=20)  # several micro-batches of regrouped samples
INJECTED_AT = [1, 0, 2, -1, 1, 2, 0, 1]  # prompt tokens (every prompt has at least 3); sample 3 injects nothing


def value_loss(output, batch, context):
    error = (output.values - 0.5) ** 2 * batch.response_mask
    return error.sum() / context.num_tokens, {}


def injected_batch() -> Batch:
    batch = make_batch(samples=8)
    vectors = torch.randn(len(batch), HIDDEN, generator=torch.Generator().manual_seed(1))
    return batch.with_fields(activation_vectors=vectors, injection_positions=torch.tensor(INJECTED_AT))


def reconstructor_batch() -> Batch:
    """Explanations of different lengths after a fixed critic prompt, left-padded; target vectors."""
    generator = torch.Generator().manual_seed(3)
    responses = [torch.randint(3, 120, (length,), generator=generator).tolist() for length in (5, 1, 9, 3, 7, 2)]
    return reconstruction_batch([40, 41, 42], responses, torch.randn(6, HIDDEN, generator=generator), pad_token_id=0)


def outputs(engine: MegatronEngine, batch: Batch, micro) -> dict[str, torch.Tensor]:
    output = engine.forward(batch, micro, compute_entropy=engine.options.role == "actor", temperature=0.7)
    return {name: value for name, value in dataclasses.asdict(output).items() if isinstance(value, torch.Tensor)}


def counting_packed_rows(counter: list[int]):
    """engine.model_inputs, counting the micro-batches it packs (a packed run that fell back to padding fails)."""
    def counted(micro, packed, multiple=1):
        made = model_inputs(micro, packed, multiple)
        counter[0] += made.packing is not None
        return made
    return counted


def run(model_dir: str, role: str, batch: Batch, loss, micro, **options) -> dict:
    engine = MegatronEngine(MegatronOptions(model_path=model_dir, role=role, param_dtype="float32",
                                            optim=GRADIENT_REVEALING_OPTIM, **options))
    packed_rows = [0]
    engine_module.model_inputs = counting_packed_rows(packed_rows)
    result = {"before": outputs(engine, batch, micro)}
    result["metrics"] = engine.train_mini_batch(batch, loss, micro, temperature=0.7)
    result["after"] = outputs(engine, batch, micro)
    if role == "actor":
        result["weights"] = {name: tensor.detach().clone() for bucket in engine.named_parameters_for_sync()
                             for name, tensor in bucket}
    result["packed_rows"] = packed_rows[0]
    if batch.injection_positions is not None:  # what the vectors did: the same forward without them
        result["plain"] = outputs(engine, dataclasses.replace(batch, injection_positions=None), micro)
    return result


def main(model_dir: str, out_file: str) -> None:
    batch = make_batch(samples=8)
    packed = dict(use_remove_padding=True)
    cases = {
        "actor": ("actor", batch, mean_log_prob_loss,
                  {"padded": (2, {}), "packed": (2, packed), "packed_budget": (BUDGET, packed)}),
        "critic": ("critic", batch, value_loss, {"padded": (2, {}), "packed": (BUDGET, packed)}),
        "reconstructor": ("reconstructor", reconstructor_batch(), mse_loss,
                          {"padded": (2, dict(output_layer_index=1)),
                           "packed": (BUDGET, dict(output_layer_index=1, **packed))}),
        "injection": ("actor", injected_batch(), mean_log_prob_loss, {"padded": (2, {}), "packed": (BUDGET, packed)}),
    }
    results = {case: {variant: run(model_dir, role, case_batch, loss, micro, **options)
                      for variant, (micro, options) in variants.items()}
               for case, (role, case_batch, loss, variants) in cases.items()}
    torch.save(results, out_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
