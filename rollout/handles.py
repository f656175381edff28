"""Typed handles on the two components a rollout talks to: a renderer service and an engine.

``RendererHandle`` and ``EngineHandle`` are what the rollout loop (loop.py) and ``tito serve``
(serve/sessions.py, serve/fleet.py) call, always awaited. Each has two implementations: the in-process
ones here wrap a plain object (a :class:`~rollout.renderer_service.RendererService`, an engine backend),
for tests and an engine that runs inside the server; the Ray ones in actors/handles.py wrap an actor.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from .engines.protocol import (
    EngineBackend,
    GenerateOutput,
    GenerateRequest,
    SchedulerStats,
    Unsupported,
    load_weights,
)
from .engines.weight_transfer import WIRE_OPS
from .turns import Finished, NextPrompt, RolloutMeta, SampledTurn

if TYPE_CHECKING:
    from .renderer_service import RendererService


class RendererHandle(Protocol):
    """A renderer service (rollout/renderer_service.py documents each method)."""

    async def begin(self, rollout_id: str, messages: list[dict], tools: list[dict] | None) -> NextPrompt: ...

    async def extend(self, rollout_id: str, turn: SampledTurn, new_messages: list[dict]) -> NextPrompt: ...

    async def bridge_next(self, rollout_id: str, new_messages: list[dict], next_turn: int) -> NextPrompt: ...

    async def restart(self, rollout_id: str, messages: list[dict], tools: list[dict] | None, turn: int,
                      reason: str, detail: str) -> NextPrompt: ...

    async def record_turn(self, rollout_id: str, turn: SampledTurn) -> None: ...

    async def sample(self, rollout_id: str) -> dict[str, Any]: ...

    async def finish(self, rollout_id: str, meta: RolloutMeta, last_turn: SampledTurn | None = None) -> int: ...

    async def finish_group(self, items: list[Finished], out_dir: str | None = None) -> int: ...

    async def close_output(self, out_dir: str) -> dict: ...

    async def discard(self, rollout_id: str) -> None: ...

    async def flush(self) -> list[dict]: ...


class EngineHandle(Protocol):
    """An engine: the :class:`~rollout.engines.protocol.EngineBackend` calls plus what ``tito serve``'s
    admin routes need. An engine that cannot do an admin call raises Unsupported (HTTP 501)."""

    async def generate(self, request: GenerateRequest) -> GenerateOutput: ...

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[Any]:
        """StreamDelta items as the engine samples them, then the GenerateOutput."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def update_weights(self, path: str, version: int, *, keep_running: bool = False) -> None:
        """Load a checkpoint; ``keep_running``: without waiting for the running requests, which go on under the new
        weights with each token's version reported (EngineBackend.update_weights; Unsupported where a backend
        cannot)."""
        ...

    async def validate_weights(self, path: str) -> dict[str, Any]:
        """Check a checkpoint without loading it (rollout/engines/checkpoint.py): the report (files, tensors,
        bytes, seconds), or CheckpointError naming the problem and the tensor. Nothing pauses or changes."""
        ...

    async def health(self) -> dict[str, Any]: ...

    async def world_size(self) -> int: ...

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    async def drop_session(self, session_id: str) -> None: ...

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> int:
        """Load (or swap) a LoRA adapter served as ``name``; returns its version (Unsupported on a backend without)."""
        ...

    async def unload_lora_adapter(self, name: str) -> None: ...

    async def weight_transfer(self, op: str, *args: Any) -> Any:
        """A weight-transfer call (rollout/engines/weight_transfer.py WIRE_OPS); Unsupported where the backend has none."""
        ...

    async def scheduler_stats(self) -> SchedulerStats | None:
        """Running and waiting sequences and KV use (vLLM's ``vllm:`` gauges); None when the backend cannot tell."""
        ...


class RendererHung(RuntimeError):
    """A renderer call did not answer within ``renderer.call_timeout_s``. Its rollouts' segments live in that
    renderer, so the run cannot go on without it: it stops with one line (``tito run`` exit 4), keeping what is
    sealed. ``summary``: the run summary written on the way out (rollout/cli/run.py)."""

    summary: dict | None = None


class BoundedRenderer:
    """A :class:`RendererHandle` whose every call is bounded by ``timeout_s`` (:class:`RendererHung` past it): a
    stopped or wedged renderer actor is named instead of holding the run for ever."""

    def __init__(self, inner: RendererHandle, index: int, timeout_s: float) -> None:
        self.inner = inner
        self.index = index
        self.timeout_s = timeout_s

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if not callable(method):
            return method

        async def bounded(*args: Any, **kwargs: Any) -> Any:
            try:
                return await asyncio.wait_for(method(*args, **kwargs), self.timeout_s)
            except TimeoutError as exc:
                raise RendererHung(f"renderer {self.index} did not answer {name} within renderer.call_timeout_s "
                                   f"{self.timeout_s:g} (stopped, hung or overloaded)") from exc

        return bounded


