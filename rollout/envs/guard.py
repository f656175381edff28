"""An environment's faults cost one rollout, never the run.

:class:`GuardedEnv` is how the rollout loop calls an environment: each call bounded by ``env.timeout_s``
(``reset`` and ``score`` run in a worker thread, so one that blocks is bounded too, or are awaited where they are
``async def``; ``step`` is a coroutine on
the loop, so a step that awaits for ever is bounded, one that blocks the loop's thread is not), and what
comes back checked: a step's messages are a list of role/content messages an environment may add (``user``,
``tool``, ``system``; never ``assistant``) holding at most ``env.max_message_chars`` characters together, a
score is finite. Anything else is an :class:`EnvFault` naming the environment, the call and what was wrong;
the loop ends that rollout with ``finish_reason: env_error`` and the fault as its error.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tito_renderers.types import ParsedResponse

from .base import Environment, Message, RolloutState, Score, StepResult, Task

ENV_ROLES = ("user", "tool", "system")
PROMPT_ROLES = ("system", "developer", "user", "assistant", "tool")  # a prompt an environment wrote itself
# threads for reset/score: a hung call keeps its thread, so there are more than the loop's usual few
_POOL = ThreadPoolExecutor(max_workers=32, thread_name_prefix="tito-env")


class EnvFault(Exception):
    """An environment call raised, hung or returned something malformed: the rollout ends, the run goes on."""


class GuardedEnv:
    def __init__(self, env: Environment, *, name: str, timeout_s: float, max_message_chars: int) -> None:
        self.env = env
        self.name = name
        self.timeout_s = timeout_s
        self.max_message_chars = max_message_chars

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.env.tools

    async def _call(self, what: str, call) -> Any:
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except Exception as e:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # cancelled (the run is stopping) as the call failed: wait_for hands back the call's error
                # instead, and a fault raised from a cancelled rollout is never retrieved (asyncio logs it)
                raise asyncio.CancelledError from e
            if isinstance(e, EnvFault):
                raise
            if isinstance(e, TimeoutError):
                raise EnvFault(f"environment {self.name!r}: {what} did not return within env.timeout_s "
                               f"{self.timeout_s:g}") from None
            raise EnvFault(f"environment {self.name!r}: {what} raised {type(e).__name__}: {e}") from e

    def _threaded(self, fn, *args):
        """``fn(*args)`` as an awaitable: a coroutine function's own coroutine, else the call in a worker thread."""
        if inspect.iscoroutinefunction(fn):
            return fn(*args)
        return asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)

    async def reset(self, task: Task) -> RolloutState:
        state = await self._call("reset()", self._threaded(self.env.reset, task))
        if not isinstance(state, RolloutState):
            raise EnvFault(f"environment {self.name!r}: reset() returned {type(state).__name__}, not a RolloutState")
        if state.prompt is not None:
            problem = message_problem(state.prompt, self.max_message_chars, PROMPT_ROLES, "prompt")
            if problem:
                raise EnvFault(f"environment {self.name!r}: reset() set a malformed prompt: {problem}")
        return state

    async def step(self, state: RolloutState, parsed: ParsedResponse) -> StepResult:
        result = await self._call("step()", self.env.step(state, parsed))
        if not isinstance(result, StepResult):
            raise EnvFault(f"environment {self.name!r}: step() returned {type(result).__name__}, not a StepResult")
        problem = message_problem(result.new_messages, self.max_message_chars)
        if problem:
            raise EnvFault(f"environment {self.name!r}: step() returned malformed messages: {problem}")
        return result

    async def score(self, state: RolloutState, trajectory: Sequence[Message]) -> Score:
        score = await self._call("score()", self._threaded(self.env.score, state, trajectory))
        if not isinstance(score, Score):
            raise EnvFault(f"environment {self.name!r}: score() returned {type(score).__name__}, not a Score")
        values = {"reward": score.reward, **{f"components[{k!r}]": v for k, v in score.components.items()}}
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise EnvFault(f"environment {self.name!r}: score() gave {key} = {value!r}, not a finite number")
        return score


def message_problem(messages: Any, max_chars: int, roles: Sequence[str] = ENV_ROLES,
                    what: str = "new_messages") -> str | None:
    """What is wrong with messages an environment returned (None: nothing): ``roles`` are those it may write."""
    if not isinstance(messages, list):
        return f"{what} is a {type(messages).__name__}, not a list"
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"{what}[{i}] is a {type(m).__name__}, not a message dict"
        role = m.get("role")
        if role not in roles:
            return f"{what}[{i}] has role {role!r} (an environment adds {', '.join(roles)})"
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: their text counts
            if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
                return f"{what}[{i}].content is a list that is not text parts"
            total += sum(len(p.get("text", "")) for p in content)
        elif isinstance(content, str):
            total += len(content)
        else:
            return f"{what}[{i}].content is a {type(content).__name__}, not a string"
        if total > max_chars:
            return (f"{what} hold more than env.max_message_chars {max_chars} characters (at "
                    f"{what}[{i}]: {total})")
    return None
