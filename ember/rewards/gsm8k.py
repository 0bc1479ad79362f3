"""Reward for GSM8K-style word problems: the model's final number against the reference.

By default the score is exactly verl's (`verl.utils.reward_score.gsm8k.compute_score`, the
same in verl 0.9), so reward curves compare across the two. Only the last
``TAIL_CHARS`` characters of the response are read, and the answer is compared as a string
with the ground truth as the dataset stores it (``ember preprocess gsm8k`` writes the final
number without commas, as verl's preprocessing does):

- ``strict``: the number after the last ``#### `` (``####``, one space, then digits, ``.``
  and ``,`` with an optional leading ``-``), commas removed. ``####72``, ``#### $72`` and
  ``\\boxed{72}`` are no answer; ``#### 72.00`` is a wrong one.
- ``flexible``: the last run of those characters that is not a lone ``.``, as written
  (commas kept).

``normalize=True`` scores with ember's answer normalisation instead, more forgiving of how
models write numbers: ``\\boxed{N}`` counts as a marked answer, ``####`` needs no space,
``$``, thousands separators, trailing ``.0`` and a final period are dropped on both sides, a
full GSM8K solution as ground truth gives its final number, and ``flexible`` prefers a marked
answer anywhere in the response over the last number (strict still reads the tail only).
Set it from the config with
``data.reward_fn='{_target_: ember.rewards.gsm8k.compute_score, normalize: true}'``.

A correct answer earns ``score``; an answer that was found but is wrong earns
``format_score``; a response with no answer earns 0.

verl compares the extracted string with the ground truth as it is, so a dataset that stores the
answer as a number (an integer column in the parquet file) scores every response 0 there,
silently. ember compares an integer ground truth as its digits (``72`` as ``"72"``) and stops at
any other non-string one (a float, None, a list) with an error that says to store the final
number as a string; the reward manager counts and reports it.
"""

import numbers
import re

from ember.rewards.extraction import last_marked_answer, last_number, normalize_number

TAIL_CHARS = 300  # as verl: the final answer sits at the end, and a regex over a long degenerate output is slow
METHODS = ("strict", "flexible")

_NUMBER_CHARACTERS = r"-?[0-9.,]+"
_STRICT_PATTERN = re.compile(r"#### (" + _NUMBER_CHARACTERS + ")")
_FLEXIBLE_PATTERN = re.compile(_NUMBER_CHARACTERS)


def extract_answer(solution_str: str, method: str = "strict", normalize: bool = False) -> str | None:
    """The model's final answer (see the module docstring for each method), or None if it gave none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method must be one of {METHODS}, got {method!r}")
    tail = solution_str[-TAIL_CHARS:]
    if normalize:
        if method == "strict":
            return last_marked_answer(tail)
        marked = last_marked_answer(solution_str)
        return marked if marked is not None else last_number(solution_str)
    if method == "strict":
        found = _STRICT_PATTERN.findall(tail)
        return found[-1].replace(",", "") if found else None
    found = _FLEXIBLE_PATTERN.findall(tail)
    if not found:
        return None
    numbers = [candidate for candidate in found if candidate != "."]
    # When every match is a lone "." verl's loop ends on one of them: an answer that matches nothing.
    return numbers[-1] if numbers else "."


def reference_answer(ground_truth) -> str:
    """The reference answer, normalised; a full GSM8K solution ("... #### 72") gives its final number."""
    text = str(ground_truth)
    if "####" in text:
        marked = last_marked_answer(text)
        if marked is None:
            raise ValueError(f"gsm8k ground truth has '####' but no number after it: {text!r}")
        return marked
    return normalize_number(text)


def compute_score(
    solution_str: str,
    ground_truth,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    normalize: bool = False,
) -> float:
    """``score`` if the extracted answer equals the reference, ``format_score`` if an answer was
    extracted but is wrong, 0 if none was found; verl's rules unless ``normalize``."""
    answer = extract_answer(solution_str, method, normalize)
    if answer is None:
        return 0.0
    expected = reference_answer(ground_truth) if normalize else verl_reference(ground_truth)
    return score if answer == expected else format_score


def verl_reference(ground_truth) -> str:
    """The ground truth as verl's comparison reads it: a string as stored, an integer as its digits."""
    if isinstance(ground_truth, str):
        return ground_truth
    if isinstance(ground_truth, numbers.Integral) and not isinstance(ground_truth, bool):
        return str(int(ground_truth))
    raise TypeError(f"gsm8k ground truth must be the final number as a string (e.g. '72'), got "
                    f"{type(ground_truth).__name__} {ground_truth!r}: store reward_model.ground_truth as a string "
                    "(`ember preprocess gsm8k` does), or score with normalize=True")
