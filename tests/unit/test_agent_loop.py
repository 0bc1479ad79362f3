"""The agent loop (ember/agent/loop.py) on a scripted engine: the engine's API (submit, step, has_unfinished)
with each sample's turns written in advance, so every token, mask and tool turn is known.

The scripted model writes its tool call one character per token, a split the tokenizer would never make:
re-tokenising the history from text would change those tokens, and the tests compare the exact ids."""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque

import pytest

from ember.agent import AgentLoop, AgentOptions
from ember.agent.tools.base import BaseTool, ToolResponse
from ember.agent.tools.gsm8k import Gsm8kTool
from ember.agent.turns import ToolTurnRenderer
from ember.inference.request import SamplingParams
from ember.inference.sequence import Sequence
from ember.models.tiny import IM_END, train_tiny_tokenizer


def schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": "", "parameters": {}}}


class ScriptedEngine:
    """Turn k of sample i generates scripts[i][k] (cut at its token budget), one request per step, in the
    order requests were submitted; records every submission and step."""

    def __init__(self, scripts: dict[int, list[list[int]]]):
        self.scripts = scripts
        self.queue: deque[Sequence] = deque()
        self.turns = Counter()
        self.submissions: list[tuple[int, list[int], int]] = []  # (sample, context, max_new_tokens)
        self.steps: list[tuple[int, int, float]] = []  # (sample, turn, time)
        self.holds: list[bool] = []  # each submit's hold_kv
        self.continued: list[int] = []  # samples whose next turn came through continue_turn
        self.released: list[int | None] = []  # release_kv's arguments, in order

    def request_seed(self, seed):  # one rank: the call's seed as given
        return seed

    def continue_turn(self, sequence_id, token_ids, seed, max_new_tokens):
        self.continued.append(sequence_id)
        self.submit(token_ids, [seed], max_new_tokens, sequence_id)

    def release_kv(self, sequence_id=None):
        self.released.append(sequence_id)

    def submit(self, token_ids, seeds, max_new_tokens, first_sequence_id=0, injection=None, hold_kv=False):
        self.holds.append(hold_kv)
        for offset, seed in enumerate(seeds):
            sequence = Sequence(sequence_id=first_sequence_id + offset, prompt_length=len(token_ids),
                                token_ids=list(token_ids), seed=seed, max_new_tokens=max_new_tokens)
            self.submissions.append((sequence.sequence_id, list(token_ids), max_new_tokens))
            self.queue.append(sequence)

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self, sampling: SamplingParams) -> list[Sequence]:
        sequence = self.queue.popleft()
        turn = self.turns[sequence.sequence_id]
        self.turns[sequence.sequence_id] += 1
        tokens = self.scripts[sequence.sequence_id][turn][:sequence.max_new_tokens]
        sequence.extend(tokens, [-0.25] * len(tokens))
        sequence.finish_reason = "stop" if tokens[-1] in sampling.stop_token_ids else "length"
        self.steps.append((sequence.sequence_id, turn, time.monotonic()))
        return [sequence]


class SleepingTool(BaseTool):
    """Blocks its thread for config["seconds"] (a tool that hangs), then answers "slept"."""

    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(self.config["seconds"])
        return ToolResponse(text="slept"), 0.0, {}


class EchoTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return f"echo {parameters.get('text')}", 0.0, {}


class RaisingTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("the tool broke")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


def per_character(tokenizer, text: str) -> list[int]:
    """`text` as one token per character (a split the tokenizer's own encoding never makes)."""
    return [token for character in text for token in tokenizer.encode(character, add_special_tokens=False)]


def call(tokenizer, name: str, arguments: str) -> list[int]:
    text = f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'
    return per_character(tokenizer, text) + [tokenizer.convert_tokens_to_ids(IM_END)]


def answer(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(IM_END)]


def sampling_for(tokenizer, max_new_tokens: int = 400, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.convert_tokens_to_ids(IM_END),),
                          seed=3)


def run(loop: AgentLoop, prompts, sampling, extra_infos=None):
    return loop.generate(prompts, sampling, extra_infos)


def test_a_tool_turn_is_appended_as_tokens_and_masked_out(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    first = call(tokenizer, "calc_gsm8k_reward", '{"answer": "4"}')
    second = answer(tokenizer, "#### 4")
    engine = ScriptedEngine({0: [first, second]})
    loop = AgentLoop(engine, tokenizer, {"calc_gsm8k_reward": Gsm8kTool({}, schema("calc_gsm8k_reward"))},
                     AgentOptions())
    extra = {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "4"}}}}

    (output,) = run(loop, [prompt], sampling_for(tokenizer, 400), [extra])

    tool_turn = output.token_ids[len(first):len(output.token_ids) - len(second)]
    assert tokenizer.decode(tool_turn) == ("\n<|im_start|>tool\nCurrent parsed answer='4' reward=1.0<|im_end|>\n"
                                           "<|im_start|>assistant\n")
    assert tool_turn == ToolTurnRenderer(tokenizer).render(["Current parsed answer='4' reward=1.0"], first[-1])
    assert output.token_ids == first + tool_turn + second
    assert output.response_mask == [1] * len(first) + [0] * len(tool_turn) + [1] * len(second)
    assert output.log_probs == [-0.25] * len(first) + [0.0] * len(tool_turn) + [-0.25] * len(second)
    # the second turn is asked with exactly the sampled tokens, not a re-tokenised history
    (_, context_1, budget_1), (_, context_2, budget_2) = engine.submissions
    assert context_1 == prompt and budget_1 == 400
    assert context_2 == prompt + first + tool_turn and budget_2 == 400 - len(first) - len(tool_turn)
    assert tokenizer.encode(tokenizer.decode(context_2), add_special_tokens=False) != context_2
    # the first turn held its KV blocks, the second continued over them; the sample's blocks went back at its end
    assert engine.holds[0] and engine.continued == [0] and engine.released == [0, None]
    stats = output.agent
    assert (stats.assistant_turns, stats.tool_turns, stats.tool_calls, stats.tool_errors) == (2, 1, 1, 0)
    assert stats.tool_rewards == {"calc_gsm8k_reward": 1.0} and output.finish_reason == "stop"


