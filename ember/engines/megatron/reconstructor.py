"""NLA's reconstructor (the critic of `ember nla train`) on a megatron-core GPTModel.

The prediction is the one `models/reconstructor.py` reads from an HF model: `hidden_states[L]`
in transformers' indexing at each sample's last real token (L = 0 the embedding output,
0 < L < layers decoder layer L's output before any final norm, L = layers or -1 the final
norm's output). A forward hook on that module (`model.embedding`, `model.decoder.layers[L-1]`,
which returns (hidden states, context), or `model.decoder.final_layernorm`) keeps its
sequence-first [s, b, H] output, and for that forward the LM head returns the rows
[last[b], b] instead of logits: no [s, b, vocabulary] tensor is computed, and the model's
output is the prediction, [b, 1, H].

Parameters the prediction does not reach (decoder layers above L, the final norm when an
inner layer is read, an untied LM head) are frozen (`requires_grad` False) before
megatron-core's DDP wraps the model. Its DDP, optimizer and gradient finalisation skip such
parameters: they get no gradient buffer, no Adam state and no weight decay (an optimizer
holding them would decay them on zero gradients every step), and a checkpoint's optimizer
state is the trained parameters' alone, as with FSDP2 (`trained_parameters`).

Packed micro-batches (`use_remove_padding`) work alike: the hooked output is then the packed row
[T, 1, H], and each sample's last token sits at the end of its sequence in it (`last_token_index`).

The layers above L still run in each forward (their outputs feed nothing); a model cut with
`truncate_at_layer` does not build them. Limits: one pipeline stage and no context
parallelism (the read layer, the head and every token on one rank), and full recompute only
with the final norm read (a layer's output inside a recomputed block carries no gradient).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ember.engines.log_probs import replaced_forward
from ember.config.nla_rules import megatron_reconstructor_layout_error
from ember.errors import UserError
from ember.data.batch import Batch
from ember.models.reconstructor import (FULL_LAYERS_KEY, full_layer_count, hidden_state_index, last_token_columns,
                                         last_token_rows, truncated_config)


def check_layout(pipeline_size: int, context_size: int, recompute_granularity: str | None,
                 reads_final_norm: bool) -> None:
    """A UserError for a parallel layout the Megatron reconstructor does not run (see the module docstring)."""
    error = megatron_reconstructor_layout_error(pipeline_size, context_size, recompute_granularity, reads_final_norm)
    if error is not None:
        raise UserError(error)


def cut_model_overrides(model_path: str, hf_overrides: dict, keep_layers: int | None) -> dict:
    """`hf_overrides` (`megatron.override_model_config`, flattened) plus the HF config fields of the model cut
    after `keep_layers` decoder layers (`truncated_config`): mbridge then builds and loads only those layers,
    and an export records the full model's layer count, so L keeps its meaning."""
    from transformers import AutoConfig

    flat = dict(hf_overrides.get("model_config", hf_overrides) or {})
    config = AutoConfig.from_pretrained(model_path)
    for key, value in flat.items():
        setattr(config, key, value)
    cut = truncated_config(config, keep_layers)
    if cut is config:
        return flat
    fields = {"num_hidden_layers": cut.num_hidden_layers, FULL_LAYERS_KEY: full_layer_count(cut)}
    if isinstance(getattr(cut, "layer_types", None), list):
        fields["layer_types"] = cut.layer_types
    return {**flat, **fields}


def prediction_module(model: nn.Module, layer_index: int | None, hf_config) -> nn.Module:
    """The GPTModel module whose output is `hidden_states[layer_index]` (see the module docstring)."""
    full, layers = full_layer_count(hf_config), model.decoder.layers
    try:
        index = hidden_state_index(layer_index, full, len(layers))
    except ValueError as error:
        raise UserError(f"critic.{error}") from None
    if index == 0:
        return model.embedding
    return model.decoder.final_layernorm if index == full and len(layers) == full else layers[index - 1]


def freeze_unreached(model: nn.Module, module: nn.Module) -> None:
    """Only the parameters `module`'s output depends on keep `requires_grad` (the embedding, the decoder layers
    up to the read one, the final norm when it is read); called before DDP wraps the model."""
    layers = list(model.decoder.layers)
    reached = [model.embedding]
    if module is model.decoder.final_layernorm:
        reached += [*layers, module]
    elif module is not model.embedding:
        reached += layers[:layers.index(module) + 1]
    kept = {id(parameter) for part in reached for parameter in part.parameters()}
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) in kept)


def last_token_index(batch: Batch, packed: bool) -> tuple[Tensor, Tensor]:
    """(sequence positions, batch columns) of each sample's last real token in megatron-core's sequence-first
    output: [s, b, H] padded, or the packed row [T, 1, H] (`model_inputs.py`)."""
    if packed:
        rows = last_token_rows(batch, packed=True)
        return rows, torch.zeros_like(rows)
    return last_token_columns(batch.attention_mask), torch.arange(len(batch), device=batch.attention_mask.device)


@contextmanager
def predicting(head: nn.Module, module: nn.Module, last_tokens: tuple[Tensor, Tensor],
               sequence_parallel: bool) -> Iterator[None]:
    """For one forward, `head` (the LM head) returns `module`'s output at each sample's last real token
    (`last_token_index`), [1, b, H], instead of logits. Under sequence parallelism the output is gathered
    first; its backward keeps each rank's slice (every tensor-parallel rank computes the same loss), as the
    value head does."""
    captured: list[Tensor] = []

    def keep(_module: nn.Module, _args, output) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output)

    def prediction_instead_of_logits(hidden: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        read = captured[-1]
        if sequence_parallel:
            from megatron.core import tensor_parallel

            read = tensor_parallel.gather_from_sequence_parallel_region(read, tensor_parallel_output_grad=False)
        return read[last_tokens].unsqueeze(0), None

    handle = module.register_forward_hook(keep)
    try:
        with replaced_forward(head, prediction_instead_of_logits):
            yield
    finally:
        handle.remove()
