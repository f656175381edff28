"""Environments and tasks for rollouts: the protocol (:mod:`.base`), the built-ins, the registry and the
task loaders. See docs/environments.md.

Built-ins: ``arithmetic`` (single turn), ``try_again`` (user feedback turns), ``calculator`` (a safe
arithmetic tool), ``python`` (a sandboxed Python tool). A new environment is a module here and a line in
registry.py; adapters for other ecosystems' environments go here too.

It may import tito_renderers' message types and nothing else in rollout/: the loop calls it, never the
other way round.
"""

from __future__ import annotations

from .arithmetic import ArithmeticEnv, TryAgainEnv
from .base import (
    EnvError,
    Environment,
    EnvOptions,
    RolloutState,
    Score,
    StepResult,
    Task,
    ToolError,
    call_ids,
    tool_error_message,
)
from .calculator import CalculatorEnv
from .python_tool import PythonEnv
from .registry import ENVIRONMENTS, env_options, make_env, register_env
from .safe_eval import CalculatorError, evaluate
from .sandbox import SandboxResult, SandboxUnavailable, run_python
from .tasks import LoadedTasks, TaskFileError, generate_tasks, load_tasks

__all__ = [
    "ENVIRONMENTS",
    "ArithmeticEnv",
    "CalculatorEnv",
    "CalculatorError",
    "EnvError",
    "EnvOptions",
    "Environment",
    "LoadedTasks",
    "PythonEnv",
    "RolloutState",
    "SandboxResult",
    "SandboxUnavailable",
    "Score",
    "StepResult",
    "Task",
    "TaskFileError",
    "ToolError",
    "TryAgainEnv",
    "call_ids",
    "env_options",
    "evaluate",
    "generate_tasks",
    "load_tasks",
    "make_env",
    "register_env",
    "run_python",
    "tool_error_message",
]