def test_a_hung_tool_fails_its_call_at_the_limit_while_other_samples_keep_generating(tokenizer):
    prompt = tokenizer.encode("hello")
    hang = call(tokenizer, "sleep", "{}")
    echo = call(tokenizer, "echo", '{"text": "hi"}')
    engine = ScriptedEngine({0: [hang, answer(tokenizer, "gave up")],
                             1: [echo, echo, answer(tokenizer, "done")]})
    tools = {"sleep": SleepingTool({"seconds": 30}, schema("sleep")), "echo": EchoTool({}, schema("echo"))}
    loop = AgentLoop(engine, tokenizer, tools, AgentOptions(tool_timeout=0.5))
    started = time.monotonic()

    hung, other = run(loop, [prompt, prompt], sampling_for(tokenizer))

    assert time.monotonic() - started < 5  # the hung call was given up at 0.5 s, not awaited for 30
    assert hung.agent.tool_errors == 1 and other.agent.tool_errors == 0
    assert "no answer within 0.5 s (multi_turn.tool_timeout)" in tokenizer.decode(hung.token_ids)
    assert tokenizer.decode(hung.token_ids).endswith("gave up<|im_end|>")
    # sample 1 took all three turns while sample 0's tool hung: no barrier per turn
    order = [(sample, turn) for sample, turn, _ in engine.steps]
    assert order.index((1, 2)) < order.index((0, 1))
    assert other.agent.assistant_turns == 3 and other.agent.tool_turns == 2


def test_failed_unknown_and_malformed_calls_are_counted_and_the_sample_goes_on(tokenizer):
    prompt = tokenizer.encode("hello")
    malformed = per_character(tokenizer, "<tool_call>{not json}</tool_call>") + answer(tokenizer, "")
    engine = ScriptedEngine({0: [call(tokenizer, "broken", "{}"), call(tokenizer, "nowhere", "{}"), malformed]})
    loop = AgentLoop(engine, tokenizer, {"broken": RaisingTool({}, schema("broken"))}, AgentOptions())

    (output,) = run(loop, [prompt], sampling_for(tokenizer))

    text = tokenizer.decode(output.token_ids)
    assert "Error when executing tool: the tool broke" in text
    assert "Error when executing tool: no tool named 'nowhere'; the tools are broken" in text
    stats = output.agent
    assert (stats.tool_calls, stats.tool_errors, stats.malformed_tool_calls, stats.assistant_turns) == (2, 2, 1, 3)


def test_turn_limits_and_the_response_budget_end_a_sample(tokenizer):
    prompt = tokenizer.encode("hello")
    echo = call(tokenizer, "echo", '{"text": "hi"}')
    tools = {"echo": EchoTool({}, schema("echo"))}

    limited = AgentLoop(ScriptedEngine({0: [echo] * 5}), tokenizer, tools, AgentOptions(max_assistant_turns=2))
    (output,) = run(limited, [prompt], sampling_for(tokenizer))
    assert (output.agent.assistant_turns, output.agent.tool_turns, output.finish_reason) == (2, 1, "stop")

    user_limited = AgentLoop(ScriptedEngine({0: [echo] * 5}), tokenizer, tools, AgentOptions(max_user_turns=1))
    (output,) = run(user_limited, [prompt], sampling_for(tokenizer))
    assert (output.agent.assistant_turns, output.agent.tool_turns) == (2, 1)

    # room for the first turn but not for its tool turn: the tool turn is dropped and the sample ends at length
    engine = ScriptedEngine({0: [echo] * 5})
    (output,) = run(AgentLoop(engine, tokenizer, tools, AgentOptions()), [prompt], sampling_for(tokenizer, len(echo) + 3))
    assert output.token_ids == echo and output.response_mask == [1] * len(echo) and output.finish_reason == "length"

    # a turn cut by the budget (no stop token) is not parsed for calls
    engine = ScriptedEngine({0: [echo] * 5})
    (output,) = run(AgentLoop(engine, tokenizer, tools, AgentOptions()), [prompt], sampling_for(tokenizer, 10))
    assert output.token_ids == echo[:10] and output.agent.tool_calls == 0 and output.finish_reason == "length"


def test_parallel_calls_beyond_the_limit_are_dropped_and_long_responses_cut(tokenizer):
    prompt = tokenizer.encode("hello")
    two_calls = (per_character(tokenizer, '<tool_call>{"name": "echo", "arguments": {"text": "aaaaaaaaaaaa"}}'
                                          '</tool_call><tool_call>{"name": "echo", "arguments": {"text": "b"}}'
                                          '</tool_call>') + answer(tokenizer, ""))
    engine = ScriptedEngine({0: [two_calls, answer(tokenizer, "ok")]})
    loop = AgentLoop(engine, tokenizer, {"echo": EchoTool({}, schema("echo"))},
                     AgentOptions(max_parallel_calls=1, max_tool_response_length=8, tool_response_truncate_side="left"))
    (output,) = run(loop, [prompt], sampling_for(tokenizer))
    assert output.agent.tool_calls == 1
    assert "<|im_start|>tool\necho aaa...(truncated)<|im_end|>" in tokenizer.decode(output.token_ids)
