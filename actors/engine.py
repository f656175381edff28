"""EngineActor: the Ray shell around any engine backend (embedded, vLLM, replay).

The actor is built from a small picklable spec (backend kind + constructor kwargs) and constructs the backend
inside itself, on the actor's event loop (vLLM's ``AsyncLLM`` binds to the loop that creates it). The logic stays
in rollout/engines; this module only places it on Ray.

* It is an async actor. ``generate`` runs in the default concurrency group, bounded by ``max_concurrency`` (the
  number of generate calls in flight per engine). ``abort``, ``update_weights``, ``validate_weights``, ``info``,
  ``health``, ``start`` and the admin calls (``reset_prefix_cache``, ``sleep``, ``wake_up``, ``world_size``,
  ``drop_session``; a backend without one raises :class:`~rollout.engines.protocol.Unsupported`) run in a
  separate "control" group, so an abort or a health probe is never queued behind a full set of generate calls.
* Ray runs each concurrency group on its own event loop (its own thread), while a backend is bound to the loop
  that built it (vLLM's output handler, the embedded engine's futures). So every backend call is run on that one
  home loop, whichever group's loop received it (:meth:`EngineActorImpl._home`); cancelling the caller cancels
  the call there too. Without this, vLLM's requests were submitted from the default group's loop to an engine
  whose output handler ran on the control group's loop, and never finished.
* A bad request raises :class:`~rollout.engines.protocol.EngineError` inside the actor; Ray re-raises it on the
  caller as an exception that is an instance of ``EngineError`` (and of ``ray.exceptions.RayTaskError``), and
  the actor keeps serving.
* A backend that raises :class:`~rollout.engines.protocol.EngineDead` (vLLM's EngineCore died) can serve nothing
  more: the actor exits, so its callers see an actor death, as if the process had been killed, and the run or
  server moves the requests to the other engines (or stops with exit 3 when none is left).
* Ray restarts a lost actor up to ``EngineSpec.max_restarts`` times (``engine.max_restarts``). The new incarnation
  refuses generate (:class:`~rollout.engines.healer.EngineRestarted`) until ``rejoin`` is called, so nothing is
  sampled under its fresh base weights before its owner loaded the current ones (rollout/engines/healer.py).
  ``health`` reports the actor's ``incarnation`` and ``progress`` (engine steps and finished requests) for the
  healer's heartbeat.
* Which class a kind is, its default resources and how it is built: rollout/engines/factory.py.

Use :func:`start_engine_actors` with a config (a dict or a list of dicts, see
:class:`~rollout.engines.factory.EngineSpec`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import ray

from rollout.engines.checkpoint import backend_free_check
from rollout.engines.factory import EngineSpec, build_backend
from rollout.engines.healer import EngineRestarted
from rollout.engines.protocol import (
    EngineBackend,
    EngineDead,
    EngineInfo,
    GenerateOutput,
    GenerateRequest,
    SchedulerStats,
    Unsupported,
    close_backend,
    decode_request,
    load_weights,
)
from rollout.engines.streaming import stream_of
from rollout.engines.weight_transfer import WIRE_OPS

from .handles import RayEngine

T = TypeVar("T")
CONTROL_GROUP = "control"
CONTROL_CONCURRENCY = 16


@contextlib.contextmanager
def _exit_when_dead() -> Iterator[None]:
    """An :class:`EngineDead` from the backend ends the actor (see the module doc)."""
    try:
        yield
    except EngineDead:
        ray.actor.exit_actor()


def _decoded(request: GenerateRequest | Mapping[str, Any] | bytes) -> GenerateRequest:
    """A GenerateRequest as given, or decoded strictly from a dict / JSON bytes (EngineError if bad)."""
    if isinstance(request, GenerateRequest):
        return request
    return decode_request(request if isinstance(request, (bytes, str)) else dict(request))


class EngineActorImpl:
    """The actor's body, usable without Ray. ``start()`` builds the backend (every other method calls it too)."""

    def __init__(self, kind: str, kwargs: Mapping[str, Any] | None = None, name: str | None = None) -> None:
        self.kind = kind
        self.kwargs = dict(kwargs or {})
        self.name = name or kind
        self._backend: EngineBackend | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the backend was built on
        self._building: asyncio.Future | None = None
        self.stats = {"requests": 0, "errors": 0, "refused": 0, "in_flight": 0, "peak_in_flight": 0, "finished": 0,
                      "streamed": 0}
        self.incarnation = uuid.uuid4().hex  # a Ray restart runs __init__ again: a new one
        # a restarted actor holds its base weights: no generate until its owner loaded the current ones (rejoin)
        self.fenced = _reconstructed()

    async def _ensure(self) -> EngineBackend:
        """The backend, built on the first call's loop (its home loop) by exactly one caller."""
        if self._backend is not None:
            return self._backend
        if self._building is None:
            self._loop = asyncio.get_running_loop()
            self._building = asyncio.ensure_future(build_backend(self.kind, self.kwargs))
        try:
            self._backend = await self._home(self._building)
        except BaseException:
            if self._building is not None and self._building.done():
                self._building = None  # a failed build may be tried again
            raise
        return self._backend

    async def _home(self, call: Awaitable[T]) -> T:
        """Await ``call`` on the backend's home loop (see the module doc)."""
        loop = self._loop
        if loop is None or loop is asyncio.get_running_loop():
            return await call
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_awaited(call), loop))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def start(self) -> EngineInfo:
        """Build the backend (if not yet built) and return its info: await it to surface startup errors."""
        return (await self._ensure()).info()

    async def generate(self, request: GenerateRequest | Mapping[str, Any] | bytes) -> GenerateOutput:
        """Generate for a request (a GenerateRequest, or a dict / JSON bytes decoded strictly by decode_request).
        Raises EngineError for a bad request; the actor keeps serving."""
        self._refuse_if_fenced()
        backend = await self._ensure()
        with self._counted() as stats, _exit_when_dead():
            out = await self._home(backend.generate(_decoded(request)))
        if any(r.finish_reason == "error" for r in out.results):
            stats["errors"] += 1
        return out

    async def generate_stream(self, request: GenerateRequest | Mapping[str, Any] | bytes) -> AsyncIterator[Any]:
        """``generate`` token by token: StreamDelta items, then the GenerateOutput (see
        rollout/engines/streaming.py). Call it as a Ray streaming generator:
        ``actor.generate_stream.options(num_returns="streaming").remote(request)``."""
        self._refuse_if_fenced()
        backend = await self._ensure()
        with self._counted() as stats, _exit_when_dead():
            items = stream_of(backend, _decoded(request))
            try:
                while True:
                    try:
                        item = await self._home(items.__anext__())
                    except StopAsyncIteration:
                        break
                    if isinstance(item, GenerateOutput) and any(r.finish_reason == "error" for r in item.results):
                        stats["errors"] += 1
                    stats["streamed"] += 1
                    yield item
            finally:
                await self._home(items.aclose())

    @contextlib.contextmanager
    def _counted(self) -> Iterator[dict]:
        """One request in the stats: counted, in flight until it ends, refused when it raises ValueError
        (EngineError and other refusals of this request, a body that does not decode included)."""
        stats = self.stats
        stats["requests"] += 1
        stats["in_flight"] += 1
        stats["peak_in_flight"] = max(stats["peak_in_flight"], stats["in_flight"])
        try:
            yield stats
        except ValueError:
            stats["refused"] += 1
            raise
        finally:
            stats["in_flight"] -= 1
            stats["finished"] += 1

    def _refuse_if_fenced(self) -> None:
        if self.fenced:
            raise EngineRestarted(f"engine actor {self.name} was restarted and has not rejoined yet (it holds its "
                                  "base weights until its owner loads the current ones)")

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def rejoin(self) -> None:
        """Take generate calls again (after a restart, once the current weights are loaded)."""
        self.fenced = False

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def abort(self, request_id: str) -> bool:
        return await self._home((await self._ensure()).abort(request_id))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def update_weights(self, path: str, version: int, keep_running: bool = False) -> None:
        backend = await self._ensure()
        await self._home(load_weights(backend, path, version, keep_running))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def validate_weights(self, path: str) -> dict[str, Any]:
        """Check a checkpoint without loading it (the backend's ``validate_weights``; for a backend without one,
        the model-free check of rollout/engines/checkpoint.py). Returns the report; raises CheckpointError."""
        backend = await self._ensure()
        if callable(getattr(backend, "validate_weights", None)):
            return await self._home(backend.validate_weights(path))
        return await asyncio.to_thread(backend_free_check, path)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def info(self) -> EngineInfo:
        return (await self._ensure()).info()

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def health(self) -> dict[str, Any]:
        """Liveness and load: ``ok``, the backend's own health (if it has ``health()``), info and counters."""
        backend = await self._ensure()
        report: dict[str, Any] = {"ok": True, "name": self.name, "kind": self.kind, "node_id": _node_id(),
                                  "incarnation": self.incarnation, "fenced": self.fenced, "pid": os.getpid(),
                                  **self.stats}
        steps = backend.progress() if callable(getattr(backend, "progress", None)) else None
        # what grows while the engine makes headway: a hung one (a generate that never returns) keeps it still
        report["progress"] = [steps, self.stats["finished"], self.stats["streamed"]]
        probe = getattr(backend, "health", None)
        if callable(probe):
            res = probe()
            res = await self._home(res) if inspect.isawaitable(res) else res
            if isinstance(res, Mapping):
                report["backend"] = dict(res)
                report["ok"] = bool(res.get("ok", True))
        info = backend.info()
        report.update(model=info.model, weight_version=info.weight_version)
        return report

    # -- admin (the server's /reset_prefix_cache, /sleep, /wake_up, /get_world_size, session ends) ------------

    async def _admin(self, name: str, *args: Any) -> Any:
        """Call the backend's ``name`` on its home loop; Unsupported (HTTP 501) when the backend has none."""
        backend = await self._ensure()
        fn = getattr(backend, name, None)
        if not callable(fn):
            raise Unsupported(f"the {self.kind} engine backend cannot {name.replace('_', ' ')}")
        res = fn(*args)
        return await self._home(res) if inspect.isawaitable(res) else res

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self._admin("reset_prefix_cache", reset_running_requests))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def sleep(self, level: int = 1) -> None:
        await self._admin("sleep", level)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._admin("wake_up", tags)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def world_size(self) -> int:
        """The workers behind this engine (vLLM: tensor x pipeline x data parallel); 1 for one-process backends."""
        backend = await self._ensure()
        return int(await self._admin("world_size")) if callable(getattr(backend, "world_size", None)) else 1

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> int:
        return int(await self._admin("load_lora_adapter", name, path, version))

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def unload_lora_adapter(self, name: str) -> None:
        await self._admin("unload_lora_adapter", name)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def weight_transfer(self, op: str, *args: Any) -> Any:
        """A weight-transfer call on the backend (rollout/engines/weight_transfer.py: ``op`` in WIRE_OPS)."""
        if op not in WIRE_OPS:
            raise ValueError(f"unknown weight-transfer operation {op!r}")
        return await self._admin(op, *args)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def scheduler_stats(self) -> SchedulerStats | None:
        """The backend's running and waiting sequences and KV use (its ``scheduler_stats()``); None without one."""
        backend = await self._ensure()
        if not callable(getattr(backend, "scheduler_stats", None)):
            return None
        return await self._admin("scheduler_stats")

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def drop_session(self, session_id: str) -> None:
        """Forget a finished session's KV where the backend keeps one per session (else nothing to do)."""
        backend = await self._ensure()
        if callable(getattr(backend, "drop_session", None)):
            await self._admin("drop_session", session_id)

    @ray.method(concurrency_group=CONTROL_GROUP)
    async def close(self) -> None:
        """Release the backend (vLLM's engine core, the embedded engine's worker thread)."""
        backend, self._backend = self._backend, None
        if backend is not None:
            await self._home(close_backend(backend))
        self._building = None


