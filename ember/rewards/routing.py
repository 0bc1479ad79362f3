"""The built-in reward function: pick a scorer by the sample's data_source.

Runs that set neither ``custom_reward_function.path`` nor ``data.reward_fn`` score with
``default_compute_score``. It knows the data_source names that verl's preprocessing scripts
write (``openai/gsm8k``, ``lighteval/MATH``, ``math_dapo``, ...) and ember's built-in tasks, routed as
verl routes them; anything else is a configuration error, raised rather than scored as zero, because it
would fail for every sample of that dataset. The run checks its datasets' sources when it loads them
(`unknown_sources`), so a rare unknown source stops the run at once, not at the first batch holding it.
"""

from collections.abc import Callable, Iterable

from ember.rewards import arithmetic, gsm8k, math, math_dapo
from ember.rewards.contract import RewardConfigError

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
    "deepscaler",
)
# verl's DAPO scorer (+1 / -1 on the last `Answer:` line): "math_dapo" itself and every AIME set ("aime24", ...)
DAPO_SOURCE, DAPO_SOURCE_PREFIX = "math_dapo", "aime"
# DAPO's other variants ("math_dapo_reasoning", ...): the boxed-answer equivalence scorer
MATH_SOURCE_PREFIXES = ("math_dapo",)
ARITHMETIC_SOURCE_PREFIXES = ("ember/arithmetic", "arithmetic")


def _scorer(data_source: str) -> Callable[[str, object], float | dict] | None:
    """The built-in scorer `(solution_str, ground_truth)` of `data_source`, or None."""
    if data_source in GSM8K_SOURCES:
        return lambda solution, truth: gsm8k.compute_score(solution, truth, method="strict")
    if data_source == DAPO_SOURCE or data_source.startswith(DAPO_SOURCE_PREFIX):
        return math_dapo.compute_score
    if data_source in MATH_SOURCES or data_source.startswith(MATH_SOURCE_PREFIXES):
        return math.compute_score
    if data_source.startswith(ARITHMETIC_SOURCE_PREFIXES):
        return arithmetic.compute_score
    return None


def default_compute_score(
    data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None
) -> float | dict:
    """Score one response with the built-in scorer for its data_source."""
    scorer = _scorer(data_source)
    if scorer is None:
        raise RewardConfigError(unknown_sources_message([data_source]))
    return scorer(solution_str, ground_truth)


def unknown_sources(data_sources: Iterable[str]) -> list[str]:
    """The data sources among `data_sources` that no built-in scorer knows, sorted."""
    return sorted(source for source in set(data_sources) if _scorer(source) is None)


def unknown_sources_message(sources: list[str]) -> str:
    """What to do about data sources without a built-in scorer."""
    known = (
        list(GSM8K_SOURCES)
        + [DAPO_SOURCE, f"{DAPO_SOURCE_PREFIX}*"]
        + list(MATH_SOURCES)
        + [f"{prefix}*" for prefix in MATH_SOURCE_PREFIXES + ARITHMETIC_SOURCE_PREFIXES]
    )
    names = ", ".join(repr(source) for source in sources)
    return (
        f"no built-in reward function for data_source {names}; known data sources: "
        f"{', '.join(known)}. To score this dataset, write "
        "compute_score(data_source, solution_str, ground_truth, extra_info) in a Python file and "
        "set custom_reward_function.path=<that file> (and custom_reward_function.name if the "
        "function has another name)"
    )
