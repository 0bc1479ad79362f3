"""Variable-length attention for packed micro-batches: "ember_varlen", a transformers attention function.

A packed micro-batch (`ember/data/packing.py`) is one row of many sequences. transformers'
own sdpa path keeps attention inside each sequence with an explicit block-diagonal mask,
which rules out the flash kernel and builds a [T, T] mask. "ember_varlen" instead calls
PyTorch's flash-attention varlen kernel (`torch.nn.attention.varlen`) with the packed
batch's cumulative sequence lengths, which `compute_response_log_probs` and
`compute_response_values` pass as `cu_seq_lens_q` / `max_length_q` (transformers hands
such keyword arguments down to every attention call). A call without them that has an
attention mask (a padded forward, or `generate` on the same module) runs transformers'
sdpa with that mask; a packed row without them is refused, since nothing would keep its
sequences apart. Options the kernel cannot honour (attention dropout, logit softcapping,
attention sinks) are refused rather than ignored. Grouped-query attention reaches the kernel
with its key/value heads as they are (`enable_gqa`, or passed through where the kernel is
found to take them), repeated per query head only where neither works.

`packed_attention_implementation` picks it for CUDA engines that pack, where the kernel exists.
"""

from __future__ import annotations

import importlib.util
import inspect

import torch
from torch import Tensor, nn

NAME = "ember_varlen"


def varlen_available() -> bool:
    """Whether PyTorch ships the flash-attention varlen kernel and a CUDA device is present."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None and torch.cuda.is_available()


def packed_attention_implementation(configured: str, use_remove_padding: bool, device: torch.device,
                                    compute_dtype: torch.dtype) -> str:
    """The attention implementation an engine loads its model with: "ember_varlen" for packed sdpa on CUDA
    in a half-precision compute dtype (the flash kernel has no float32)."""
    half = compute_dtype in (torch.bfloat16, torch.float16)
    if use_remove_padding and configured == "sdpa" and half and device.type == "cuda" and varlen_available():
        register()
        return NAME
    return configured


def register() -> None:
    """Make "ember_varlen" known to transformers (attention function and mask builder); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    _varlen_parameters()  # both resolved here, before any compiled layer calls the attention
    _groups_heads()
    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask_for_padded_inputs)


def _mask_for_padded_inputs(*args, attention_mask: Tensor | None = None, **kwargs):
    """sdpa's mask where the input has padding; none for packed rows (the varlen kernel needs no mask)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """(1, heads, T, dim) packed queries/keys/values → (1, T, heads, dim), each sequence attending causally to itself."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if attention_mask is None and query.shape[0] == 1 and _restarts(kwargs.get("position_ids")):
            raise ValueError("a packed row reached ember_varlen attention without cu_seq_lens_q / max_length_q: "
                             "pass the packed batch's attention_kwargs() to the model call")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    from torch.nn.attention.varlen import varlen_attn

    unsupported = {"dropout": dropout > 0 and module.training, "softcap": kwargs.get("softcap"),
                   "s_aux": kwargs.get("s_aux") is not None}
    if any(unsupported.values()):
        raise NotImplementedError(
            f"ember_varlen attention cannot apply {', '.join(k for k, v in unsupported.items() if v)}: "
            "set attn_implementation=sdpa (or flash_attention_2 where installed) for this model")
    queries, keys, values = (states[0].transpose(0, 1) for states in (query, key, value))  # (T, heads, dim)
    arguments = _causal_arguments(scaling, sliding_window, queries.shape[-1])
    groups = queries.shape[1] // keys.shape[1]
    if groups > 1 and "enable_gqa" in _varlen_parameters():
        arguments["enable_gqa"] = True  # the kernel reads each key/value head for its group of query heads
    elif groups > 1 and not _groups_heads():
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    cu = cu_seq_lens_q.to(device=queries.device, dtype=torch.int32)
    output = varlen_attn(queries, keys, values, cu, cu, max_length_q, max_length_q, **arguments)
    return output.unsqueeze(0), None


_GROUPS_HEADS: bool | None = None  # one answer per process, read as a plain global by compiled layers


def _groups_heads() -> bool:
    """Whether this PyTorch's `varlen_attn` takes fewer key/value heads than query heads (grouped-query
    attention, no repeated copies) without an `enable_gqa` switch. The flash kernel itself groups
    heads; releases without the switch pass the heads through or refuse them, which no signature
    tells, so it is asked once on a 6-token problem: outputs and all three gradients against
    repeated heads."""
    global _GROUPS_HEADS
    if _GROUPS_HEADS is None:
        with torch.inference_mode(False), torch.enable_grad():  # whatever mode the engine is built in
            _GROUPS_HEADS = "enable_gqa" not in _varlen_parameters() and _grouped_heads_match_repeated()
    return _GROUPS_HEADS


def _grouped_heads_match_repeated() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = {"query": (6, 4, 64), "key": (6, 2, 64), "value": (6, 2, 64)}
    inputs = {name: torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
              for name, shape in shapes.items()}
    cu = torch.tensor([0, 2, 6], device="cuda", dtype=torch.int32)
    arguments = _causal_arguments(None, None, 64)
    try:
        grouped = varlen_attn(inputs["query"], inputs["key"], inputs["value"], cu, cu, 4, 4, **arguments)
        grouped_grads = torch.autograd.grad(grouped.float().square().sum(), list(inputs.values()))
    except (RuntimeError, ValueError):
        return False
    repeated = varlen_attn(inputs["query"], inputs["key"].repeat_interleave(2, dim=1),
                           inputs["value"].repeat_interleave(2, dim=1), cu, cu, 4, 4, **arguments)
    repeated_grads = torch.autograd.grad(repeated.float().square().sum(), list(inputs.values()))
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
               for a, b in zip((grouped, *grouped_grads), (repeated, *repeated_grads)))


def _restarts(position_ids: Tensor | None) -> bool:
    """Whether a [1, T] row of position ids starts over somewhere (several sequences packed)."""
    return position_ids is not None and bool((position_ids[0, 1:] == 0).any())


_VARLEN_PARAMETERS: frozenset[str] = frozenset()


def _varlen_parameters() -> frozenset[str]:
    """The keyword names this PyTorch's varlen_attn takes, read once into a module constant (a plain
    global, so torch.compile reads it instead of tracing `inspect.signature` in every layer)."""
    global _VARLEN_PARAMETERS
    if not _VARLEN_PARAMETERS:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_PARAMETERS = frozenset(inspect.signature(varlen_attn).parameters)
    return _VARLEN_PARAMETERS


def _causal_arguments(scale: float | None, sliding_window: int | None, head_dim: int) -> dict:
    """Causal (and windowed) masking in the form this PyTorch's varlen_attn takes."""
    parameters = _varlen_parameters()
    arguments = {"scale": scale} if "scale" in parameters else {}
    if "scale" not in parameters and scale is not None and abs(scale - head_dim**-0.5) > 1e-9:
        raise NotImplementedError("this PyTorch's varlen attention takes no custom scale: set attn_implementation=sdpa")
    if "window_size" in parameters:
        arguments["window_size"] = (sliding_window - 1 if sliding_window else -1, 0)
    else:
        if sliding_window:
            raise NotImplementedError("this PyTorch's varlen attention has no sliding window: "
                                      "set attn_implementation=sdpa")
        arguments["is_causal"] = True
    return arguments
