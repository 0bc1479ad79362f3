"""The built-in reward function: pick a scorer by the sample's data_source.

Runs that set neither ``custom_reward_function.path`` nor ``data.reward_fn`` score with
``default_compute_score``. It knows the data_source names that verl's preprocessing scripts
write (``openai/gsm8k``, ``lighteval/MATH``, ...) and ember's built-in tasks; anything else
is a configuration error, raised rather than scored as zero, because it would fail for every
sample of that dataset.
"""

from ember.rewards import arithmetic, gsm8k, math
from ember.rewards.contract import RewardConfigError

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
    "deepscaler",
)
# Prefixes: DAPO's "math_dapo" and its variants, AIME sets ("aime24", "aime_2025", ...).
MATH_SOURCE_PREFIXES = ("math_dapo", "aime")
ARITHMETIC_SOURCE_PREFIXES = ("ember/arithmetic", "arithmetic")


def default_compute_score(
    data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None
) -> float:
    """Score one response with the built-in scorer for its data_source."""
    if data_source in GSM8K_SOURCES:
        return gsm8k.compute_score(solution_str, ground_truth, method="strict")
    if data_source in MATH_SOURCES or data_source.startswith(MATH_SOURCE_PREFIXES):
        return math.compute_score(solution_str, ground_truth)
    if data_source.startswith(ARITHMETIC_SOURCE_PREFIXES):
        return arithmetic.compute_score(solution_str, ground_truth)
    known = (
        list(GSM8K_SOURCES)
        + list(MATH_SOURCES)
        + [f"{prefix}*" for prefix in MATH_SOURCE_PREFIXES + ARITHMETIC_SOURCE_PREFIXES]
    )
    raise RewardConfigError(
        f"no built-in reward function for data_source {data_source!r}; known data sources: "
        f"{', '.join(known)}. To score this dataset, write "
        "compute_score(data_source, solution_str, ground_truth, extra_info) in a Python file and "
        "set custom_reward_function.path=<that file> (and custom_reward_function.name if the "
        "function has another name)"
    )
