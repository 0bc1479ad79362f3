"""The agent loop: multi-turn rollouts with tools on ember's own engine (`rollout.multi_turn`).

Each sample alternates model turns and tool turns. A model turn is a request to the engine with the
sample's whole context (prompt + every token so far) as its prompt, generating until a stop token or the
response budget. When it finishes, its text is parsed for Hermes tool calls; the calls run in threads
(`tool_session.py`) while the engine goes on stepping every other sample; when they are answered (or
reach `tool_timeout`), the tool turn's tokens (`turns.py`: the new turn's text only, rendered with the
chat template's tool role and tokenised once) are appended and the sample's next model turn is submitted
between two engine steps. No turn waits for the others: there is no barrier per turn.

The one thing to know: a sample's response is the concatenation of exactly the tokens the model sampled and
the tool turns' tokens; `response_mask` is 1 on the former and 0 on the latter (their log-probs are 0), so
the trainer, which runs its forward over these same tokens, scores exactly what was sampled.

A sample ends (as verl's tool agent loop ends it) when a model turn has no tool call, stops without a stop
token (the budget), reaches `max_assistant_turns`, or has had `max_user_turns` tool turns, or when the next
tool turn would not fit in the response length (that turn is then dropped). A finished turn keeps its KV
blocks in the engine (`hold_kv`) while its tools run: the next turn is prefilled from where it ended, the
tool's tokens only (`LLMEngine.continue_turn`), unless the engine needed the room meanwhile (then its whole
context); a sample's blocks go back when it ends.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.agent.tool_parser import parse_hermes_tool_calls
from ember.agent.tool_session import ToolSession, call_outcome
from ember.agent.turns import ToolTurnRenderer, truncate_tool_text
from ember.inference.request import SamplingParams
from ember.inference.sampling import sequence_seed
from ember.rollout.base import AgentStats, RolloutOutput

if TYPE_CHECKING:  # the engine's models and kernels load where an engine is built, not where this is imported
    from ember.inference.engine import LLMEngine
    from ember.inference.sequence import Sequence


@dataclass(frozen=True)
class AgentOptions:
    """`rollout.multi_turn` as the loop reads it."""

    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_timeout: float = 30.0
    reuse_kv: bool = True
    """Continue each turn over the keys and values of the turns before it (False: prefill its whole context)."""


@dataclass
class _Sample:
    """One sample's trajectory so far and what it is waiting for."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    seed: int
    session: ToolSession
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    stats: AgentStats = field(default_factory=AgentStats)
    finish_reason: str | None = None
    calls: list[Future] = field(default_factory=list)
    deadline: float = 0.0
    closing: Future | None = None

    def append(self, token_ids: list[int], log_probs: list[float], from_model: bool) -> None:
        self.token_ids += token_ids
        self.log_probs += log_probs
        self.response_mask += [int(from_model)] * len(token_ids)


