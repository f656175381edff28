"""Numeric answer checking shared by the built-in verifiable environments.

The rule: the *last* number in the final answer's content is the model's answer (models restate the
question's numbers before answering, so the first one is the wrong pick). Numbers may carry a sign,
thousands separators (``1,234``) and a decimal part; they are compared exactly as fractions, so
``42``, ``42.0`` and ``42.00`` are all equal and no float rounding decides a reward. Reasoning is not
looked at: ``ParsedResponse.to_message`` keeps it out of ``content``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from .base import EnvError, Message, RolloutState, Score, Task, last_assistant

# A minus sign counts only when nothing word-like precedes it ("10-3" ends with the number 3, not -3), and a
# number glued to a word ("Qwen3", "x2") is not one. Thousands groups need exactly three digits, so
# "1,2,3" reads as three numbers, not one.
_NUMBER = re.compile(r"(?<![\w.])[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)")
_JUST_A_NUMBER = re.compile(r"\s*[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?\.?\s*")
# numbers longer than this are not parsed (Fraction of a megabyte-long digit string is slow and pointless)
_MAX_NUMBER_CHARS = 200


def parse_number(text: str) -> Fraction | None:
    """A decimal number string (sign, thousands separators and decimals allowed) as a Fraction, else None."""
    if not isinstance(text, str):
        return None
    cleaned = text.strip().replace(",", "").replace("−", "-")
    if not cleaned or len(cleaned) > _MAX_NUMBER_CHARS:
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: Any) -> Fraction | None:
    """The last number written in ``text`` (see the module rule), or None when there is none."""
    if not isinstance(text, str):
        return None
    matches = _NUMBER.findall(text)
    for candidate in reversed(matches):
        value = parse_number(candidate)
        if value is not None:
            return value
    return None


def is_just_a_number(text: Any) -> bool:
    """True when ``text`` is a single number and nothing else (an optional final period allowed)."""
    return isinstance(text, str) and _JUST_A_NUMBER.fullmatch(text) is not None


def check_answer(content: Any, answer: str | None) -> dict[str, float]:
    """``{"correct": 1.0|0.0, "format": 1.0|0.0}`` for a final answer ``content`` against ``answer``.

    ``correct``: the last number in ``content`` equals ``answer`` (exactly, as fractions). ``format``: the
    content is just the number. A missing/unparseable reference answer scores 0 (never an exception).
    """
    expected = parse_number(answer) if answer is not None else None
    got = last_number(content)
    correct = 1.0 if expected is not None and got is not None and got == expected else 0.0
    return {"correct": correct, "format": 1.0 if is_just_a_number(content) else 0.0}


def format_number(value: int | float | Fraction) -> str:
    """A reference answer as a string: integers plainly, other values as exact decimals where possible."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def require_answer(env_name: str, task: Task) -> RolloutState:
    """A fresh state for a verifiable task; :class:`EnvError` when the task has no reference answer."""
    if task.answer is None:
        raise EnvError(f"environment {env_name!r} needs tasks with an answer; task {task.task_id!r} has none")
    return RolloutState(task=task)


def score_final_answer(state: RolloutState, trajectory: Sequence[Message], format_weight: float) -> Score:
    """Score the last assistant message's content against the task answer (``correct`` and ``format``)."""
    final = last_assistant(trajectory)
    components = check_answer(final.get("content") if final else None, state.task.answer)
    return Score(reward=components["correct"] + format_weight * components["format"], components=components)
