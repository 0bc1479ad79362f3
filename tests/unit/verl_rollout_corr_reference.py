"""verl's rollout correction, ported as an independent check of ember's
(`verl/trainer/ppo/rollout_corr_helper.py` and `verl/utils/debug/metrics.py` at verl commit
b178a3c, Apache-2.0, Copyright 2025 Bytedance Ltd. and/or its affiliates).

The computations are verl's line for line (its masked mean divides by count + 1e-8);
argument checks, type hints and the DataProto wrapping are dropped, and a few branches that
the tests never reach are folded. Not imported by ember.
"""

import math

import torch

SAFETY_BOUND = 20.0
TOKEN_LEVEL = {"token_k1", "token_k2", "token_k3"}


def masked_sum(values, mask, axis=None):
    return (values * mask).sum() if axis is None else (values * mask).sum(axis=axis)


def masked_mean(values, mask, axis=None):
    s = masked_sum(values, mask, axis)
    return s / (mask.sum() + 1e-8) if axis is None else s / (mask.sum(axis=axis) + 1e-8)


def parse_thresholds(options, spec):
    raw = [str(spec)] if isinstance(spec, int | float) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(raw) == 1 and len(options) > 1:
        raw = raw * len(options)
    out = {}
    for option, s in zip(options, raw):
        if option.endswith("k1"):
            lower_s, upper_s = s.split("_", 1) if "_" in s else (str(1.0 / float(s)), s)
            out[option] = {"lower": float(lower_s), "upper": float(upper_s)}
        else:
            out[option] = {"lower": None, "upper": float(s)}
    return out


def rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold):
    options = []
    for opt in (o.strip() for o in rollout_rs.split(",") if o.strip()):
        if opt not in options:
            options.append(opt)
    specs = parse_thresholds(options, rollout_rs_threshold)
    safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    k = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    mask_bool = response_mask.bool()
    seq_valid = response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics = {}

    def seq_max(values):
        neg_inf = torch.tensor(float("-inf"), dtype=values.dtype)
        m = values.masked_fill(~mask_bool, neg_inf).max(dim=-1).values
        return torch.where(m == neg_inf, torch.zeros_like(m), m)

    for name in options:
        is_k1 = name.endswith("k1")
        upper, lower = specs[name]["upper"], specs[name]["lower"]
        lower_log, upper_log = (math.log(lower), math.log(upper)) if is_k1 else (None, None)
        token_stat = k[name[-2:]]
        per_seq = None
        if name in TOKEN_LEVEL:
            stat = token_stat
            keep = (stat >= lower_log) & (stat <= upper_log) if is_k1 else stat <= upper
        else:
            kind = name.split("_")[1]
            seq = {"sum": lambda v: masked_sum(v, response_mask, axis=-1),
                   "mean": lambda v: masked_mean(v, response_mask, axis=-1), "max": seq_max}[kind](token_stat)
            seq_keep = (seq >= lower_log) & (seq <= upper_log) if is_k1 else seq <= upper
            per_seq = seq
            keep = seq_keep.unsqueeze(-1).expand_as(mask_bool)
            stat = seq.unsqueeze(-1).expand_as(response_mask)
        metrics.update(rs_metrics(name, stat, response_mask, seq_valid, "token" if name in TOKEN_LEVEL else "sequence",
                                  per_seq, upper_log if is_k1 else upper, lower_log if is_k1 else 0.0, is_k1))
        keep_f = keep.to(dtype=log_ratio.dtype)
        combined = combined * keep_f
        seq_keep_all = (~((~keep) & mask_bool)).all(dim=-1)
        metrics[f"rollout_rs_{name}_masked_fraction"] = masked_mean(1 - keep_f, response_mask).item()
        sv = seq_valid.float()
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = (((1.0 - seq_keep_all.float()) * sv).sum() / sv.sum()).item()
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask).item()
    final_keep = (combined > 0.5) & mask_bool
    metrics["rollout_rs_seq_masked_fraction"] = (~final_keep & mask_bool).any(dim=-1).float().mean().item()
    return (response_mask * combined).to(dtype=response_mask.dtype), metrics


def rs_metrics(name, stat, response_mask, seq_valid, level, per_seq, upper, lower, apply_lower):
    p = f"rollout_rs_{name}"
    mask_bool = response_mask.bool()
    seq_values = per_seq if per_seq is not None else masked_mean(stat, response_mask, axis=-1)
    sv = seq_values[seq_valid]
    m = {f"{p}_mean": masked_mean(stat, response_mask).item()}
    if level == "sequence":
        m[f"{p}_max"], m[f"{p}_min"] = sv.max().item(), sv.min().item()
        m[f"{p}_fraction_high"] = (sv > upper).float().mean().item()
        m[f"{p}_fraction_low"] = (sv < lower).float().mean().item() if apply_lower else 0.0
    else:
        m[f"{p}_max"] = stat.masked_fill(~mask_bool, float("-inf")).max().item()
        m[f"{p}_min"] = stat.masked_fill(~mask_bool, float("inf")).min().item()
        m[f"{p}_fraction_high"] = masked_mean((stat > upper).float(), response_mask).item()
        m[f"{p}_fraction_low"] = masked_mean((stat < lower).float(), response_mask).item() if apply_lower else 0.0
    clamped = stat.clamp(min=lower if apply_lower else 0.0, max=upper)
    mean_c = masked_mean(clamped, response_mask)
    m[f"{p}_std"] = torch.sqrt(torch.clamp(masked_mean(clamped.square(), response_mask) - mean_c.square(), min=0.0)).item()
    m[f"{p}_seq_mean"], m[f"{p}_seq_std"] = sv.mean().item(), sv.std().item()
    m[f"{p}_seq_max"], m[f"{p}_seq_min"] = sv.max().item(), sv.min().item()
    m[f"{p}_seq_max_deviation"] = (sv - 0.0).abs().max().item()
    m[f"{p}_seq_fraction_high"] = (sv > upper).float().mean().item()
    if apply_lower:
        m[f"{p}_seq_fraction_low"] = (sv < lower).float().mean().item()
    return m


