"""The ``calculator`` environment: arithmetic tasks with a safe ``calculator`` tool (see :mod:`.safe_eval`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from tito_renderers.types import ParsedResponse

from .base import (
    Environment,
    EnvOptions,
    Message,
    RolloutState,
    Score,
    StepResult,
    Task,
    function_schema,
    string_argument,
)
from .generators import arithmetic_tasks
from .safe_eval import MAX_EXPRESSION_CHARS, evaluate, format_result
from .scoring import require_answer, score_final_answer


class CalculatorOptions(EnvOptions):
    difficulty: int = pydantic.Field(4, ge=1, le=6, description="difficulty of generated tasks (1..6)")
    max_tool_turns: int = pydantic.Field(4, ge=0, description="assistant turns with tool calls before the rollout ends")
    format_weight: float = pydantic.Field(0.0, ge=0.0, description="reward += format_weight * format")


CALCULATOR_SCHEMA = function_schema(
    "calculator",
    "Evaluate an arithmetic expression. Supports numbers, + - * / // % ** and parentheses.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (37 * 12) - 5 ** 2"}},
        "required": ["expression"],
    },
)


class CalculatorEnv(Environment):
    """Arithmetic with a ``calculator`` tool. Each assistant turn that calls tools gets one tool message per
    call; the rollout ends at the first turn without a tool call (its content is the final answer) or after
    ``max_tool_turns`` tool-calling turns. Scored like ``arithmetic`` on the last assistant content."""

    name = "calculator"
    Options = CalculatorOptions
    options: CalculatorOptions

    def __init__(self, options: CalculatorOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.register_tool(CALCULATOR_SCHEMA, self._calculator)

    async def _calculator(self, state: RolloutState, arguments: dict[str, Any]) -> str:
        expression = string_argument(arguments, "expression", max_chars=MAX_EXPRESSION_CHARS)
        return format_result(evaluate(expression))

    def reset(self, task: Task) -> RolloutState:
        return require_answer(self.name, task)

    async def step(self, state: RolloutState, parsed: ParsedResponse) -> StepResult:
        self._begin_step(state, parsed)
        if not parsed.tool_calls:
            state.done = True
            return StepResult(new_messages=[], done=True, info={"reason": "answered"})
        messages = await self.run_tool_calls(state, parsed)
        state.done = state.tool_turns >= self.options.max_tool_turns
        info = {"reason": "max_tool_turns"} if state.done else {}
        return StepResult(new_messages=messages, done=state.done, info=info)

    def score(self, state: RolloutState, trajectory: Sequence[Message]) -> Score:
        return score_final_answer(state, trajectory, self.options.format_weight)

    def generate_tasks(self, n: int, seed: int) -> list[Task]:
        return arithmetic_tasks(
            self.name,
            n,
            seed,
            self.options.difficulty,
            "Use the calculator tool to compute {expression}. Then answer with just the number.",
        )
