"""GSM8K's answer-check tool, as verl's `gsm8k_tool.Gsm8kTool`: the model submits an answer, the tool says
whether it is right.

Each sample's instance holds its ground truth (`create(ground_truth=...)`, from the data's
`extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs`, as verl's gsm8k multi-turn preprocessing writes
it). `execute` scores the submitted answer with ember's gsm8k scorer (verl's flexible rule) and answers
"Current parsed answer='72' reward=1.0"; its step reward is 0 when the answer improved on the last one and
-0.05 otherwise (verl's penalty for a resubmission that did not improve). `calc_reward` is the last answer's
score.
"""

from __future__ import annotations

from typing import Any

from ember.agent.tools.base import BaseTool, ToolResponse
from ember.rewards.gsm8k import compute_score


class Gsm8kTool(BaseTool):
    """Answer checking for GSM8K; see the module docstring."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self.instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None, **kwargs) -> str:
        instance_id = await super().create(instance_id)
        self.instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "") if isinstance(parameters, dict) else ""
        answer = answer if isinstance(answer, str) else str(answer)
        instance = self.instances[instance_id]
        instance["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > instance["reward"] else -0.05
        instance["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        instance = self.instances[instance_id]
        if instance["ground_truth"] is None:
            raise ValueError("gsm8k tool: this sample has no ground truth; give extra_info.tools_kwargs."
                             f"{self.name}.create_kwargs.ground_truth in the data")
        return compute_score(instance["response"], instance["ground_truth"], method="flexible", format_score=0.0,
                             score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        self.instances.pop(instance_id, None)
