"""The example's reward: 1 when the number the model marked after its last `####` equals the product, else 0.

The built-in arithmetic reward falls back to the last number of the response when nothing is marked; in a
multi-turn response that can be the calculator's own answer (the tool turn's tokens are part of the decoded
response), which would pay a model for calling the tool and stopping. Here only the model's marked answer
counts. Called as verl calls a custom reward: `compute_score(data_source, solution_str, ground_truth, extra_info)`.
"""

from ember.rewards.extraction import last_marked_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    answer = last_marked_answer(solution_str)
    return float(answer is not None and answer.lstrip("-").isdigit() and int(answer) == int(ground_truth))
