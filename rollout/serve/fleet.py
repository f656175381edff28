"""The engines behind the server: sticky least-loaded routing, aborts, pause/resume, weight updates and the
admin calls fanned out over every live engine (prefix-cache reset, sleep / wake_up, world size).

``Fleet`` holds engine handles (rollout/handles.py: Ray actors, or backends in this process) and routes each request with :class:`rollout.routing.StickyLeastLoaded`:
a session (or a ``cache_salt``) stays on the engine that holds its KV until that engine is
overloaded, then moves to the least loaded one. A request with neither key goes to the least loaded
engine and its routing entry is forgotten at once, so one-off request ids do not pile up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..engines.healer import EngineHealer, is_actor_death
from ..engines.protocol import EngineInfo, GenerateOutput, GenerateRequest, SchedulerStats, Unsupported
from ..engines.weight_transfer import DEFAULT_TIMEOUT_S, WeightTransfer, WireUpdates
from ..handles import EngineHandle
from ..routing import StickyLeastLoaded

# An engine ignores an abort for a request id it has not received (as vLLM does), and the fleet places a
# request before its engine call arrives: on Ray an abort travels in the control concurrency group and can
# overtake the generate call. So an abort that found nothing is sent again this often while the request runs.
ABORT_RETRY_S = 0.02


class EngineUnavailable(RuntimeError):
    """The engine died (or every engine is gone): the request fails with 503, the server keeps serving."""


class EngineAsleep(EngineUnavailable):
    """The engines were put to sleep (POST /sleep): requests get 503 until POST /wake_up."""


class DuplicateRequest(ValueError):
    """A request id that is already running (409): refused before it touches routing, so the running
    one stays registered (it can still be aborted)."""

    param = "request_id"


class Fleet:
    """Engines with routing. ``generate`` waits while paused; ``update_weights`` pauses, drains the
    requests in flight, updates every engine and resumes, so each result comes from one weight version."""

    def __init__(self, engines: list[EngineHandle], infos: list[EngineInfo], overload_factor: float = 1.5) -> None:
        if not engines or len(engines) != len(infos):
            raise ValueError("need one EngineInfo per engine, and at least one engine")
        self.engines = engines
        self.infos = infos
        self.router = StickyLeastLoaded(len(engines), overload_factor)
        self.dead: set[int] = set()
        self.where: dict[str, int] = {}  # running request id -> engine index (for aborts)
        self.weight_version = max(i.weight_version for i in infos)
        self.last_update_paused_s: float | None = None  # the last update: admitting stopped -> admitting again
        # the fleet's engines serve one model: requests are checked against the tightest limits
        self.max_model_len = min(i.max_model_len for i in infos)
        self.vocab_size = min(i.vocab_size for i in infos)
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._update_lock = asyncio.Lock()
        self._abandoned: set[asyncio.Future] = set()  # results of requests whose caller went away
        self.on_abandoned: Callable[[GenerateOutput], None] | None = None
        self.sleep_level = 0  # 0: awake; else the level of POST /sleep (requests are refused with 503)
        self._world_size: int | None = None
        self.reroutes = 0  # requests sent again to another engine because theirs died
        self.healer: EngineHealer | None = None  # enable_healing: lost engines restarted and brought back
        # what the engines serve beyond their base weights, for a restarted engine (bring_up)
        self.weight_dir: str | None = None
        self.adapters: dict[str, tuple[str, int]] = {}
        self.held = 0  # sequences of requests waiting for a pause to end (not yet routed to an engine)
        # weights over the wire (vLLM's weight-transfer routes): the backend asked for, and its coordinator
        self.weight_transfer: WeightTransfer = "none"
        self.weight_transfer_timeout_s = DEFAULT_TIMEOUT_S
        self._wire: WireUpdates | None = None
        self.weights_from_wire = False  # the served weights came over the wire: no directory holds them

    @property
    def paused(self) -> bool:
        return not self._admitting.is_set()

    @property
    def alive(self) -> int:
        """Engines not known to be dead."""
        return len(self.engines) - len(self.dead)

    @property
    def in_flight(self) -> int:
        return len(self.where)

    async def generate(self, request: GenerateRequest, key: str | None = None) -> tuple[GenerateOutput, float, int]:
        """Run ``request`` on the engine ``key`` sticks to (None: the least loaded). Returns the output,
        the seconds the engine call took as seen from here, and the engine index. A cancelled caller
        (a client that disconnected) aborts the request on its engine. An engine that dies (its Ray
        actor, or its node) is dropped from routing and the request is sent again to a live one: it had
        returned nothing yet. Raises EngineUnavailable once no engine is alive; an engine's refusal
        (EngineError) propagates unchanged."""
        while True:
            await self._held(request)
            await self._engine_back()
            index, route = self._admit(request, key)
            rid = request.request_id
            t0, sent_at = time.perf_counter(), time.monotonic()
            engine = self.engines[index]
            running = asyncio.ensure_future(engine.generate(request))
            try:
                out = await asyncio.shield(running)
                return out, time.perf_counter() - t0, index
            except asyncio.CancelledError:
                # cancelling the wait does not reach an actor: tell the engine to stop this request, and
                # collect what it returns (finish_reason "abort") so the metrics see how it ended
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._abort_on(engine, rid, ended=running.done))
                self._abandoned.add(asyncio.ensure_future(self._collect(running)))
                raise
            except Exception as exc:
                if not is_actor_death(exc):
                    raise
                self._engine_died(index, exc, sent_at)
            finally:
                self._release(index, rid, route, key)

    async def _held(self, request: GenerateRequest) -> None:
        """Wait while generation is paused, counted in ``held`` (vllm:num_requests_waiting)."""
        if self._admitting.is_set():
            return
        self.held += request.sampling.n
        try:
            await self._admitting.wait()
        finally:
            self.held -= request.sampling.n

    async def scheduler_stats(self, timeout_s: float = 2.0) -> list[SchedulerStats | None]:
        """Each engine's scheduler report (running and waiting sequences, KV use); None for a dead engine, one
        whose backend cannot tell, or one that does not answer within ``timeout_s``."""

        async def one(i: int, engine: EngineHandle) -> SchedulerStats | None:
            if i in self.dead or not callable(getattr(engine, "scheduler_stats", None)):
                return None
            try:
                return await asyncio.wait_for(engine.scheduler_stats(), timeout_s)
            except Exception:  # noqa: BLE001 - a metrics scrape must not fail for one engine
                return None

        return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines))))

    def _engine_died(self, index: int, exc: BaseException, sent_at: float | None = None) -> None:
        """Drop a dead engine from routing; raise EngineUnavailable when it was the last one (else the
        caller re-sends its request to a live engine)."""
        self.mark_dead(index, f"a request saw its actor die ({type(exc).__name__})", sent_at)
        if len(self.dead) == len(self.engines) and not self._coming_back():
            raise EngineUnavailable(f"engine {index} died ({type(exc).__name__}) and no engine is alive") from exc
        self.reroutes += 1

    def _coming_back(self) -> bool:
        return self.healer is not None and self.healer.any_coming_back()

    async def _engine_back(self) -> None:
        """While every engine is lost but one is being restarted, wait for it (the restart is bounded by
        engine.restart_timeout_s); then admission routes or refuses as usual."""
        while len(self.dead) == len(self.engines) and self._coming_back():
            await self.healer.wait_changed(1.0)  # type: ignore[union-attr]

    def mark_dead(self, index: int, cause: str = "its actor died", sent_at: float | None = None) -> None:
        """An engine is gone (its actor or node died, or it hung): no request is routed to it until the healer, if
        any, brought it back."""
        if self.healer is not None:
            self.healer.lost(index, cause, sent_at=sent_at)
        else:
            self._drop(index)

    def _drop(self, index: int) -> None:
        if index not in self.dead:
            self.dead.add(index)
            self.router.drop_engine(index)

    def _back(self, index: int) -> None:
        self.dead.discard(index)
        self.router.revive_engine(index)

    def enable_healing(self, *, log: Callable[[str], None], restarts: int, heartbeat_interval_s: float,
                       heartbeat_timeout_s: float, restart_timeout_s: float) -> EngineHealer:
        """Watch the engines (run ``healer.watch()`` on the server's loop): a lost one is restarted, brought up to
        the weights and adapters the others serve, and routed to again (rollout/engines/healer.py)."""
        self.healer = EngineHealer(self.engines, on_lost=self._drop, on_back=self._back, log=log, restarts=restarts,
                                   heartbeat_interval_s=heartbeat_interval_s, heartbeat_timeout_s=heartbeat_timeout_s,
                                   restart_timeout_s=restart_timeout_s, bring_up=self.bring_up)
        return self.healer

    async def bring_up(self, index: int) -> int:
        """Load into restarted engine ``index`` what the others serve: the last /update_weights, then each adapter.
        An update in progress finishes first. Returns the version it now serves."""
        async with self._update_lock:
            engine = self.engines[index]
            if self.weights_from_wire:  # never serve the base weights under the wire version's label
                raise RuntimeError("the fleet serves weights received over the wire, which no file holds: a restarted "
                                   "engine cannot be brought up to them, so it stays out (send a checkpoint with "
                                   "/update_weights weight_dir to make them restorable)")
            if self.weight_dir is not None:
                await engine.update_weights(self.weight_dir, self.weight_version)
            for name, (path, version) in self.adapters.items():
                await engine.load_lora_adapter(name, path, version)
            self.infos[index].weight_version = self.weight_version
            return self.weight_version

    def _admit(self, request: GenerateRequest, key: str | None) -> tuple[int, str]:
        if len(self.dead) == len(self.engines):
            raise EngineUnavailable("no engine is alive")
        if self.sleep_level:
            raise EngineAsleep(f"the engines are asleep (POST /sleep, level {self.sleep_level}): their weights are "
                               "freed; POST /wake_up first")
        rid = request.request_id
        if rid in self.where:
            raise DuplicateRequest(f"request_id {rid!r} is already running; use another id (or abort it first)")
        route = key if key is not None else rid
        index = self.router.acquire(route)
        self.where[rid] = index
        self._drained.clear()
        return index, route

    def _release(self, index: int, rid: str, route: str, key: str | None) -> None:
        self.router.release(index)
        self.where.pop(rid, None)
        if key is None:
            self.router.forget(route)
        if not self.where:
            self._drained.set()

    async def generate_stream(self, request: GenerateRequest, key: str | None = None) -> AsyncIterator[Any]:
        """``generate`` token by token: StreamDelta items as the engine samples them (an engine without
        stream gives none), then ``(output, engine call seconds, engine index)``. Closing or
        cancelling the iteration before the output aborts the request on its engine. An engine that dies
        before its first item is replaced as in ``generate``; after it, the stream fails with EngineUnavailable
        (the client already holds tokens of that attempt)."""
        while True:
            await self._held(request)
            await self._engine_back()
            index, route = self._admit(request, key)
            rid = request.request_id
            engine = self.engines[index]
            t0, sent_at = time.perf_counter(), time.monotonic()
            items = engine.generate_stream(request)
            started = finished = False
            try:
                async for item in items:
                    if isinstance(item, GenerateOutput):
                        finished = True
                        yield item, time.perf_counter() - t0, index
                        return
                    started = True
                    yield item
            except BaseException as exc:
                if not finished and isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
                    with contextlib.suppress(Exception):
                        await asyncio.shield(engine.abort(rid))
                if not (isinstance(exc, Exception) and is_actor_death(exc)):
                    raise
                self._engine_died(index, exc, sent_at)
                if started:
                    raise EngineUnavailable(f"engine {index} died mid-stream: {type(exc).__name__}") from exc
            finally:
                with contextlib.suppress(BaseException):
                    await items.aclose()
                self._release(index, rid, route, key)

    async def _collect(self, running: asyncio.Future, timeout_s: float = 60.0) -> None:
        try:
            out = await asyncio.wait_for(running, timeout_s)
            if self.on_abandoned is not None:
                self.on_abandoned(out)
        except Exception:  # the engine failed or never answered: nothing left to count
            pass
        finally:
            self._abandoned.discard(asyncio.current_task())

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort running requests (their results come back with finish_reason "abort"); returns the ids
        that were running. Unknown ids are ignored, as vLLM does."""
        targets = [(rid, self.where[rid]) for rid in request_ids if rid in self.where]
        def ended(rid: str, index: int) -> Callable[[], bool]:
            return lambda: self.where.get(rid) != index

        done = await asyncio.gather(*(self._abort_on(self.engines[i], rid, ended(rid, i)) for rid, i in targets),
                                    return_exceptions=True)
        return [rid for (rid, _), ok in zip(targets, done) if ok is True]

    @staticmethod
    async def _abort_on(engine: EngineHandle, rid: str, ended: Callable[[], bool]) -> bool:
        """Abort ``rid`` on ``engine``, sent again every :data:`ABORT_RETRY_S` while the engine has not
        received it yet and ``ended()`` is false. True once the engine aborted it; False when the request
        ended first (or the engine had already aborted it)."""
        while True:
            if await engine.abort(rid):
                return True
            if ended():
                return False
            await asyncio.sleep(ABORT_RETRY_S)

    async def pause(self, mode: str = "wait") -> None:
        """Stop admitting requests (they wait, they are not refused). ``wait``: return once the running ones
        finished; ``abort``: abort them (finish_reason "abort"); ``keep``: leave them running."""
        if mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause mode must be 'wait', 'abort' or 'keep', got {mode!r}")
        self._admitting.clear()
        if mode == "abort":
            await self.abort(list(self.where))
        if mode in ("wait", "abort"):
            await self._drained.wait()

    def resume(self) -> None:
        self._admitting.set()

    def forget(self, key: str) -> None:
        self.router.forget(key)

    async def end_session(self, key: str) -> None:
        """A session ended: its engine drops the KV it kept for it (not left to its LRU), and its routing goes."""
        index = self.router.home.get(key)
        self.router.forget(key)
        if index is not None and index not in self.dead:
            with contextlib.suppress(Exception):  # a dead engine holds nothing any more
                await self.engines[index].drop_session(key)

    async def validate_weights(self, weight_dir: str) -> dict:
        """Check ``weight_dir`` on one live engine without loading it (the fleet's engines serve one model, so
        one check stands for all): the report, or CheckpointError naming the problem and the tensor."""
        live = self._live()
        if not live:
            raise EngineUnavailable("no engine is alive")
        return await live[0].validate_weights(weight_dir)

    async def update_weights(self, weight_dir: str, version: int | None = None, *, validate: bool = True,
                             keep_running: bool = True) -> int:
        """Validate ``weight_dir`` once (:meth:`validate_weights`; ``validate=False``: the caller just did), so a
        refused checkpoint raises CheckpointError before anything pauses and every engine keeps its weights and
        version; then load it on every live engine and resume admitting (unless it was paused before). Later
        results carry ``version``; None: the current version + 1 (how prime-rl sends it). Returns the version now
        served.

        ``keep_running`` (default, prime-rl's ``pause(mode="keep")``): the requests in flight are not drained; each
        engine swaps under them (``update_weights(keep_running=True)``) and they go on under the new weights, each
        token stamped with the version that sampled it, so an update costs the load, not the longest running turn.
        An engine that cannot keep them (Unsupported) drains its own first. ``keep_running=False``: every engine
        drains first (each completion from one version)."""
        if self.sleep_level:
            raise EngineAsleep("the engines are asleep: POST /wake_up before /update_weights (waking reloads the "
                               "weights the engines had)")
        if version is None:
            version = self.weight_version + 1
        if validate:
            await self.validate_weights(weight_dir)
        async with self._update_lock:
            paused_at = time.perf_counter()
            was_paused = self.paused
            await self.pause("keep" if keep_running else "wait")
            try:
                await asyncio.gather(*(self._load(e, weight_dir, version, keep_running) for e in self._live()))
                self.weight_version, self.weight_dir, self.weights_from_wire = version, weight_dir, False
                for info in self.infos:
                    info.weight_version = version
            finally:
                if not was_paused:
                    self.resume()
                self.last_update_paused_s = time.perf_counter() - paused_at
        return version

    @staticmethod
    async def _load(engine: EngineHandle, weight_dir: str, version: int, keep_running: bool) -> None:
        if keep_running:
            try:
                return await engine.update_weights(weight_dir, version, keep_running=True)
            except Exception as exc:
                cause = getattr(exc, "cause", None)  # through Ray: the backend's own exception
                if not isinstance(exc, Unsupported) and not isinstance(cause, Unsupported):
                    raise
        # keep_running=False, or a backend that cannot swap under running requests: it drains them itself first
        await engine.update_weights(weight_dir, version)

    # ---- admin over every live engine ------------------------------------------------------------------

    def _live(self) -> list[EngineHandle]:
        return [e for i, e in enumerate(self.engines) if i not in self.dead]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Every live engine drops its cached KV (session KV, vLLM's prefix cache). True when all did."""
        done = await asyncio.gather(*(e.reset_prefix_cache(reset_running_requests) for e in self._live()))
        return all(bool(d) for d in done)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Refuse new requests (503), abort (``mode="abort"``) or finish (``"wait"``) the running ones, then
        put every live engine to sleep (free its weights and KV). If one engine cannot, the ones that slept
        are woken again and the error (Unsupported: 501) is raised: the fleet is all asleep or all awake."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if mode not in ("abort", "wait"):
            raise ValueError(f"sleep mode must be 'abort' or 'wait', got {mode!r} (the engines free their KV: "
                             "running requests cannot be kept)")
        async with self._update_lock:
            if self.sleep_level:
                return
            self.sleep_level = level  # from here new requests get 503
            try:
                if mode == "abort":
                    await self.abort(list(self.where))
                await self._drained.wait()
                live = self._live()
                done = await asyncio.gather(*(e.sleep(level) for e in live), return_exceptions=True)
                failed = [d for d in done if isinstance(d, BaseException)]
                if failed:
                    slept = [e for e, d in zip(live, done) if not isinstance(d, BaseException)]
                    await asyncio.gather(*(e.wake_up(None) for e in slept), return_exceptions=True)
                    raise failed[0]
            except BaseException:
                self.sleep_level = 0
                raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Reload every live engine's weights; requests are served again."""
        async with self._update_lock:
            if not self.sleep_level:
                return
            await asyncio.gather(*(e.wake_up(tags) for e in self._live()))
            self.sleep_level = 0

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> int:
        """Load (or swap in place) a LoRA adapter on every live engine; returns its version. Each engine checks it
        before installing it, and they check the same files: a refused adapter changes no engine."""
        async with self._update_lock:
            versions = await asyncio.gather(*(e.load_lora_adapter(name, path, version) for e in self._live()))
            self.adapters[name] = (path, int(versions[0]))
        return int(versions[0])

    async def unload_lora_adapter(self, name: str) -> None:
        async with self._update_lock:
            await asyncio.gather(*(e.unload_lora_adapter(name) for e in self._live()), return_exceptions=True)
            self.adapters.pop(name, None)

    # ---- weights over the wire (rollout/serve/weight_routes.py) -----------------------------------------------

    async def wire_updates(self) -> WireUpdates:
        """The weight-transfer coordinator over every engine (each one's ranks: its world size)."""
        if self._wire is None:
            sizes = list(await asyncio.gather(*(e.world_size() for e in self.engines)))
            self._wire = WireUpdates(self.engines, sizes, self.weight_transfer, self.weight_transfer_timeout_s)
        return self._wire

    async def finish_wire_update(self, version: int) -> None:
        """Swap the received weights in on every engine and serve ``version`` (rollout/engines/weight_transfer.py
        ``WireUpdates.finish``: checked everywhere first, so a refusal changes no engine)."""
        wire = await self.wire_updates()
        async with self._update_lock:
            self.last_update_paused_s = await wire.finish(version)
            self._publish(version)
            self.weight_dir, self.weights_from_wire = None, True

    async def abort_wire_update(self) -> None:
        await (await self.wire_updates()).abort()

    async def relabel_version(self, version: int) -> None:
        """Later tokens carry ``version``; the weights stay (vLLM's /update_weight_version)."""
        async with self._update_lock:
            await asyncio.gather(*(e.weight_transfer("set_weight_version", version) for e in self._live()))
            self._publish(version)

    async def reset_weights(self) -> None:
        """Zero every engine's parameters (vLLM's /weight_checker reset); the version stays."""
        wire = await self.wire_updates()
        async with self._update_lock:
            await wire.reset()
            self.weight_dir, self.weights_from_wire = None, True

    def _publish(self, version: int) -> None:
        self.weight_version = version
        for info in self.infos:
            info.weight_version = version

    async def world_size(self) -> int:
        """The inference workers behind the fleet (what TRL and SkyRL size their NCCL group by): the sum of
        each engine's (vLLM: tensor x pipeline x data parallel; 1 for one-process backends)."""
        if self._world_size is None:
            self._world_size = sum(await asyncio.gather(*(e.world_size() for e in self.engines)))
        return self._world_size

    async def health(self, timeout_s: float = 5.0) -> list[dict]:
        """Each engine's health report (``ok`` False for a dead or unresponsive one)."""

        async def one(i: int, engine: EngineHandle) -> dict:
            if i in self.dead:  # lost for good, or being restarted by the healer
                state = self.healer.state[i] if self.healer is not None else "dead"
                return {"ok": False, "engine": i, "error": "dead" if state == "lost" else state, "state": state}
            try:
                report = await asyncio.wait_for(engine.health(), timeout_s)
                return {"engine": i, **dict(report)}
            except Exception as exc:
                if is_actor_death(exc):  # gone for good: route nothing more to it
                    self.mark_dead(i)
                return {"ok": False, "engine": i, "error": f"{type(exc).__name__}: {exc}"}

        return list(await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines))))
