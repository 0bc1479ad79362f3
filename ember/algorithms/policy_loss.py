"""Policy-gradient losses: PPO ("vanilla") and GSPO with importance-ratio clipping, and REINFORCE
(rollout correction's bypass mode with `loss_type=reinforce`, chosen by that key, not by name).

Each loss takes the same records, `PolicyLossInputs` (old and new log-probs of the response
tokens, their advantages, the mask) and `ClipConfig`, plus the aggregation arguments of
`aggregate_loss` (mode and, for gradient accumulation, the mini-batch's global counts), and
returns a `PolicyLossOutput`: the scalar loss to back-propagate and detached metrics computed
on this micro-batch. `get_policy_loss_fn(name)` looks a loss up by name. The records are built
by field name and the aggregation arguments are passed by name: old and new log-probs, or the
two counts, could otherwise be swapped without an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.algorithms.loss_aggregation import Count, aggregate_loss
from ember.algorithms.masked import masked_mean, masked_sum
from ember.algorithms.registry import register_policy_loss

LOG_RATIO_LIMIT = 20.0  # |log π - log π_old| is clamped to this before exp, as verl, so the ratio stays finite


@dataclass(frozen=True, kw_only=True)
class ClipConfig:
    """Clip ranges of the importance ratio (verl's `actor.clip_ratio*` fields)."""

    clip_ratio: float = 0.2  # symmetric clip range ε: ratio kept in [1 - ε, 1 + ε]
    clip_ratio_low: float | None = None  # lower ε; None uses clip_ratio
    clip_ratio_high: float | None = None  # upper ε (DAPO clip-higher uses e.g. 0.28); None uses clip_ratio
    clip_ratio_c: float = 3.0  # dual clip: loss of a negative-advantage token is at most clip_ratio_c * |A|

    def __post_init__(self):
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be greater than 1 (dual-clip PPO), got {self.clip_ratio_c}.")
        if self.low < 0 or self.high < 0:
            raise ValueError(f"clip ratios must be non-negative, got low={self.low}, high={self.high}.")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass(frozen=True, kw_only=True)
class PolicyLossInputs:
    """Per-token tensors of a micro-batch, each [B, R]."""

    old_log_probs: torch.Tensor  # log π_old of the sampled tokens (the policy that generated them)
    log_probs: torch.Tensor  # log π of the same tokens under the policy being trained (carries the gradient)
    advantages: torch.Tensor  # advantage of each token
    response_mask: torch.Tensor  # 1 for tokens that count, 0 for padding
    rollout_is_weights: torch.Tensor | None = None  # rollout correction's weights: each token's loss × its weight


@dataclass(frozen=True, kw_only=True)
class PolicyLossOutput:
    """The loss and its metrics; metrics are detached 0-dim tensors (call float() to log)."""

    loss: torch.Tensor  # scalar to back-propagate
    clipfrac: torch.Tensor  # fraction of valid tokens where the clipped branch is the active one
    ppo_kl: torch.Tensor  # mean of log π_old - log π over valid tokens
    clipfrac_lower: torch.Tensor  # fraction of valid tokens capped by the dual clip (negative advantages)


def clipped_surrogate(*, ratio: torch.Tensor, advantages: torch.Tensor,
                      clip: ClipConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic token loss max(-A·r, -A·clip(r)) and where the clipped branch wins."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip.low, 1 + clip.high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _weighted(token_losses: torch.Tensor, inputs: PolicyLossInputs) -> torch.Tensor:
    """Token losses × rollout correction's importance weights (verl applies them after clipping)."""
    return token_losses if inputs.rollout_is_weights is None else token_losses * inputs.rollout_is_weights


@register_policy_loss("vanilla")
def compute_vanilla_policy_loss(
    inputs: PolicyLossInputs,
    clip: ClipConfig,
    *,
    loss_agg_mode: str = "token-mean",
    num_tokens: Count | None = None,
    num_sequences: Count | None = None,
    norm_length: Count | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip and dual clip.

    The token ratio r = π/π_old is clipped to [1 - low, 1 + high]; for negative advantages the
    loss is further capped at clip_ratio_c·|A| (Ye et al. 2019), so a token whose ratio exploded
    cannot dominate the update.
    """
    mask = inputs.response_mask
    log_ratio = torch.clamp(inputs.log_probs - inputs.old_log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    surrogate, clipped = clipped_surrogate(ratio=ratio, advantages=inputs.advantages, clip=clip)
    dual_clip_cap = -inputs.advantages * clip.clip_ratio_c
    negative = inputs.advantages < 0
    token_losses = torch.where(negative, torch.minimum(surrogate, dual_clip_cap), surrogate)
    loss = aggregate_loss(_weighted(token_losses, inputs), mask=mask, mode=loss_agg_mode, num_tokens=num_tokens,
                          num_sequences=num_sequences, norm_length=norm_length)
    with torch.no_grad():
        return PolicyLossOutput(
            loss=loss,
            clipfrac=masked_mean(clipped.to(ratio.dtype), mask=mask),
            ppo_kl=masked_mean(-log_ratio, mask=mask),
            clipfrac_lower=masked_mean(((surrogate > dual_clip_cap) & negative).to(ratio.dtype), mask=mask),
        )


GSPO_LOG_RATIO_MAX = 10.0  # upper clamp of the sequence log-ratio before exp, as verl
GSPO_LOSS_AGG_MODE = "seq-mean-token-mean"  # verl's GSPO aggregates so, whatever loss_agg_mode the run sets


@register_policy_loss("gspo")
def compute_gspo_policy_loss(
    inputs: PolicyLossInputs,
    clip: ClipConfig,
    *,
    loss_agg_mode: str = GSPO_LOSS_AGG_MODE,
    num_tokens: Count | None = None,
    num_sequences: Count | None = None,
    norm_length: Count | None = None,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): clip a sequence-level ratio instead of per-token ones.

    s_i = exp(mean_t(log π - log π_old)) over the sequence's valid tokens. Each token uses
    log s_i,t = log π_t - sg(log π_t) + sg(log s_i): its value is the sequence ratio, its
    gradient flows through the token's own log-prob. Clipped to [1 - low, 1 + high] (GSPO uses
    ranges far smaller than PPO's, e.g. 3e-4 / 4e-4). Aggregated with seq-mean-token-mean
    whatever `loss_agg_mode` says, as the paper and verl (`compute_policy_loss_gspo` passes
    that mode to `agg_loss` itself) do: a run's `actor.loss_agg_mode` still shapes its
    entropy and KL terms, not this one (the argument is taken as every policy loss takes it). No dual clip,
    so clipfrac_lower is 0.
    """
    mask = inputs.response_mask
    log_ratio = inputs.log_probs - inputs.old_log_probs
    lengths = mask.bool().sum(dim=-1).clamp(min=1).to(log_ratio.dtype)
    sequence_log_ratio = masked_sum(log_ratio, mask=mask, dim=-1) / lengths
    token_log_ratio = inputs.log_probs - inputs.log_probs.detach() + sequence_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=GSPO_LOG_RATIO_MAX))
    token_losses, clipped = clipped_surrogate(ratio=ratio, advantages=inputs.advantages, clip=clip)
    loss = aggregate_loss(_weighted(token_losses, inputs), mask=mask, mode=GSPO_LOSS_AGG_MODE, num_tokens=num_tokens,
                          num_sequences=num_sequences, norm_length=norm_length)
    with torch.no_grad():
        return PolicyLossOutput(
            loss=loss,
            clipfrac=masked_mean(clipped.to(ratio.dtype), mask=mask),
            ppo_kl=masked_mean(-log_ratio, mask=mask),
            clipfrac_lower=torch.zeros((), dtype=ratio.dtype, device=ratio.device),
        )


def compute_reinforce_policy_loss(
    inputs: PolicyLossInputs,
    clip: ClipConfig,
    *,
    loss_agg_mode: str = "token-mean",
    num_tokens: Count | None = None,
    num_sequences: Count | None = None,
    norm_length: Count | None = None,
) -> PolicyLossOutput:
    """REINFORCE, verl's `compute_policy_loss_reinforce`: token loss −A·log π (× the importance
    weights when given), no ratio and no clip (`clip` is ignored; clipfracs are 0). `old_log_probs`
    are the rollout's (bypass mode), so `ppo_kl` is the mean of log π_rollout − log π."""
    mask = inputs.response_mask
    token_losses = -inputs.advantages * inputs.log_probs
    loss = aggregate_loss(_weighted(token_losses, inputs), mask=mask, mode=loss_agg_mode, num_tokens=num_tokens,
                          num_sequences=num_sequences, norm_length=norm_length)
    with torch.no_grad():
        zero = torch.zeros((), dtype=inputs.log_probs.dtype, device=inputs.log_probs.device)
        return PolicyLossOutput(loss=loss, clipfrac=zero, clipfrac_lower=zero,
                                ppo_kl=masked_mean(inputs.old_log_probs - inputs.log_probs, mask=mask))
