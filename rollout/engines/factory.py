"""The engine factory: which class each backend kind is, what it holds by default, and how it is built.

``EngineSpec`` says what to run (a kind, its constructor kwargs, replicas and resources); ``build_backend``
imports and constructs the backend in this process. ``tito serve`` with ``engine_in_process`` uses that
directly; actors/engine.py calls it inside each Ray engine actor.

* Kinds: "replay", "embedded", "vllm" (see :data:`BACKENDS`), or any "module:Class" implementing
  :class:`~rollout.engines.protocol.EngineBackend`.
* Resources by kind (overridable per spec): vLLM takes one GPU (``num_gpus=1``, ``num_cpus=1``); the embedded
  engine CPUs (``num_cpus=1``; fractions allowed, e.g. 0.5); replay nothing (``num_cpus=0``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .protocol import EngineBackend

BACKENDS: dict[str, str] = {
    "replay": "rollout.engines.replay:ReplayEngine",
    "embedded": "rollout.engines.embedded:EmbeddedEngine",
    "vllm": "rollout.engines.vllm_backend:VLLMEngine",
}
DEFAULT_RESOURCES: dict[str, dict[str, float]] = {
    "replay": {"num_cpus": 0.0, "num_gpus": 0.0},
    "embedded": {"num_cpus": 1.0, "num_gpus": 0.0},
    "vllm": {"num_cpus": 1.0, "num_gpus": 1.0},
}


@dataclass(frozen=True)
class EngineSpec:
    """What to run: backend ``kind`` ("replay" | "embedded" | "vllm" | "module:Class"), its constructor ``kwargs``,
    ``replicas`` identical actors, Ray resources (None: the kind's default) and ``max_concurrency`` (generate calls
    in flight per actor). ``name`` names the actors ``<name>-<i>`` (detached lookups, debugging)."""

    kind: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    replicas: int = 1
    num_cpus: float | None = None
    num_gpus: float | None = None
    max_concurrency: int = 64
    name: str | None = None
    placement: Literal["spread", "pack"] = "spread"
    custom_resources: Mapping[str, float] = field(default_factory=dict)
    max_restarts: int = 0  # Ray restarts of a lost actor (rollout/engines/healer.py brings it back)

    def __post_init__(self) -> None:
        if self.kind not in BACKENDS and ":" not in self.kind:
            raise ValueError(f"unknown engine kind {self.kind!r}: expected one of {sorted(BACKENDS)} or 'module:Class'")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.replicas < 1 or self.max_concurrency < 1:
            raise ValueError(f"replicas and max_concurrency must be >= 1 (got {self.replicas}, {self.max_concurrency})")
        for what, v in (("num_cpus", self.num_cpus), ("num_gpus", self.num_gpus), *self.custom_resources.items()):
            if v is not None and v < 0:
                raise ValueError(f"{what} must be >= 0, got {v}")
        if self.placement not in ("spread", "pack"):
            raise ValueError(f"placement must be 'spread' or 'pack', got {self.placement!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EngineSpec:
        """From a config dict with the field names above; unknown keys raise ValueError naming them."""
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = set(config) - allowed
        if unknown:
            raise ValueError(f"unknown engine config keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        return cls(**config)

    def resources(self) -> dict[str, float]:
        base = dict(DEFAULT_RESOURCES.get(self.kind, {"num_cpus": 1.0, "num_gpus": 0.0}))
        if self.num_cpus is not None:
            base["num_cpus"] = self.num_cpus
        if self.num_gpus is not None:
            base["num_gpus"] = self.num_gpus
        return base


def backend_class(kind: str) -> type:
    """The backend class of a kind (see :data:`BACKENDS`), imported."""
    module_name, _, cls_name = BACKENDS.get(kind, kind).partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


async def build_backend(kind: str, kwargs: Mapping[str, Any]) -> EngineBackend:
    """Import and construct a backend by kind (see :data:`BACKENDS`); an async ``create`` classmethod is
    preferred when the class has one."""
    cls = backend_class(kind)
    create = getattr(cls, "create", None)
    backend = await create(**kwargs) if inspect.iscoroutinefunction(create) else cls(**kwargs)
    if not isinstance(backend, EngineBackend):
        raise TypeError(f"{BACKENDS.get(kind, kind)} does not implement EngineBackend")
    return backend

