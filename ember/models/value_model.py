"""The value model (PPO critic): a causal LM's backbone with a scalar head on every position.

It is Hugging Face's `...ForTokenClassification` with one label, so it saves and loads as an
ordinary HF model, and starts from a causal-LM checkpoint by reusing the backbone and
initialising the head. The value at position t estimates the return of the state that ends
at token t, so the value "before response token i" is read at position P-1+i, the same
position whose logits predict that token.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PretrainedConfig

from ember.data.batch import Batch
from ember.data.packing import pack_batch


def value_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of a causal-LM (or value-model) config describing the value model.

    One output label, and no dropout before the head: HF's default of 0.1 would make the
    values noisy during training and differ from those of the same weights in eval mode.
    """
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


def compute_response_values(model: nn.Module, batch: Batch, *, packed: bool = False) -> torch.Tensor:
    """[b, R] float32 values before each response token, zero outside `response_mask`.

    With `packed` the model runs on the real tokens only, in one row (ember/data/packing.py).
    """
    if packed:
        packing = pack_batch(batch)
        output = model(input_ids=packing.input_ids, attention_mask=None, position_ids=packing.position_ids,
                       use_cache=False, **packing.attention_kwargs())
        values = packing.unpack(output.logits[0, packing.prediction_index, 0].float())
    else:
        output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False)
        values = output.logits[:, batch.response_prediction_positions, 0].float()
    return values * batch.response_mask
