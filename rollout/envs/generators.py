"""Built-in task generators: seeded, deterministic across machines and runs."""

from __future__ import annotations

import random

from .base import EnvError, Task
from .safe_eval import evaluate
from .scoring import format_number


def arithmetic_problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    """``(expression, answer)``: a random integer-valued expression for ``difficulty`` 1..6 and its value.

    1: two one-digit numbers, + -; 2: two two-digit numbers, + - *; 3: three terms of up to three digits,
    exact divisions appear; 4+: more terms, up to four digits, parentheses. Division is always exact, so
    every answer is an integer.
    """
    digits = min(difficulty, 4)
    low, high = (1 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    n_terms = 2 if difficulty <= 2 else min(difficulty, 5)
    ops = ["+", "-"] if difficulty == 1 else ["+", "-", "*"]
    terms: list[str] = []
    for _ in range(n_terms):
        if difficulty >= 3 and rng.random() < 0.25:
            divisor = rng.randint(2, 12)
            terms.append(f"{divisor * rng.randint(low, high)} / {divisor}")
        else:
            terms.append(str(rng.randint(low, high)))
    expression = terms[0]
    for i, term in enumerate(terms[1:], start=1):
        op = rng.choice(ops)
        if op == "*" and "/" in term:
            term = f"({term})"
        expression = f"{expression} {op} {term}"
        if i == 1 and difficulty >= 4 and n_terms > 2 and rng.random() < 0.5:
            expression = f"({expression})"
    # Every division is exact, so integer division gives the same value without float rounding (products
    # of five four-digit numbers exceed 2**53, where floats stop being exact).
    value = evaluate(expression.replace(" / ", " // "))
    return expression, format_number(value)


def arithmetic_tasks(env_name: str, n: int, seed: int, difficulty: int, template: str) -> list[Task]:
    """``n`` tasks from :func:`arithmetic_problem`; ids ``<env>/<seed>/<i>`` so a task is found again by id."""
    if n < 0:
        raise EnvError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{env_name}/{seed}")  # str seeds hash deterministically (sha512), across runs
    tasks = []
    for i in range(n):
        expression, answer = arithmetic_problem(rng, difficulty)
        tasks.append(
            Task(
                task_id=f"{env_name}/{seed}/{i}",
                messages=[{"role": "user", "content": template.format(expression=expression)}],
                answer=answer,
                metadata={"generator": env_name, "seed": seed, "index": i, "difficulty": difficulty},
            )
        )
    return tasks
