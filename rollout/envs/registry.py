"""Environments by name: ``make_env("calculator", max_tool_turns=2)``."""

from __future__ import annotations

from typing import Any

from .arithmetic import ArithmeticEnv, TryAgainEnv
from .base import EnvError, Environment
from .calculator import CalculatorEnv
from .python_tool import PythonEnv

ENVIRONMENTS: dict[str, type[Environment]] = {}


def register_env(cls: type[Environment]) -> type[Environment]:
    """Make ``cls`` available to :func:`make_env` under ``cls.name`` (usable as a class decorator).
    Registering a different class under a taken name is an error (two plugins fighting over a name)."""
    existing = ENVIRONMENTS.get(cls.name)
    if existing is not None and existing is not cls:
        raise EnvError(f"environment name {cls.name!r} is already registered by {existing.__qualname__}")
    ENVIRONMENTS[cls.name] = cls
    return cls


for _cls in (ArithmeticEnv, TryAgainEnv, CalculatorEnv, PythonEnv):
    register_env(_cls)


def make_env(name: str, **options: Any) -> Environment:
    """The environment registered as ``name``, configured with ``options``.

    Raises :class:`EnvError` naming the known environments for an unknown name, and naming the option and
    what is wrong with it for an unknown or invalid option.
    """
    cls = ENVIRONMENTS.get(name)
    if cls is None:
        known = ", ".join(sorted(ENVIRONMENTS))
        raise EnvError(f"unknown environment {name!r} (known: {known})")
    return cls(**options)


def env_options(name: str) -> dict[str, dict[str, Any]]:
    """Each option of environment ``name``: its default and description (for docs and ``--help``)."""
    cls = ENVIRONMENTS.get(name)
    if cls is None:
        raise EnvError(f"unknown environment {name!r} (known: {', '.join(sorted(ENVIRONMENTS))})")
    return {
        key: {"default": field.default, "description": field.description or ""}
        for key, field in cls.Options.model_fields.items()
    }
