"""The ``python`` environment: computing questions the model may answer with a sandboxed ``python`` tool."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pydantic

from tito_renderers.types import ParsedResponse

from .base import (
    EnvError,
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
from .sandbox import NetworkPolicy, run_python
from .scoring import require_answer, score_final_answer


class PythonOptions(EnvOptions):
    timeout_s: float = pydantic.Field(10.0, gt=0.0, le=600.0, description="wall-clock limit per run")
    memory_mb: int = pydantic.Field(
        512,
        ge=64,
        description="memory per run: all its processes together (cgroup, where one can be made) and "
        "each process's address space (RLIMIT_AS)",
    )
    cpu_s: int | None = pydantic.Field(
        None, ge=1, description="CPU-seconds limit; default: the timeout rounded up, plus one second"
    )
    max_output_bytes: int = pydantic.Field(4096, ge=64, description="stdout and stderr are each cut to this")
    max_file_mb: int = pydantic.Field(16, ge=0, description="largest file the code may write (RLIMIT_FSIZE)")
    max_code_chars: int = pydantic.Field(20000, ge=1, description="longer code is refused with an error message")
    network: NetworkPolicy = pydantic.Field(
        "isolated", description="isolated: refuse to run outside the sandbox (namespaces); best_effort; allowed"
    )
    max_tool_turns: int = pydantic.Field(4, ge=0, description="assistant turns with tool calls before the end")
    format_weight: float = pydantic.Field(0.0, ge=0.0, description="reward += format_weight * format")


PYTHON_SCHEMA = function_schema(
    "python",
    "Run Python 3 code and return its stdout, stderr and exit code. Print what you need to see. "
    "No network access; limited time and memory.",
    {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program"}},
        "required": ["code"],
    },
)


class PythonEnv(Environment):
    """Computing questions with a ``python`` tool running in :func:`~rollout.envs.sandbox.run_python`.

    Each tool-calling turn gets one tool message per call (status line, stdout, stderr); the rollout ends at
    the first turn without a tool call or after ``max_tool_turns`` tool-calling turns. Scored like
    ``arithmetic`` on the last assistant content. Calls within one turn run one after another, each in a fresh
    sandbox (its own /tmp: no file survives from one call to the next); concurrent rollouts run concurrently.
    :class:`~rollout.envs.sandbox.SandboxUnavailable` propagates: without the isolation asked for, the
    rollout must fail, not train on a tool that silently had the network. :meth:`check` finds that out at
    startup.
    """

    name = "python"
    Options = PythonOptions
    options: PythonOptions

    def __init__(self, options: PythonOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.register_tool(PYTHON_SCHEMA, self._python)

    async def _python(self, state: RolloutState, arguments: dict[str, Any]) -> str:
        code = string_argument(arguments, "code", max_chars=self.options.max_code_chars)
        o = self.options
        result = await run_python(
            code,
            timeout_s=o.timeout_s,
            memory_mb=o.memory_mb,
            cpu_s=o.cpu_s,
            max_output_bytes=o.max_output_bytes,
            max_file_mb=o.max_file_mb,
            network=o.network,
        )
        state.data.setdefault("runs", []).append(
            {
                "exit_code": result.exit_code,
                "signal": result.signal_name,
                "timed_out": result.timed_out,
                "duration_s": result.duration_s,
                "memory_bound": result.memory_bound,
                "oom_kills": result.oom_kills,
            }
        )
        return result.describe(o.timeout_s)

    async def check(self) -> None:
        """Run an empty program once; raises :class:`SandboxUnavailable` when the isolation asked for is not
        available here (call at startup to fail before any rollout)."""
        await run_python("pass", timeout_s=30.0, memory_mb=self.options.memory_mb, network=self.options.network)

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
        return python_tasks(self.name, n, seed)


# -- built-in computing questions: each returns (question, answer), answers computed here, exactly ---------


def _primes_below(n: int) -> list[int]:
    sieve = bytearray([1]) * max(n, 2)
    sieve[0] = sieve[1] = 0
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(range(i * i, n, i)))
    return [i for i in range(n) if sieve[i]]


def _prime_sum(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(1000, 20000)
    return f"What is the sum of all prime numbers below {n}?", sum(_primes_below(n))


def _divisible(rng: random.Random) -> tuple[str, int]:
    n, a, b = rng.randint(1000, 100000), rng.randint(3, 20), rng.randint(3, 20)
    count = sum(1 for i in range(1, n + 1) if (i % a == 0) != (i % b == 0))
    return f"How many integers from 1 to {n} are divisible by exactly one of {a} and {b}?", count


def _fibonacci(rng: random.Random) -> tuple[str, int]:
    k, m = rng.randint(100, 5000), rng.choice([997, 1000, 10007, 65537, 1000003])
    a, b = 1, 1  # F(1), F(2)
    for _ in range(k - 1):
        a, b = b, a + b
    return f"With F(1) = F(2) = 1 and F(n) = F(n-1) + F(n-2), what is F({k}) modulo {m}?", a % m


def _digit_sum_power(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(2, 99), rng.randint(50, 400)
    return f"What is the sum of the decimal digits of {a}**{b}?", sum(map(int, str(a**b)))


def _collatz(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(1000, 1000000)
    steps, x = 0, n
    while x != 1:
        x = x // 2 if x % 2 == 0 else 3 * x + 1
        steps += 1
    return f"Starting from {n}, how many steps of the Collatz map (n/2 if even, 3n+1 if odd) reach 1?", steps


_QUESTIONS: list[Callable[[random.Random], tuple[str, int]]] = [
    _prime_sum,
    _divisible,
    _fibonacci,
    _digit_sum_power,
    _collatz,
]


def python_tasks(env_name: str, n: int, seed: int) -> list[Task]:
    """``n`` computing questions (primes, divisibility, Fibonacci, digit sums, Collatz) with exact answers."""
    if n < 0:
        raise EnvError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{env_name}/{seed}")
    tasks = []
    for i in range(n):
        kind = rng.choice(_QUESTIONS)
        question, answer = kind(rng)
        prompt = f"{question} You can run Python code with the python tool. Answer with just the number."
        tasks.append(
            Task(
                task_id=f"{env_name}/{seed}/{i}",
                messages=[{"role": "user", "content": prompt}],
                answer=str(answer),
                metadata={"generator": env_name, "seed": seed, "index": i, "kind": kind.__name__.lstrip("_")},
            )
        )
    return tasks
