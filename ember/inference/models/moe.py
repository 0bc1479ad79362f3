"""The sparse mixture-of-experts MLP of Qwen2-MoE and Qwen3-MoE for ember's engine, on flat tokens.

Routing: router logits in float32, softmax over all experts, the top-k experts of each
token, their probabilities renormalised to sum to 1 where the config's `norm_topk_prob`
asks. Qwen2-MoE adds a shared expert that every token goes through, scaled by
sigmoid(shared_expert_gate(x)).

The one thing to know is how the experts run: the (token, expert) pairs are sorted by
expert id, so each expert's rows are one contiguous run, and `torch.nn.functional.grouped_mm`
multiplies every run by its expert's weights in one call (one for gate/up, one for down;
`offs` marks where each expert's rows end). There is no Python loop over experts and no
host sync: in bf16 on a GPU of compute capability 9.0+ each call is one CUTLASS kernel that
skips experts without tokens and can be captured in a CUDA graph; elsewhere (CPU, fp32 or
fp16 on GPU) PyTorch itself runs one matmul per expert. Gathering each pair's expert
weights instead (batched gathers) would copy tokens × top_k weight matrices per layer,
far too much memory at prefill.

Weights keep the fused layout of transformers 5 models, so the training engine's
`named_parameters` load by name: `experts.gate_up_proj` (experts, 2 × intermediate,
hidden) with the gate rows first, `experts.down_proj` (experts, hidden, intermediate).
Saved checkpoints name each expert's matrices (`experts.3.gate_proj.weight`);
`Experts.per_expert_views` maps those names onto slices of the fused tensors.

Under tensor parallelism every expert (and the shared expert) holds its share of the intermediate
width, as a dense MLP does; the router and the shared expert's gate stay whole, so every rank
routes alike, and the block's output is a partial sum that the decoder layer's one all-reduce
completes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from ember.inference.models.layers import MLP

# grouped_mm needs every row of its operands to start on a 16-byte boundary.
_GROUPED_MM_ALIGNMENT = 8


@dataclass(frozen=True)
class Routing:
    """Which experts each token goes to and with what weight."""

    weights: Tensor
    """(tokens, top_k) float32: each chosen expert's share of the token's output."""
    expert_ids: Tensor
    """(tokens, top_k) int64: the chosen experts, most probable first."""


def route_tokens(router_logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """Top-k experts of softmax(router_logits) per token; `renormalize` makes their weights sum to 1."""
    probabilities = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights=weights, expert_ids=expert_ids)


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, fused into 3-D tensors; runs each token through its chosen experts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        """intermediate_size: each expert's width on this rank (its share under tensor parallelism)."""
        super().__init__()
        if not hasattr(F, "grouped_mm"):
            raise NotImplementedError(
                f"MoE models in ember's engine need torch.nn.functional.grouped_mm (torch >= 2.10; this is torch "
                f"{torch.__version__}): upgrade torch or use actor_rollout_ref.rollout.name=hf"
            )
        if hidden_size % _GROUPED_MM_ALIGNMENT or intermediate_size % _GROUPED_MM_ALIGNMENT:
            raise NotImplementedError(
                f"ember's engine runs MoE experts with grouped matmuls, which need hidden_size ({hidden_size}) and "
                f"each rank's share of moe_intermediate_size ({intermediate_size}) to be multiples of "
                f"{_GROUPED_MM_ALIGNMENT}; use a smaller actor_rollout_ref.rollout.tensor_model_parallel_size or "
                f"actor_rollout_ref.rollout.name=hf for this model"
            )
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, states: Tensor, routing: Routing) -> Tensor:
        """sum over k of weight_k * expert_k(x), (tokens, hidden), for (tokens, hidden) states."""
        num_tokens, top_k = routing.expert_ids.shape
        sorted_expert_ids, pair_order = torch.sort(routing.expert_ids.flatten(), stable=True)
        experts = torch.arange(self.num_experts, device=states.device)
        expert_row_ends = torch.searchsorted(sorted_expert_ids, experts, right=True).to(torch.int32)
        rows = states[pair_order // top_k]
        gate, up = F.grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=expert_row_ends).chunk(2, dim=-1)
        outputs = F.grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=expert_row_ends)
        weighted = outputs * routing.weights.flatten()[pair_order, None].to(outputs.dtype)
        per_pair = torch.empty_like(weighted)
        per_pair[pair_order] = weighted  # back to (token, k) order: a fixed-order sum, deterministic on GPU too
        return per_pair.view(num_tokens, top_k, -1).sum(dim=1)

    def per_expert_views(self) -> dict[str, dict[str, Tensor]]:
        """Per fused parameter: the checkpoint's per-expert names ('3.gate_proj.weight') and the slices they fill."""
        gate, up = self.gate_up_proj.data.split(self.intermediate_size, dim=1)
        experts = range(self.num_experts)
        gate_up = {f"{expert}.gate_proj.weight": gate[expert] for expert in experts}
        gate_up |= {f"{expert}.up_proj.weight": up[expert] for expert in experts}
        down = {f"{expert}.down_proj.weight": self.down_proj.data[expert] for expert in experts}
        return {"gate_up_proj": gate_up, "down_proj": down}


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: routed experts, plus the gated shared expert where the model has one."""

    def __init__(self, config: PretrainedConfig, shared_expert: bool, tensor_parallel_size: int = 1) -> None:
        """shared_expert: add the gated shared expert (Qwen2-MoE); tensor_parallel_size: ranks the experts'
        widths are split over (this block's output is then this rank's partial sum)."""
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, hidden, config.moe_intermediate_size // tensor_parallel_size)
        self.has_shared_expert = shared_expert
        if shared_expert:
            self.shared_expert = MLP(hidden, config.shared_expert_intermediate_size // tensor_parallel_size, bias=False,
                                     split=tensor_parallel_size > 1)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, states: Tensor) -> Tensor:
        """(tokens, hidden) in, (tokens, hidden) out."""
        # float32 logits: transformers rounds them to the model dtype first, which can flip near-tied experts in bf16
        router_logits = F.linear(states.float(), self.gate.weight.float())
        output = self.experts(states, route_tokens(router_logits, self.top_k, self.renormalize))
        if self.has_shared_expert:
            output = output + torch.sigmoid(self.shared_expert_gate(states)) * self.shared_expert(states)
        return output