class AgentLoop:
    """Multi-turn generation with tools on one `LLMEngine`; see the module docstring."""

    def __init__(self, engine: LLMEngine, tokenizer, tools: dict, options: AgentOptions):
        self.engine = engine
        self.tokenizer = tokenizer
        self.tools = tools
        self.options = options
        self.renderer = ToolTurnRenderer(tokenizer)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams,
                 extra_infos: list[dict] | None = None) -> list[RolloutOutput]:
        """`sampling.n` trajectories per prompt, grouped by prompt; `sampling.max_new_tokens` bounds each whole
        response (model and tool tokens); `extra_infos` (one per prompt) give the tools' `tools_kwargs`."""
        samples: list[_Sample] = []
        request_seed = self.engine.request_seed(sampling.seed)
        for prompt_index, prompt in enumerate(prompts):
            tools_kwargs = (extra_infos[prompt_index] or {}).get("tools_kwargs", {}) if extra_infos else {}
            group = [_Sample(index=len(samples) + sample, prompt_index=prompt_index, prompt_ids=list(prompt),
                             seed=sequence_seed(request_seed, (sampling.first_prompt_index + prompt_index) * sampling.n
                                                + sample),
                             session=ToolSession(self.tools, tools_kwargs, self.options.tool_timeout))
                     for sample in range(sampling.n)]
            self.engine.submit(prompt, [sample.seed for sample in group], sampling.max_new_tokens, group[0].index,
                               hold_kv=self.options.reuse_kv)
            samples += group
        budget = sampling.max_new_tokens
        while self.engine.has_unfinished() or any(sample.calls or sample.closing for sample in samples):
            if self.engine.has_unfinished():
                for sequence in self.engine.step(sampling):
                    self._model_turn_ended(samples[sequence.sequence_id], sequence, budget)
            else:
                self._wait_for_tools(samples)
            now = time.monotonic()
            for sample in samples:
                if sample.calls and (now >= sample.deadline or all(call.done() for call in sample.calls)):
                    self._tool_turn_ended(sample, budget)
                if sample.closing is not None and (now >= sample.deadline or sample.closing.done()):
                    self._closed(sample)
        self.engine.release_kv()  # every turn has ended: nothing is continued any more
        return [RolloutOutput(prompt_index=sample.prompt_index, token_ids=sample.token_ids, log_probs=sample.log_probs,
                              finish_reason=sample.finish_reason, response_mask=sample.response_mask,
                              agent=sample.stats) for sample in samples]

    def _model_turn_ended(self, sample: _Sample, sequence: Sequence, budget: int) -> None:
        new_tokens = sequence.generated_token_ids
        sample.append(new_tokens, sequence.log_probs, from_model=True)
        sample.stats.assistant_turns += 1
        options = self.options
        if sequence.finish_reason != "stop" or len(sample.token_ids) >= budget:
            return self._end(sample, "length")
        if options.max_assistant_turns is not None and sample.stats.assistant_turns >= options.max_assistant_turns:
            return self._end(sample, "stop")
        if options.max_user_turns is not None and sample.stats.tool_turns >= options.max_user_turns:
            return self._end(sample, "stop")
        calls, malformed = parse_hermes_tool_calls(self.tokenizer.decode(new_tokens, skip_special_tokens=False))
        sample.stats.malformed_tool_calls += malformed
        if not calls:
            return self._end(sample, "stop")
        calls = calls[:options.max_parallel_calls]
        sample.stats.tool_calls += len(calls)
        sample.calls, sample.deadline = sample.session.start_calls(calls)

    def _tool_turn_ended(self, sample: _Sample, budget: int) -> None:
        texts = []
        for call in sample.calls:
            text, failed = call_outcome(call, self.options.tool_timeout)
            sample.stats.tool_errors += failed
            texts.append(truncate_tool_text(text, self.options.max_tool_response_length,
                                            self.options.tool_response_truncate_side))
        sample.calls = []
        turn = self.renderer.render(texts, last_model_token=sample.token_ids[-1])
        sample.stats.tool_turns += 1
        if len(sample.token_ids) + len(turn) >= budget:  # no room for the turn and a reply: dropped, as verl does
            return self._end(sample, "length")
        sample.append(turn, [0.0] * len(turn), from_model=False)
        context, new_tokens = sample.prompt_ids + sample.token_ids, budget - len(sample.token_ids)
        if self.options.reuse_kv:
            self.engine.continue_turn(sample.index, context, sample.seed, new_tokens)
        else:
            self.engine.submit(context, [sample.seed], new_tokens, sample.index)

    def _end(self, sample: _Sample, reason: str) -> None:
        sample.finish_reason = reason
        self.engine.release_kv(sample.index)
        if sample.session.instances:
            sample.closing, sample.deadline = sample.session.start_closing()

    def _closed(self, sample: _Sample) -> None:
        if sample.closing.done() and sample.closing.exception() is None:
            rewards, errors = sample.closing.result()
            sample.stats.tool_rewards = rewards
            sample.stats.tool_errors += len(errors)
        else:  # calc_reward/release raised outside a tool, or is still running at its limit
            sample.stats.tool_errors += 1
        sample.closing = None

    def _wait_for_tools(self, samples: list[_Sample]) -> None:
        """Nothing to generate: sleep until a tool call or closing finishes, or the nearest time limit."""
        pending = [future for sample in samples for future in sample.calls + [sample.closing]
                   if future is not None and not future.done()]
        deadlines = [sample.deadline for sample in samples if sample.calls or sample.closing]
        if pending:
            wait(pending, timeout=max(0.0, min(deadlines) - time.monotonic()), return_when=FIRST_COMPLETED)
