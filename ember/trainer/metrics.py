"""Step metrics with the names verl users know (`critic/score/mean`, `response_length/mean`,
`timing_s/gen`, `perf/throughput`, ...), computed from a finished Batch, plus a phase timer."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ember.data.batch import Batch
from ember.profiling import phase


@contextmanager
def timed(timings: dict[str, float], name: str):
    """Adds the wall time of the block to `timings[name]` (seconds); in a profile it is phase `name`."""
    start = time.perf_counter()
    try:
        with phase(name):
            yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def _masked_values(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return tensor[mask.bool()]


def compute_data_metrics(batch: Batch, max_response_length: int, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values, and response/prompt lengths of one step."""
    mask = batch.response_mask
    response_lengths = mask.sum(-1).float()
    prompt_lengths = (batch.attention_mask.sum(-1) - mask.sum(-1)).float()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", batch.token_level_scores.sum(-1)))
    metrics.update(_stats("critic/rewards", batch.token_level_rewards.sum(-1)))
    metrics.update(_stats("critic/advantages", _masked_values(batch.advantages, mask)))
    metrics.update(_stats("critic/returns", _masked_values(batch.returns, mask)))
    if use_critic and batch.values is not None:
        metrics.update(_stats("critic/values", _masked_values(batch.values, mask)))
    metrics.update(_stats("response_length", response_lengths))
    metrics["response_length/clip_ratio"] = (response_lengths >= max_response_length).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_lengths))
    return metrics


def compute_timing_metrics(timings: dict[str, float], batch: Batch) -> dict[str, float]:
    """`timing_s/<phase>` for every phase and `perf/throughput` in tokens per second."""
    metrics = {f"timing_s/{name}": seconds for name, seconds in timings.items()}
    total_tokens = batch.attention_mask.sum().item()
    metrics["perf/total_num_tokens"] = float(total_tokens)
    if timings.get("step"):
        metrics["perf/throughput"] = total_tokens / timings["step"]
    return metrics


def staleness_metrics(batch: Batch, trained_version: int) -> dict[str, float]:
    """How many updates behind the weights that train on them (`trained_version`) the samples' generating
    weights are: 0 in synchronous training, 1 with one_step_off after its first step, at most
    ceil(async_training.staleness_threshold) + trigger_parameter_sync_step - 1 with fully_async."""
    if batch.policy_versions is None:
        return {}
    lag = (trained_version - batch.policy_versions).float()
    return {"rollout/staleness/mean": lag.mean().item(), "rollout/staleness/max": lag.max().item(),
            "rollout/policy_version/min": float(batch.policy_versions.min())}


def compute_agent_metrics(stats: list, batch: Batch) -> dict[str, float]:
    """Multi-turn rollouts (`AgentStats` per sample): turns per sample, tool calls and failures of the step,
    and response tokens by kind (the model's, counted by response_mask, and the tool turns')."""
    model_tokens = batch.response_mask.sum(-1).float()
    tool_tokens = batch.attention_mask[:, batch.prompt_length:].sum(-1).float() - model_tokens
    metrics = {**_stats("agent/assistant_turns", torch.tensor([s.assistant_turns for s in stats])),
               **_stats("agent/tool_turns", torch.tensor([s.tool_turns for s in stats])),
               **_stats("agent/model_tokens", model_tokens), **_stats("agent/tool_tokens", tool_tokens)}
    for name in ("tool_calls", "tool_errors", "malformed_tool_calls"):
        metrics[f"agent/{name}"] = float(sum(getattr(s, name) for s in stats))
    metrics["agent/model_tokens/total"] = model_tokens.sum().item()
    metrics["agent/tool_tokens/total"] = tool_tokens.sum().item()
    return metrics
