"""Trimming a generated row at its first stop token, for an engine that generates past it (transformers `generate`).

The log-prob convention every engine follows (log_softmax(raw_logits / temperature) at the sampled token,
top-k and top-p not part of it) is `ember.inference.sampling`'s `log_prob_temperature` and `token_log_probs`.
"""

from __future__ import annotations

from ember.rollout.base import FinishReason


def trim_response(
    token_ids: list[int], stop_token_ids: tuple[int, ...], ignore_eos: bool
) -> tuple[list[int], FinishReason]:
    """Cut a generated row just after its first stop token (dropping the padding after it).

    Returns the response and why it finished: "stop" if it ends with a stop token, else
    "length". With ignore_eos stop tokens are ordinary tokens and nothing is cut.
    """
    if not ignore_eos:
        stops = set(stop_token_ids)
        for position, token in enumerate(token_ids):
            if token in stops:
                return token_ids[: position + 1], "stop"
    return token_ids, "length"
