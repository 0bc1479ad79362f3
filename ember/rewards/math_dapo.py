"""verl's DAPO math reward (data_source `math_dapo`, and any `aime*`): +1 for a right final answer, -1 otherwise.

DAPO's prompts ask for the answer on a last line `Answer: $Answer`. The reward reads only the response's last
300 characters, takes the last `Answer:` line there (none: wrong), normalises it and the reference the way
Minerva's evaluation does (the text after the last `=`; units, `\\text{}`, `$`, spaces and thousands separators
removed; shorthand `\\frac12` and `\\sqrt2` written out) and compares the two strings. The dict's `acc` (1 or 0)
is the accuracy metric, so the -1 of a wrong answer does not count as an accuracy of -1; `pred` is the
normalised answer (kept in the dumps, not a metric).

The score is ±1, not 1/0: it matters wherever the reward's scale does (DAPO's overlong penalty, which subtracts
up to 1, and advantages not divided by the group's spread).
"""

from __future__ import annotations

import re

TAIL_CHARACTERS = 300  # the longest MATH-500 answer is 159 characters
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Replaced in order (the article and unit words first, then spacing), as Minerva's normaliser does.
_REPLACEMENTS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                 (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DROPPED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
            ",\\!", "{,}", '"', "\\dots")
# (pattern, replacement) applied in order: the math between the first two `$`, then wrappers unwrapped.
_REWRITES = ((r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"), (r"(\\text\{)(.*?)(\})", "\\2"), (r"(\\textbf\{)(.*?)(\})", "\\2"),
             (r"(\\overline\{)(.*?)(\})", "\\2"), (r"(\\boxed\{)(.*)(\})", "\\2"),
             (r"(frac)([^{])(.)", "frac{\\2}{\\3}"), (r"(sqrt)([^{])", "sqrt{\\2}"))


def normalize_final_answer(answer: str) -> str:
    """A final answer as the comparison sees it (Minerva's normalisation)."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACEMENTS:
        answer = answer.replace(old, new)
    for text in _DROPPED:
        answer = answer.replace(text, "")
    for pattern, replacement in _REWRITES:
        answer = re.sub(pattern, replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """{"score": 1.0 or -1.0, "acc": 1.0 or 0.0, "pred": the normalised answer ("[INVALID]" when none)}."""
    found = ANSWER_LINE.findall(solution_str[-TAIL_CHARACTERS:])
    prediction = normalize_final_answer(found[-1] if found else "[INVALID]")
    correct = prediction == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0, "pred": prediction}