def is_weights(log_ratio, response_mask, rollout_is, threshold, batch_normalize):
    if rollout_is == "token":
        for_metrics = log_ratio
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        for_metrics = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(for_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    weights = weights * response_mask
    metrics = is_metrics(weights, for_metrics, response_mask, rollout_is, threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            seq_w = masked_mean(weights, response_mask, axis=-1)
            seq_mask = (response_mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            mean = (seq_w * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def is_metrics(weights, for_metrics, response_mask, rollout_is, threshold):
    m = {}
    lower = 1.0 / threshold
    log_up, log_low = torch.log(torch.tensor(threshold)), torch.log(torch.tensor(lower))
    if rollout_is == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(for_metrics.max(), max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(for_metrics.min()).item()
        m["rollout_is_mean"] = masked_mean(weights, response_mask).item()
        m["rollout_is_ratio_fraction_high"] = (for_metrics > log_up).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (for_metrics < log_low).float().mean().item()
    else:
        m["rollout_is_mean"] = masked_mean(weights, response_mask).item()
        m["rollout_is_ratio_fraction_high"] = masked_mean((weights > threshold).float(), response_mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((weights < lower).float(), response_mask).item()
        mask_bool = response_mask.bool()
        m["rollout_is_max"] = weights.masked_fill(~mask_bool, float("-inf")).max().item()
        m["rollout_is_min"] = weights.masked_fill(~mask_bool, float("inf")).min().item()
    w = weights.clamp(min=lower, max=threshold)
    mean_c = masked_mean(w, response_mask)
    m["rollout_is_std"] = torch.sqrt(torch.clamp(masked_mean(w.square(), response_mask) - mean_c.square(), min=0.0)).item()
    normalized = w / (mean_c + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized.square(), response_mask).item()
    seq_w = masked_mean(weights, response_mask, axis=-1)
    m["rollout_is_seq_mean"], m["rollout_is_seq_std"] = seq_w.mean().item(), seq_w.std().item()
    m["rollout_is_seq_max"], m["rollout_is_seq_min"] = seq_w.max().item(), seq_w.min().item()
    m["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max().item()
    m["rollout_is_seq_fraction_high"] = (seq_w > threshold).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (seq_w < lower).float().mean().item()
    return m


def offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask):
    m = {}
    mean_train = masked_mean(old_log_prob, response_mask, axis=-1)
    m["training_ppl"] = torch.exp(-mean_train).mean().item()
    m["training_log_ppl"] = (-mean_train).mean().item()
    m["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    log_ratio = old_log_prob - rollout_log_prob
    m["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()
    mean_rollout = masked_mean(rollout_log_prob, response_mask, axis=-1)
    m["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    m["rollout_log_ppl"] = (-mean_rollout).mean().item()
    diff = mean_rollout - mean_train
    m["log_ppl_diff"], m["log_ppl_abs_diff"] = diff.mean().item(), diff.abs().mean().item()
    m["log_ppl_diff_max"], m["log_ppl_diff_min"] = diff.max().item(), diff.min().item()
    m["ppl_ratio"] = torch.exp(diff).mean().item()
    rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    m["chi2_token"] = (masked_mean(rho.square(), response_mask) - 1.0).item()
    log_sum = torch.clamp(masked_sum(log_ratio, response_mask, axis=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * log_sum).mean() - 1.0).item()
    return m


def debug_metrics(old_log_probs, rollout_log_probs, response_mask):
    """verl/utils/debug/metrics.py: calculate_debug_metrics."""
    mask = response_mask.bool()
    actor_probs, rollout_probs = torch.exp(old_log_probs), torch.exp(rollout_log_probs)
    pearson = torch.corrcoef(torch.stack([torch.masked_select(actor_probs, mask),
                                          torch.masked_select(rollout_probs, mask)]))[0][1].item()
    diff = torch.masked_select(torch.abs(actor_probs - rollout_probs), mask)
    return {"training/rollout_probs_diff_valid": 1, "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_mean": diff.mean().item(), "training/rollout_probs_diff_std": diff.std().item(),
            "training/rollout_actor_probs_pearson_corr": pearson}


def rollout_correction(old_log_prob, rollout_log_prob, response_mask, rollout_is, rollout_is_threshold,
                       rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold):
    """compute_rollout_correction_and_rejection_mask: weights, mask and prefixed metrics."""
    log_ratio = old_log_prob - rollout_log_prob
    metrics, weights, mask = {}, None, response_mask.clone()
    if rollout_is is not None:
        weights, m = is_weights(log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(m)
    if rollout_rs is not None:
        mask, m = rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics.update(m)
    metrics.update(offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, mask, {f"rollout_corr/{key}": value for key, value in metrics.items()}