class LocalRenderer:
    """A RendererService in this process: each call runs at once on the event loop's thread."""

    def __init__(self, service: RendererService) -> None:
        self.service = service

    async def begin(self, rollout_id: str, messages: list[dict], tools: list[dict] | None) -> NextPrompt:
        return self.service.begin(rollout_id, messages, tools)

    async def extend(self, rollout_id: str, turn: SampledTurn, new_messages: list[dict]) -> NextPrompt:
        return self.service.extend(rollout_id, turn, new_messages)

    async def bridge_next(self, rollout_id: str, new_messages: list[dict], next_turn: int) -> NextPrompt:
        return self.service.bridge_next(rollout_id, new_messages, next_turn)

    async def restart(self, rollout_id: str, messages: list[dict], tools: list[dict] | None, turn: int,
                      reason: str, detail: str) -> NextPrompt:
        return self.service.restart(rollout_id, messages, tools, turn, reason, detail)

    async def record_turn(self, rollout_id: str, turn: SampledTurn) -> None:
        self.service.record_turn(rollout_id, turn)

    async def sample(self, rollout_id: str) -> dict[str, Any]:
        return self.service.sample(rollout_id)

    async def finish(self, rollout_id: str, meta: RolloutMeta, last_turn: SampledTurn | None = None) -> int:
        return self.service.finish(rollout_id, meta, last_turn)

    async def finish_group(self, items: list[Finished], out_dir: str | None = None) -> int:
        return self.service.finish_group(items, out_dir)

    async def close_output(self, out_dir: str) -> dict:
        return self.service.close_output(out_dir)

    async def discard(self, rollout_id: str) -> None:
        self.service.discard(rollout_id)

    async def flush(self) -> list[dict]:
        return self.service.flush()


class LocalEngine:
    """An engine backend in this process. The admin calls a backend may lack: ``health`` reports ok,
    ``world_size`` is 1, ``drop_session`` does nothing (no KV kept per session), ``validate_weights`` runs the
    model-free check (layout, headers, finite values), and the others raise Unsupported naming the backend."""

    def __init__(self, backend: EngineBackend) -> None:
        self.backend = backend

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        return await self.backend.generate(request)

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[Any]:
        stream = getattr(self.backend, "generate_stream", None)
        if stream is None:  # a backend that cannot stream: the whole output as one item
            yield await self.backend.generate(request)
            return
        async for item in stream(request):
            yield item

    async def abort(self, request_id: str) -> bool:
        return await self.backend.abort(request_id)

    async def update_weights(self, path: str, version: int, *, keep_running: bool = False) -> None:
        await load_weights(self.backend, path, version, keep_running)

    async def validate_weights(self, path: str) -> dict[str, Any]:
        if callable(getattr(self.backend, "validate_weights", None)):
            return await self.backend.validate_weights(path)
        from .engines.checkpoint import backend_free_check  # a backend without a model-aware check

        return await asyncio.to_thread(backend_free_check, path)

    async def health(self) -> dict[str, Any]:
        if not callable(getattr(self.backend, "health", None)):
            return {"ok": True}
        return dict(await self._admin("health"))

    async def world_size(self) -> int:
        if not callable(getattr(self.backend, "world_size", None)):
            return 1
        return int(await self._admin("world_size"))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self._admin("reset_prefix_cache", reset_running_requests))

    async def sleep(self, level: int = 1) -> None:
        await self._admin("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._admin("wake_up", tags)

    async def drop_session(self, session_id: str) -> None:
        if callable(getattr(self.backend, "drop_session", None)):
            await self._admin("drop_session", session_id)

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> int:
        return int(await self._admin("load_lora_adapter", name, path, version))

    async def unload_lora_adapter(self, name: str) -> None:
        await self._admin("unload_lora_adapter", name)

    async def weight_transfer(self, op: str, *args: Any) -> Any:
        """One weight-transfer call on the backend (rollout/engines/weight_transfer.py: ``op`` in WIRE_OPS)."""
        if op not in WIRE_OPS:
            raise ValueError(f"unknown weight-transfer operation {op!r}")
        return await self._admin(op, *args)

    async def scheduler_stats(self) -> SchedulerStats | None:
        if not callable(getattr(self.backend, "scheduler_stats", None)):
            return None
        return await self._admin("scheduler_stats")

    async def _admin(self, name: str, *args: Any) -> Any:
        """The backend's optional method ``name``, sync or async; Unsupported when it has none."""
        fn = getattr(self.backend, name, None)
        if not callable(fn):
            raise Unsupported(f"the {type(self.backend).__name__} engine backend cannot {name.replace('_', ' ')}")
        out = fn(*args)
        return await out if inspect.isawaitable(out) else out