async def _awaited(call: Awaitable[T]) -> T:
    return await call


def _reconstructed() -> bool:
    """Whether this actor is a restart by Ray (False outside Ray)."""
    if not ray.is_initialized():
        return False
    with contextlib.suppress(Exception), warnings.catch_warnings():  # not in an actor: a plain test of the body
        warnings.simplefilter("ignore")  # Ray's own property reads its deprecated actor_id
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    return False


def _node_id() -> str | None:
    """The Ray node this runs on (which machine of a cluster holds the engine); None outside Ray."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


EngineActor = ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY})(EngineActorImpl)


def _specs(config: EngineSpec | Mapping[str, Any] | Iterable[EngineSpec | Mapping[str, Any]]) -> list[EngineSpec]:
    if isinstance(config, (EngineSpec, Mapping)):
        config = [config]
    return [c if isinstance(c, EngineSpec) else EngineSpec.from_config(c) for c in config]


def start_engine_actors(
    config: EngineSpec | Mapping[str, Any] | Sequence[EngineSpec | Mapping[str, Any]], *, wait: bool = True
) -> list[RayEngine]:
    """Start the engine actors a config describes (each spec ``replicas`` times) and return their typed handles
    (actors/handles.py; ``.actor`` is the Ray actor) in order.

    With ``wait`` (default), block until every backend is built; a backend that fails to build raises here
    (the failed actors are killed) rather than at its first request.
    """
    handles: list[Any] = []
    for spec in _specs(config):
        for i in range(spec.replicas):
            name = f"{spec.name}-{i}" if spec.name else None
            opts: dict[str, Any] = dict(spec.resources(), max_concurrency=spec.max_concurrency,
                                        max_restarts=spec.max_restarts)
            if spec.custom_resources:  # custom node resources pin engines to the nodes that offer them
                opts["resources"] = dict(spec.custom_resources)
            if spec.placement == "spread":  # one engine per node first, so losing a node loses the fewest
                opts["scheduling_strategy"] = "SPREAD"
            if name:
                opts["name"] = name
            handles.append(EngineActor.options(**opts).remote(spec.kind, dict(spec.kwargs), name or spec.kind))
    if wait:
        try:
            ray.get([h.start.remote() for h in handles])
        except Exception:
            for h in handles:
                ray.kill(h)
            raise
    return [RayEngine(h) for h in handles]
