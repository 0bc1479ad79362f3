"""Built-in verifiable arithmetic tasks, generated from a seed, in the RL format and as SFT warm-starts.

Tasks (data source `ember/arithmetic/<task>`), each with `digits` digits per operand:
- `add2`: "What is 59 + 63?"
- `add3`: "What is 12 + 34 + 56?"
- `mul2x1`: "What is 47 * 6?" (the second factor always one digit, 2 to 9)
- `mul`: "What is 482 * 317?" (both factors of `digits` digits: with 3, a product a calculator makes reachable)
- `word`: "Tom has 12 apples. Tom buys 7 more and gives 5 away. How many apples does Tom have now?"
Problems are unique by their arithmetic, so a train and a test set drawn together
(`make_arithmetic_splits`) never share a problem. Generation is a pure function of
(task, count, seed, digits): the first k problems are the same whatever count is asked.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.data.parquet import DatasetError, write_parquet_files

ARITHMETIC_TASKS = ("add2", "add3", "mul2x1", "mul", "word")
ARITHMETIC_INSTRUCTION = "Give the final answer after ####."
_NAMES = ("Tom", "Anna", "Sam", "Lena", "Omar", "Mia")


@dataclass(frozen=True)
class ArithmeticProblem:
    """One generated problem."""

    question: str  # the question as the user reads it
    expression: str  # the arithmetic it asks for, as Python evaluates it: "59 + 63"
    answer: int  # the value of the expression

    @property
    def worked_answer(self) -> str:
        """The reply a model should learn: the expression, its value, and the value after ####."""
        return f"{self.expression} = {self.answer}\n#### {self.answer}"


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def draw_problem(task: str, rng: random.Random, digits: int) -> ArithmeticProblem:
    """One random problem of `task`."""
    if task == "add2":
        a, b = _operand(rng, digits), _operand(rng, digits)
        return ArithmeticProblem(f"What is {a} + {b}?", f"{a} + {b}", a + b)
    if task == "add3":
        a, b, c = (_operand(rng, digits) for _ in range(3))
        return ArithmeticProblem(f"What is {a} + {b} + {c}?", f"{a} + {b} + {c}", a + b + c)
    if task == "mul2x1":
        a, b = _operand(rng, digits), rng.randint(2, 9)
        return ArithmeticProblem(f"What is {a} * {b}?", f"{a} * {b}", a * b)
    if task == "mul":
        a, b = _operand(rng, digits), _operand(rng, digits)
        return ArithmeticProblem(f"What is {a} * {b}?", f"{a} * {b}", a * b)
    if task == "word":
        name, a, b = rng.choice(_NAMES), _operand(rng, digits), _operand(rng, digits)
        c = rng.randint(0, min(a + b, 10**digits - 1))  # never more than there is, so never negative
        question = (
            f"{name} has {a} apples. {name} buys {b} more and gives {c} away. "
            f"How many apples does {name} have now?"
        )
        return ArithmeticProblem(question, f"{a} + {b} - {c}", a + b - c)
    raise ValueError(f"unknown arithmetic task {task!r}; choose one of {', '.join(ARITHMETIC_TASKS)}")


def make_arithmetic_problems(task: str, count: int, seed: int, digits: int = 2) -> list[ArithmeticProblem]:
    """`count` problems of `task` with distinct expressions, the same for the same arguments."""
    if digits < 1:
        raise DatasetError(f"--digits must be at least 1, got {digits}")
    rng = random.Random(seed)
    problems: dict[str, ArithmeticProblem] = {}
    for _ in range(20 * count + 1000):
        if len(problems) == count:
            break
        problem = draw_problem(task, rng, digits)
        problems.setdefault(problem.expression, problem)
    if len(problems) < count:
        raise DatasetError(
            f"task {task!r} with {digits} digits has too few distinct problems for {count}; "
            "lower --train-size / --test-size or raise --digits"
        )
    return list(problems.values())


def arithmetic_rl_row(task: str, problem: ArithmeticProblem, split: str, index: int) -> dict[str, Any]:
    """The RL row (verl's format) for one problem."""
    return {
        "data_source": f"ember/arithmetic/{task}",
        "prompt": [{"role": "user", "content": f"{problem.question} {ARITHMETIC_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "question": problem.question,
            "expression": problem.expression,
            "answer": problem.worked_answer,
        },
    }


CALCULATOR_SYSTEM = ("You can use a calculator. To use it, write exactly "
                     '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call> '
                     "and wait for its answer. Give the final answer after ####.")
CALCULATOR_EXAMPLE = [
    {"role": "user", "content": "What is 123 * 456?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}'
                                     "\n</tool_call>"},
    {"role": "tool", "content": "56088"},
    {"role": "assistant", "content": "123 * 456 = 56088\n#### 56088"}]
"""One worked exchange before the question: a small instruct model copies a format it has seen far more often
than it follows a described one (SmolLM2-135M made no tool call from the system prompt alone, 2026-11-27)."""


def calculator_prompt(question: str) -> list[dict[str, str]]:
    """The chat messages asking `question` of a model with the calculator (`agent/tools/calculator.py`) at
    hand: how to call it, one worked exchange through it, then the question."""
    return [{"role": "system", "content": CALCULATOR_SYSTEM}, *CALCULATOR_EXAMPLE, {"role": "user", "content": question}]


def with_calculator(row: dict[str, Any]) -> dict[str, Any]:
    """An arithmetic RL row asked with the calculator at hand (`calculator_prompt`); the rest unchanged."""
    return {**row, "prompt": calculator_prompt(row["extra_info"]["question"])}


def make_arithmetic_rows(task: str, n: int, seed: int, digits: int = 2, split: str = "train") -> list[dict[str, Any]]:
    """`n` RL rows of `task`; the first rows of `make_arithmetic_splits` with the same seed."""
    problems = make_arithmetic_problems(task, n, seed, digits)
    return [arithmetic_rl_row(task, problem, split, index) for index, problem in enumerate(problems)]


def make_arithmetic_splits(
    task: str, train_size: int, test_size: int, seed: int, digits: int = 2
) -> dict[str, list[dict[str, Any]]]:
    """RL rows for a train and a test split that share no problem."""
    problems = make_arithmetic_problems(task, train_size + test_size, seed, digits)
    return {
        "train": [arithmetic_rl_row(task, problem, "train", i) for i, problem in enumerate(problems[:train_size])],
        "test": [arithmetic_rl_row(task, problem, "test", i) for i, problem in enumerate(problems[train_size:])],
    }


def sft_row_from_rl_row(row: dict[str, Any]) -> dict[str, Any]:
    """An SFT row (`messages`: the prompt, then the worked answer as the assistant's reply)."""
    return {"messages": row["prompt"] + [{"role": "assistant", "content": row["extra_info"]["answer"]}]}


def write_synthetic(
    task: str,
    output_dir: str | os.PathLike,
    train_size: int = 2000,
    test_size: int = 200,
    seed: int = 0,
    digits: int = 2,
) -> dict[str, Path]:
    """Write `train.parquet`, `test.parquet` (RL rows) and `sft.parquet` (worked train answers) to
    `output_dir`, as a set (all three or none)."""
    splits = make_arithmetic_splits(task, train_size, test_size, seed, digits)
    outputs = {"train": splits["train"], "test": splits["test"],
               "sft": [sft_row_from_rl_row(row) for row in splits["train"]]}
    paths = write_parquet_files({Path(output_dir) / f"{name}.parquet": rows for name, rows in outputs.items()})
    return dict(zip(outputs, paths))
