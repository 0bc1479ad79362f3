"""The grammar of `algorithm.rollout_correction.rollout_rs` and `rollout_rs_threshold` (verl's).

`rollout_rs` is a comma-separated list of rejection options that must all pass;
`rollout_rs_threshold` gives one threshold shared by all options or one per option. A k1
option (a log-ratio, ideal 0) takes a ratio range "lower_upper", or one number u meaning
1/u_u; the others (k2, k3: divergences, ideal 0) take one upper bound. Parsed here, without
torch, so validation and the trainer read the keys the same way.
"""

from __future__ import annotations

TOKEN_REJECTION_OPTIONS = ("token_k1", "token_k2", "token_k3")
REJECTION_OPTIONS = TOKEN_REJECTION_OPTIONS + (
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

Bounds = tuple[float | None, float]  # (lower ratio bound of a k1 option else None, upper bound)


def parse_rejection(rollout_rs: str, rollout_rs_threshold: str | float | None) -> dict[str, Bounds]:
    """Each distinct option of `rollout_rs`, in order, with its bounds; ValueError names what is wrong."""
    options: list[str] = []
    for option in (part.strip() for part in rollout_rs.split(",")):
        if option and option not in options:
            if option not in REJECTION_OPTIONS:
                raise ValueError(f"unknown rollout_rs option {option!r}: use one of {', '.join(REJECTION_OPTIONS)}")
            options.append(option)
    if not options:
        raise ValueError(f"rollout_rs={rollout_rs!r} names no option")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold (e.g. 0.999_1.001 for seq_mean_k1, 0.01 for seq_mean_k3)")
    spec = rollout_rs_threshold
    parts = [str(spec)] if isinstance(spec, int | float) else [part.strip() for part in spec.split(",") if part.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold={spec!r} gives {len(parts)} thresholds for {len(options)} options: "
                         "give one shared by all or one per option")
    parts = parts * len(options) if len(parts) == 1 else parts
    return {option: _bounds(option, part) for option, part in zip(options, parts)}


def _bounds(option: str, text: str) -> Bounds:
    try:
        if option.endswith("k1"):
            lower_text, upper_text = text.split("_", 1) if "_" in text else (None, text)
            upper = float(upper_text)
            lower = 1.0 / upper if lower_text is None else float(lower_text)
        elif "_" in text:
            raise ValueError("only k1 options take a range lower_upper")
        else:
            lower, upper = None, float(text)
    except (ValueError, ZeroDivisionError) as error:
        raise ValueError(f"rollout_rs_threshold {text!r} for {option}: {error}") from None
    if not upper > 0 or (lower is not None and not lower > 0):
        raise ValueError(f"rollout_rs_threshold {text!r} for {option}: thresholds must be positive")
    return lower, upper
