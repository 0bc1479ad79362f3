"""NLA's reconstructor (the critic): the vector predicted from the explanation's text.

The prediction is `hidden_states[L]` in transformers' indexing at the last real token of each
sequence: L = 0 is the input embeddings' output, 0 < L < layers the output of decoder layer L
before any final norm, and L = layers (or -1 / None) the model's final output, after its final
norm. It is read by a forward hook on that module, so the same code serves the padded and the
packed layouts and a model cut after layer N (`truncate_at_layer`): the layers above N, whose
outputs nothing reads, are not built at all. A cut model keeps the full model's layer count in
its config (`FULL_LAYERS_KEY`), so index N still means decoder layer N's own output after the
cut is exported and loaded again.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from ember.data.batch import Batch
from ember.data.packing import pack_batch

FULL_LAYERS_KEY = "nla_full_num_hidden_layers"
"""Config attribute of a cut reconstructor: the decoder layers of the model it was cut from."""


def full_layer_count(config: PretrainedConfig) -> int:
    """Decoder layers of the uncut model (the config's own count for a model never cut)."""
    return getattr(config, FULL_LAYERS_KEY, None) or config.num_hidden_layers


def truncated_config(config: PretrainedConfig, keep_layers: int | None) -> PretrainedConfig:
    """A copy of `config` with only the first `keep_layers` decoder layers (None, or at least the model's
    count: unchanged), remembering the full count."""
    if keep_layers is None or keep_layers >= config.num_hidden_layers:
        return config
    if keep_layers < 1:
        raise ValueError(f"truncate_at_layer={keep_layers}: keep at least one decoder layer")
    config = copy.deepcopy(config)
    setattr(config, FULL_LAYERS_KEY, full_layer_count(config))
    config.num_hidden_layers = keep_layers
    if isinstance(getattr(config, "layer_types", None), list):  # one entry per layer (attention kinds)
        config.layer_types = config.layer_types[:keep_layers]
    return config


def hidden_state_index(layer_index: int | None, full: int, kept: int) -> int:
    """`layer_index` (None: the last; negative: from the end) as an index into the full model's
    `full + 1` hidden states, checked against the model's size and the `kept` layers a cut model
    has: 0 reads the embeddings, `full` with every layer kept the final norm, i decoder layer i."""
    index = full if layer_index is None else layer_index
    if not -(full + 1) <= index <= full:
        raise ValueError(f"output_layer_index={layer_index}: the model has {full} decoder layers, so use 0..{full} "
                         f"or -{full + 1}..-1 counted from the end (-1 = the last)")
    index %= full + 1  # hidden_states has full + 1 entries
    if index > kept:
        raise ValueError(f"output_layer_index={index} reads decoder layer {index}, but this model keeps only its "
                         f"first {kept} layers (truncate_at_layer); use an index of at most {kept}")
    return index


def prediction_module(model: nn.Module, layer_index: int | None) -> nn.Module:
    """The module whose output is `hidden_states[layer_index]` (see the module docstring)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    full, layers = full_layer_count(model.config), body.layers
    index = hidden_state_index(layer_index, full, len(layers))
    if index == 0:
        return model.get_input_embeddings()
    return body.norm if index == full and len(layers) == full else layers[index - 1]


def trained_parameters(model: nn.Module, layer_index: int | None) -> list[nn.Parameter]:
    """The parameters the prediction depends on (the embeddings, the decoder layers up to the read one, the
    final norm when it is read): the only ones that get gradients, so the only ones an optimizer should hold
    (an optimizer over the others would keep state that no checkpoint of the trained ones has)."""
    module = prediction_module(model, layer_index)
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    upstream = [model.get_input_embeddings()]
    if module is body.norm:
        upstream += [*body.layers, body.norm]
    elif module is not upstream[0]:
        upstream += list(body.layers[:list(body.layers).index(module) + 1])
    kept = {id(parameter) for part in upstream for parameter in part.parameters()}
    for parameter in model.parameters():
        parameter.requires_grad_(id(parameter) in kept)
    return [parameter for parameter in model.parameters() if id(parameter) in kept]


def last_token_columns(attention_mask: Tensor) -> Tensor:
    """[b] the column of each sample's last real token in the padded [b, T] layout."""
    mask = attention_mask.bool()
    return mask.shape[1] - 1 - mask.flip(dims=[1]).int().argmax(dim=1)


def last_token_rows(batch: Batch, packed: bool) -> Tensor:
    """Index of each sample's last real token: in the flattened [b * T] padded layout, or the packed row."""
    mask = batch.attention_mask.bool()
    if packed:
        return mask.sum(dim=1).cumsum(dim=0) - 1
    return torch.arange(len(batch), device=mask.device) * mask.shape[1] + last_token_columns(mask)


def compute_reconstruction(model: nn.Module, batch: Batch, layer_index: int | None, *,
                           packed: bool = False) -> Tensor:
    """[b, H] float32: `hidden_states[layer_index]` at each sample's last real token."""
    captured: list[Tensor] = []

    def keep(module: nn.Module, args, output) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output)

    handle = prediction_module(model, layer_index).register_forward_hook(keep)
    try:
        if packed:
            packing = pack_batch(batch)
            model(input_ids=packing.input_ids, attention_mask=None, position_ids=packing.position_ids,
                  use_cache=False, logits_to_keep=1, **packing.attention_kwargs())
        else:
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                  use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    hidden = captured[-1]
    rows = last_token_rows(batch, packed).to(hidden.device)
    return hidden.reshape(-1, hidden.shape[-1])[rows].float()
