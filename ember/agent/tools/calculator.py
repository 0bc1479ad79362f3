"""A calculator: the model sends an arithmetic expression (`{"expression": "347 * 586"}`), the tool answers its
value. Numbers, + - * / // % **, unary signs and parentheses; nothing else is evaluated (the expression is
parsed, never run), so a call cannot reach names, attributes or functions. Exponents above `max_exponent`
(config, default 64) and results beyond `max_digits` digits (config, default 64) are refused, so a call
cannot stall the run with a huge power. An expression it cannot take is an answer that says why ("Error:
..."), as verl's tools answer failures; the agent loop counts only calls that raise.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from ember.agent.tools.base import BaseTool, ToolResponse

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression and returns its value.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
"""The calculator's tool schema (OpenAI function format), as a tool config's `tool_schema` gives it."""


class CalculatorTool(BaseTool):
    """Evaluates arithmetic expressions; see the module docstring."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        if not isinstance(expression, str) or not expression.strip():
            return ToolResponse(text='Error: give {"expression": "..."}, e.g. {"expression": "347 * 586"}'), 0.0, {}
        try:
            value = self.evaluate(expression)
        except (ValueError, ZeroDivisionError, OverflowError, SyntaxError) as error:
            return ToolResponse(text=f"Error: {error}"), 0.0, {}
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return ToolResponse(text=str(value)), 0.0, {}

    def evaluate(self, expression: str) -> int | float:
        tree = ast.parse(expression.strip(), mode="eval")
        return self._value(tree.body)

    def _value(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.config.get("max_exponent", 64):
                raise ValueError(f"exponent {right} is larger than {self.config.get('max_exponent', 64)}")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and len(str(abs(value))) > self.config.get("max_digits", 64):
                raise ValueError(f"the result has more than {self.config.get('max_digits', 64)} digits")
            return value
        raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")
