"""How a MoE model's routers spread the tokens of a training step over the experts.

`ExpertLoad` hooks every top-k router of the model (Qwen2-MoE, Qwen3-MoE: modules with `top_k`
and `num_experts` whose forward returns (logits, weights, expert indices)) and counts, per MoE
layer, the real tokens sent to each expert (padding positions excluded by the token mask). The
engine sums the counts over micro-batches and data-parallel ranks; `load_metrics` turns them into
the step's metrics. Routing here is dropless (every token reaches its top-k experts), so no token
is dropped and no metric says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


def _routers(model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules()
            if type(module).__name__.endswith("Router") and hasattr(module, "top_k") and hasattr(module, "num_experts")]


class ExpertLoad:
    """Per-layer token counts of each expert, accumulated while `recording`."""

    def __init__(self, model: nn.Module):
        self.routers = _routers(model)
        self.num_experts = self.routers[0].num_experts if self.routers else 0
        self.counts: Tensor | None = None

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    def reset(self, device: torch.device) -> None:
        self.counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64, device=device)

    @contextmanager
    def recording(self, token_mask: Tensor | None) -> Iterator[None]:
        """Count the routing of the forwards in the block; `token_mask` [tokens] marks the real
        tokens in the routers' flattened order (None: all are real, as in a packed row)."""
        handles = [router.register_forward_hook(self._counter(layer, token_mask))
                   for layer, router in enumerate(self.routers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _counter(self, layer: int, token_mask: Tensor | None):
        def count(module, inputs, output) -> None:
            indices = output[-1].detach()
            if token_mask is not None:
                indices = indices[token_mask.to(indices.device)]
            self.counts[layer] += torch.bincount(indices.reshape(-1), minlength=self.num_experts).to(self.counts)
        return count


def load_metrics(counts: Tensor) -> dict[str, float]:
    """`moe/*` metrics from per-layer expert token counts [layers, experts] of one step."""
    means = counts.mean(dim=1)
    return {"moe/tokens_per_expert_mean": means.mean().item(),
            "moe/tokens_per_expert_max": counts.max().item(),
            "moe/max_over_mean_load": (counts.max(dim=1).values / means.clamp(min=1e-9)).max().item(),
            "moe/dropped_tokens": 0.0}
