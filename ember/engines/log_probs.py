"""Log-probabilities and entropy of a batch's response tokens under a causal LM.

Only the positions that predict response tokens (P-1 .. P+R-2, see `Batch`) go through
the LM head: the model is asked for those rows alone (`logits_to_keep`), so the
[b, P+R, vocab] logits tensor is never built. Logits are divided by the sampling
temperature in float32, so the log-probs are those of the distribution the rollout
sampled from.

Two switches change how, never what: `packed` runs the model on the real tokens only, in
one row (`ember/data/packing.py`), and `fused` computes the log-probs and entropy from
the last hidden states and the LM head's weight, chunk by chunk, without the fp32 logits
(`ember/engines/fused_log_probs.py`). For the fused path the LM head's forward is replaced,
for the one call, by the fused computation: it then runs inside the model's own forward,
where FSDP2 has gathered the head's weight (and the embedding tied to it), so its gradient
is reduced like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ember.algorithms.entropy import entropy_from_logits, log_probs_from_logits
from ember.data.batch import Batch
from ember.data.packing import pack_batch
from ember.engines.fused_log_probs import fused_log_probs


def compute_response_log_probs(model: nn.Module, batch: Batch, *, temperature: float = 1.0,
                               compute_entropy: bool = False, entropy_grad: bool = False,
                               packed: bool = False, fused: bool = False,
                               aux_losses: list[Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """([b, R] log-probs, [b, R] entropy or None), float32, of `batch.responses` under `model`.

    A MoE model whose config sets `output_router_logits` returns its routers' load-balancing loss
    with the forward; it is appended to `aux_losses` when a list is given.

    The entropy carries gradients only with `entropy_grad` (an entropy bonus in the loss);
    as a metric it is computed from detached logits, so backward keeps nothing for it.
    Positions outside `response_mask` hold values of no meaning (0 when `packed`); callers
    mask them.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: log-probs need a temperature > 0 "
                         "(use 1.0 for greedy rollouts)")
    if packed:
        packing = pack_batch(batch)
        inputs = dict(input_ids=packing.input_ids, attention_mask=None, position_ids=packing.position_ids,
                      **packing.attention_kwargs())
        keep, targets = packing.prediction_index, packing.targets.unsqueeze(0)
    else:
        positions = batch.response_prediction_positions
        inputs = dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
        keep = torch.arange(positions.start, positions.stop, device=batch.input_ids.device)
        targets = batch.responses
    head = _fused_head if fused else _logits_head
    log_probs, entropy, aux_loss = head(model, inputs, keep, targets, temperature, compute_entropy, entropy_grad)
    if aux_losses is not None and aux_loss is not None:
        aux_losses.append(aux_loss)
    if packed:
        return packing.unpack(log_probs), None if entropy is None else packing.unpack(entropy)
    return log_probs, entropy


def _logits_head(model: nn.Module, inputs: dict, keep: Tensor, targets: Tensor, temperature: float,
                 compute_entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Log-probs and entropy (shaped like `targets`) from the model's logits of the `keep` rows, and the
    model's auxiliary (router) loss if it returned one."""
    output = model(**inputs, use_cache=False, logits_to_keep=keep)
    logits = output.logits.float() / temperature
    log_probs = log_probs_from_logits(logits, targets)
    entropy = None
    if compute_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return log_probs, entropy, getattr(output, "aux_loss", None)


def _fused_head(model: nn.Module, inputs: dict, keep: Tensor, targets: Tensor, temperature: float,
                compute_entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """As `_logits_head`, with the LM head computing fused log-probs in place of logits.

    The head's output (what the model returns as `logits`) stacks log-prob and entropy per
    row, so both are outputs of the model's forward, which FSDP2's backward hooks expect.
    """
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}'s LM head has a bias, which fused log-probs leave out; "
                         "set use_fused_kernels=false for this model")
    rescaling = [key for key in _LOGIT_RESCALING if getattr(model.config, key, None) not in (None, 1, 1.0)]
    if rescaling:
        raise ValueError(f"{type(model).__name__} rescales its logits ({', '.join(rescaling)}), which fused "
                         "log-probs leave out; set use_fused_kernels=false for this model")

    def log_probs_instead_of_logits(hidden: Tensor) -> Tensor:
        log_probs, entropy = fused_log_probs(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets.reshape(-1),
                                             temperature=temperature, compute_entropy=compute_entropy,
                                             entropy_grad=entropy_grad)
        return torch.stack([log_probs] if entropy is None else [log_probs, entropy], dim=-1)

    with replaced_forward(head, log_probs_instead_of_logits):
        output = model(**inputs, use_cache=False, logits_to_keep=keep)
    stacked = output.logits.reshape(*targets.shape, -1)
    return stacked[..., 0], stacked[..., 1] if compute_entropy else None, getattr(output, "aux_loss", None)


_LOGIT_RESCALING = ("final_logit_softcapping", "logits_scaling", "logit_scale")
"""Config keys of models whose forward changes the LM head's output (softcapping, scaling)."""


@contextmanager
def replaced_forward(module: nn.Module, forward) -> Iterator[None]:
    """`module` computes `forward` instead of its own for the duration of the block."""
    own = module.__dict__.get("forward")  # a forward set on the instance (by a hook library), kept
    module.forward = forward
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own
