"""The tool-less verifiable built-ins: ``arithmetic`` (one turn) and ``try_again`` (user feedback turns)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic

from tito_renderers.types import ParsedResponse

from .base import Environment, EnvOptions, Message, RolloutState, Score, StepResult, Task, assistant_messages
from .generators import arithmetic_tasks
from .scoring import check_answer, require_answer, score_final_answer

PROMPT = "What is {expression}? Answer with just the number."


class ArithmeticOptions(EnvOptions):
    difficulty: int = pydantic.Field(2, ge=1, le=6, description="difficulty of generated tasks (1..6)")
    format_weight: float = pydantic.Field(0.0, ge=0.0, description="reward += format_weight * format")


class ArithmeticEnv(Environment):
    """Single turn: the first assistant message is the answer and the rollout ends.

    Score: ``correct`` is 1.0 when the last number in the final content equals the task answer, ``format``
    is 1.0 when the content is just that number; ``reward = correct + format_weight * format``. The
    environment offers no tools; tool calls the model makes anyway are counted in ``info`` and not answered
    (the rollout is over, so nothing would read the answer).
    """

    name = "arithmetic"
    Options = ArithmeticOptions
    options: ArithmeticOptions

    def reset(self, task: Task) -> RolloutState:
        return require_answer(self.name, task)

    async def step(self, state: RolloutState, parsed: ParsedResponse) -> StepResult:
        self._begin_step(state, parsed)
        state.done = True
        return StepResult(new_messages=[], done=True, info={"ignored_tool_calls": len(parsed.tool_calls)})

    def score(self, state: RolloutState, trajectory: Sequence[Message]) -> Score:
        return score_final_answer(state, trajectory, self.options.format_weight)

    def generate_tasks(self, n: int, seed: int) -> list[Task]:
        return arithmetic_tasks(self.name, n, seed, self.options.difficulty, PROMPT)


class TryAgainOptions(EnvOptions):
    difficulty: int = pydantic.Field(3, ge=1, le=6, description="difficulty of generated tasks (1..6)")
    max_attempts: int = pydantic.Field(3, ge=1, description="assistant answers allowed before the rollout ends")
    discount: float = pydantic.Field(0.5, gt=0.0, le=1.0, description="reward = discount ** (attempt - 1)")
    feedback: str = pydantic.Field("That is not correct. Try again.", min_length=1, description="the user reply")
    format_weight: float = pydantic.Field(0.0, ge=0.0, description="reward += format_weight * format")


class TryAgainEnv(Environment):
    """Multi-turn feedback: after a wrong answer the user replies ``feedback``; the rollout ends at the first
    correct answer or after ``max_attempts`` answers.

    Score (computed from the trajectory, so a stored rollout can be re-scored): with k the 1-based attempt of
    the first correct answer, ``reward = discount ** (k - 1)`` (0 when none is correct) ``+ format_weight *
    format`` of the final answer. Components: ``correct`` (some answer was right), ``attempts`` (answers
    given), ``first_try``, ``format``.
    """

    name = "try_again"
    Options = TryAgainOptions
    options: TryAgainOptions

    def reset(self, task: Task) -> RolloutState:
        return require_answer(self.name, task)

    async def step(self, state: RolloutState, parsed: ParsedResponse) -> StepResult:
        self._begin_step(state, parsed)
        correct = check_answer(parsed.content, state.task.answer)["correct"] == 1.0
        info: dict[str, Any] = {"attempt": state.turns, "correct": correct}
        if correct or state.turns >= self.options.max_attempts:
            state.done = True
            return StepResult(new_messages=[], done=True, info=info)
        return StepResult(new_messages=[{"role": "user", "content": self.options.feedback}], done=False, info=info)

    def score(self, state: RolloutState, trajectory: Sequence[Message]) -> Score:
        answers = assistant_messages(trajectory)[: self.options.max_attempts]
        checks = [check_answer(m.get("content"), state.task.answer) for m in answers]
        first = next((i for i, c in enumerate(checks) if c["correct"] == 1.0), None)
        fmt = checks[-1]["format"] if checks else 0.0
        reward = (self.options.discount**first if first is not None else 0.0) + self.options.format_weight * fmt
        components = {
            "correct": 1.0 if first is not None else 0.0,
            "attempts": float(len(answers)),
            "first_try": 1.0 if first == 0 else 0.0,
            "format": fmt,
        }
        return Score(reward=reward, components=components)

    def generate_tasks(self, n: int, seed: int) -> list[Task]:
        return arithmetic_tasks(self.name, n, seed, self.options.difficulty, PROMPT)
