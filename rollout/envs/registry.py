"""Environments by name: ``make_env("calculator", max_tool_turns=2)``.

A name is one of three things, tried in this order:

- a built-in (``arithmetic``, ``try_again``, ``calculator``, ``python``, ``reasoning_gym``, ``verifiers``) or a class passed to :func:`register_env`;
- ``"package.module:Class"``: that class, imported (the package must be importable by the driver);
- the name of an entry point in the ``tito.environments`` group of an installed distribution
  (``[project.entry-points."tito.environments"] my_env = "my_pkg.envs:MyEnv"`` in its pyproject.toml).

Whatever the name resolves to must be a class keeping rollout/envs/base.py's protocol; a name that resolves to
nothing, an import that fails, or a class that breaks the protocol is one :class:`EnvError` naming it, raised
before any engine starts (``tito run`` builds its environment first).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from typing import Any

from .arithmetic import ArithmeticEnv, TryAgainEnv
from .base import EnvError, Environment, EnvOptions
from .calculator import CalculatorEnv
from .python_tool import PythonEnv
from .reasoning_gym import ReasoningGymEnv
from .verifiers_adapter import VerifiersEnv

ENTRY_POINT_GROUP = "tito.environments"
ENVIRONMENTS: dict[str, type[Environment]] = {}
# what a class needs, beyond construction with keyword options: (method, must it be ``async def``)
_PROTOCOL = (("reset", False), ("step", True), ("score", False), ("generate_tasks", False))


def register_env(cls: type[Environment]) -> type[Environment]:
    """Make ``cls`` available to :func:`make_env` under ``cls.name`` (usable as a class decorator).
    Registering a different class under a taken name is an error (two plugins fighting over a name)."""
    existing = ENVIRONMENTS.get(cls.name)
    if existing is not None and existing is not cls:
        raise EnvError(f"environment name {cls.name!r} is already registered by {existing.__qualname__}")
    ENVIRONMENTS[cls.name] = cls
    return cls


for _cls in (ArithmeticEnv, TryAgainEnv, CalculatorEnv, PythonEnv, ReasoningGymEnv, VerifiersEnv):
    register_env(_cls)


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def check_env_class(obj: Any, where: str) -> type[Environment]:
    """``obj`` if it is a class keeping the environment protocol, else :class:`EnvError` naming what it lacks
    (``where``: how it was found, for the message)."""
    if not inspect.isclass(obj):
        raise EnvError(f"environment {where} is a {type(obj).__name__}, not a class")
    problems = []
    if not isinstance(getattr(obj, "name", None), str) or not obj.name:
        problems.append("no `name` (a non-empty str class attribute)")
    for method, is_async in _PROTOCOL:
        fn = getattr(obj, method, None)
        if not callable(fn):
            problems.append(f"no {method}()")
        elif getattr(fn, "__isabstractmethod__", False):
            problems.append(f"{method}() is abstract (not implemented)")
        elif is_async and not inspect.iscoroutinefunction(fn):
            problems.append(f"{method}() is not `async def`")
    if not hasattr(obj, "tools"):
        problems.append("no `tools` (None, or a list of OpenAI function schemas)")
    options = getattr(obj, "Options", EnvOptions)
    if not (inspect.isclass(options) and issubclass(options, EnvOptions)):
        problems.append("`Options` is not a subclass of rollout.envs.EnvOptions")
    if problems:
        raise EnvError(f"environment {where} ({obj.__module__}.{obj.__qualname__}) does not keep the environment "
                       f"protocol (rollout/envs/base.py): {'; '.join(problems)}")
    return obj


def _import_class(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise EnvError(f"environment {spec!r}: write a class as 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # an import error inside the plug-in is as much its fault as a missing module
        raise EnvError(f"environment {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvError(f"environment {spec!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_env(name: str) -> type[Environment]:
    """The class ``name`` stands for (see the module docstring), checked against the protocol."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if ":" in name:
        return check_env_class(_import_class(name), repr(name))
    entry = _entry_points().get(name)
    if entry is None:
        plugins = sorted(set(_entry_points()) - set(ENVIRONMENTS))
        known = ", ".join(sorted(ENVIRONMENTS) + plugins)
        raise EnvError(f"unknown environment {name!r} (known: {known}; or 'package.module:Class'; "
                       "`tito envs` lists them with their options)")
    try:
        obj = entry.load()
    except Exception as e:
        raise EnvError(f"environment {name!r} (entry point {entry.value!r} in {ENTRY_POINT_GROUP}): loading it "
                       f"failed: {type(e).__name__}: {e}") from None
    return check_env_class(obj, f"{name!r} (entry point {entry.value!r})")


def make_env(name: str, **options: Any) -> Environment:
    """The environment ``name`` stands for, configured with ``options``.

    Raises :class:`EnvError` naming the known environments for an unknown name, the import or protocol
    problem of a plug-in, and the option and what is wrong with it for an unknown or invalid option.
    """
    cls = resolve_env(name)
    try:
        return cls(**options)
    except EnvError:
        raise
    except Exception as e:  # a plug-in's own constructor failing: name it, not a traceback from inside it
        raise EnvError(f"environment {name!r}: {cls.__qualname__}(**options) failed: {type(e).__name__}: {e}") from e


def env_options(name: str) -> dict[str, dict[str, Any]]:
    """Each option of environment ``name``: its default and description (for docs and ``tito envs``)."""
    cls = resolve_env(name)
    options = getattr(cls, "Options", EnvOptions)
    return {
        key: {"default": None if field.is_required() else field.get_default(call_default_factory=True),
              "required": field.is_required(), "description": field.description or ""}
        for key, field in options.model_fields.items()
    }


def describe_env(name: str, origin: str | None = None) -> dict[str, Any]:
    """What ``tito envs`` shows of environment ``name``: where it comes from (default: its class), the first
    paragraph of its docstring and its options. :class:`EnvError` when it does not resolve."""
    cls = resolve_env(name)
    doc = inspect.getdoc(cls) or ""
    return {"name": name, "origin": origin or f"{cls.__module__}.{cls.__qualname__}",
            "summary": doc.split("\n\n")[0].replace("\n", " "), "options": env_options(name)}


def available_envs() -> list[dict[str, Any]]:
    """Every environment a name reaches without ``module:Class``: the built-ins and the entry points, each with
    where it comes from, its summary and options, or the error that stops it loading."""
    found: list[dict[str, Any]] = []

    def describe(name: str, origin: str) -> None:
        try:
            found.append(describe_env(name, origin))
        except EnvError as e:
            found.append({"name": name, "origin": origin, "error": str(e)})

    for name in sorted(ENVIRONMENTS):
        module = ENVIRONMENTS[name].__module__
        describe(name, "built-in" if module.startswith("rollout.envs.") else module)
    for name, entry in sorted(_entry_points().items()):
        origin = f"entry point {entry.value} ({entry.dist.name if entry.dist else '?'})"
        if name in ENVIRONMENTS:  # the built-in wins: say so, or the plug-in's author never learns why it is unused
            found.append({"name": name, "origin": origin, "error": f"the name {name!r} is the built-in "
                          f"{ENVIRONMENTS[name].__qualname__}'s; name it as {entry.value!r} instead"})
        else:
            describe(name, origin)
    return found
