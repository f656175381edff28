"""EngineHealer: a lost engine is named in one line, routed around, restarted with the weights the others serve,
and put back.

An engine is **lost** when

* a call to it sees its actor die (killed, OOM-killed, its node gone: :func:`is_actor_death`), or
* it is **hung**: its health probe does not answer within ``heartbeat_timeout_s`` (SIGSTOP, a wedged event loop),
  or it has requests in flight and made no progress (no engine step, no finished request) for that long (a
  generate that never returns). A hung engine is killed first, so that Ray restarts it.

A lost engine leaves routing at once (the caller re-sends its request to a live engine: the turn goes on
token-in there). With restarts left (``engine.max_restarts``, Ray's ``max_restarts`` of the actor), the healer
waits for Ray's new incarnation of the actor (bounded by ``restart_timeout_s``), has the owner bring it up to
the current weights (``bring_up(index)``: the follow service loads the version every other engine holds, the
server its last ``/update_weights`` and adapters), lets it take requests again (``rejoin``: a restarted actor
refuses generate until then, so nothing samples under its fresh base weights) and puts it back in routing.
Each step is one log line; ``lost_total`` and ``restarted_total`` go to metrics and status.

The class is plain asyncio: it runs on the driver's or the server's loop. Engines that cannot restart (in
this process: :class:`~rollout.handles.LocalEngine`) are only routed around.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from .protocol import EngineInfo

State = Literal["serving", "restarting", "lost"]


class EngineRestarted(RuntimeError):
    """A restarted engine actor refuses generate until its owner brought it up to the current weights
    (``rejoin``): treated as a lost engine, so the request goes to another one."""


def is_actor_death(exc: BaseException) -> bool:
    """Whether ``exc`` says the engine behind a call is gone (its Ray actor died or is restarting, or a restarted
    actor has not rejoined yet): the request may be sent to another engine, it returned nothing."""
    if isinstance(exc, EngineRestarted):
        return True
    try:
        import ray.exceptions as rex
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, (rex.RayActorError, rex.ActorDiedError, rex.ActorUnavailableError))


@runtime_checkable
class Restartable(Protocol):
    """An engine whose process can be restarted (actors/handles.py's RayEngine)."""

    def kill(self) -> None:
        """Kill the engine's process so that it is restarted (a hung engine)."""

    async def restarted(self) -> EngineInfo:
        """Wait until the engine runs again, its backend built; raise when it is gone for good."""

    async def rejoin(self) -> None:
        """Let a restarted engine take generate calls again."""


def _short(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


class EngineHealer:
    """Watches ``engines`` (by index, as the router numbers them). ``on_lost(i)`` takes engine i out of routing,
    ``on_back(i)`` puts it back; ``bring_up(i)`` loads the current weights into a restarted engine i and returns
    the version it now holds. ``restarts``: how many times Ray restarts one actor (0: a lost engine stays lost)."""

    def __init__(self, engines: Sequence[Any], *, on_lost: Callable[[int], None], on_back: Callable[[int], None],
                 log: Callable[[str], None], restarts: int = 0, heartbeat_interval_s: float = 2.0,
                 heartbeat_timeout_s: float = 30.0, restart_timeout_s: float = 600.0,
                 bring_up: Callable[[int], Awaitable[int]] | None = None) -> None:
        self.engines = engines
        self.on_lost = on_lost
        self.on_back = on_back
        self.log = log
        self.restarts = restarts
        self.heartbeat_interval_s = heartbeat_interval_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.restart_timeout_s = restart_timeout_s
        self.bring_up = bring_up
        n = len(engines)
        self.state: list[State] = ["serving"] * n
        self.restarts_used = [0] * n
        self.lost_total = 0
        self.restarted_total = 0
        self.last_loss: dict[str, Any] | None = None  # {"engine", "cause", "at"}: status.json's last_error
        # {"engine", "event": lost | restarted | not_restarted, "at"}: follow mode's metrics count each batch's own
        self.events: list[dict[str, Any]] = []
        self.changed = asyncio.Event()  # set (and replaced) whenever an engine is lost or back
        self._incarnation: list[Any] = [None] * n  # what each engine's health said it is (a restart changes it)
        self._progress: list[tuple[Any, float] | None] = [None] * n  # (progress key, since) while requests run
        self._restarting: dict[int, asyncio.Task] = {}
        self.rejoined_at = [float("-inf")] * n  # time.monotonic() of each engine's last rejoin

    # ---- what callers see -------------------------------------------------------------------------------------

    @property
    def serving(self) -> int:
        return self.state.count("serving")

    def any_coming_back(self) -> bool:
        return "restarting" in self.state

    async def wait_changed(self, timeout_s: float) -> None:
        event = self.changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    # ---- losing and restarting --------------------------------------------------------------------------------

    def lost(self, index: int, cause: str, *, sent_at: float | None = None) -> None:
        """Engine ``index`` is gone (``cause`` says how). Idempotent: a loss already known changes nothing, and
        neither does one seen by a call sent (``sent_at``, :func:`time.monotonic`) before the engine last rejoined
        (it reached the old incarnation, or the restarted one before it rejoined)."""
        if self.state[index] != "serving" or (sent_at is not None and sent_at < self.rejoined_at[index]):
            return
        self.on_lost(index)
        self.lost_total += 1
        self._progress[index] = None
        self.last_loss = {"engine": index, "cause": cause, "at": round(time.time(), 3)}
        self._event(index, "lost")
        engine = self.engines[index]
        can = isinstance(engine, Restartable) and self.restarts_used[index] < self.restarts
        self.state[index] = "restarting" if can else "lost"
        n = len(self.engines)
        if can:
            then = f"restarting it ({self.restarts_used[index] + 1} of engine.max_restarts {self.restarts})"
        elif not isinstance(engine, Restartable):
            then = "it runs in this process and cannot be restarted"
        else:
            then = ("not restarted (engine.max_restarts 0)" if self.restarts == 0 else
                    f"not restarted (its engine.max_restarts {self.restarts} used)")
        self.log(f"engine {index} lost: {cause}; {self.serving} of {n} engines serving; {then}")
        self._changed()
        if can:
            self.restarts_used[index] += 1
            self._restarting[index] = asyncio.ensure_future(self._restart(index))

    def _event(self, index: int, event: str) -> None:
        self.events = [*self.events, {"engine": index, "event": event, "at": round(time.time(), 3)}][-1000:]

    def hung(self, index: int, cause: str) -> None:
        """Engine ``index`` stopped answering: kill it (Ray restarts it) and treat it as lost."""
        if self.state[index] != "serving":
            return
        engine = self.engines[index]
        if isinstance(engine, Restartable):
            with contextlib.suppress(Exception):  # already gone: the restart below finds out
                engine.kill()
        self.lost(index, f"hung ({cause})")

    async def _restart(self, index: int) -> None:
        engine = self.engines[index]
        t0 = time.perf_counter()
        try:
            version = await asyncio.wait_for(self._come_back(engine, index), self.restart_timeout_s)
        except Exception as exc:  # noqa: BLE001 - gone for good, or never came back: named, the rest serve on
            self.state[index] = "lost"
            why = (f"it did not come back within engine.restart_timeout_s {self.restart_timeout_s:g}"
                   if isinstance(exc, TimeoutError) else _short(exc))
            self._event(index, "not_restarted")
            self.log(f"engine {index} could not be restarted: {why}; {self.serving} of {len(self.engines)} engines "
                     "serving")
            self._changed()
            return
        finally:
            self._restarting.pop(index, None)
        self.restarted_total += 1
        self.rejoined_at[index] = time.monotonic()
        self._event(index, "restarted")
        self.state[index] = "serving"
        self.on_back(index)
        self.log(f"engine {index} restarted and rejoined with version {version} in "
                 f"{time.perf_counter() - t0:.1f} s; {self.serving} of {len(self.engines)} engines serving")
        self._changed()

    async def _come_back(self, engine: Restartable, index: int) -> int:
        """Wait for Ray's new incarnation (not the old one answering before a kill landed), bring it up to the
        current weights, let it rejoin: the version it holds. Ray's "unavailable" while it restarts the actor is
        waited out; "died" (restarts used up) is final."""
        old = self._incarnation[index]
        while True:
            try:
                await engine.restarted()
                incarnation = (await self.engines[index].health()).get("incarnation")
                if old is not None and incarnation == old:
                    await asyncio.sleep(0.2)
                    continue
                version = await self.bring_up(index) if self.bring_up is not None else 0
                await engine.rejoin()
            except Exception as exc:
                if not _restarting_now(exc):
                    raise
                await asyncio.sleep(0.2)
                continue
            self._incarnation[index] = incarnation
            return version

    async def close(self) -> None:
        for task in list(self._restarting.values()):
            task.cancel()
        await asyncio.gather(*self._restarting.values(), return_exceptions=True)

    # ---- heartbeats -------------------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Probe every serving engine each ``heartbeat_interval_s`` (run it as a task; cancel it to stop)."""
        while True:
            await asyncio.gather(*(self.probe(i) for i in range(len(self.engines)) if self.state[i] == "serving"))
            await asyncio.sleep(self.heartbeat_interval_s)

    async def probe(self, index: int) -> None:
        """One heartbeat of engine ``index``: no answer in time, or no progress with requests in flight, is a
        hang; an actor death or a new incarnation (Ray restarted it before anyone noticed) is a loss."""
        sent_at = time.monotonic()
        try:
            report = await asyncio.wait_for(self.engines[index].health(), self.heartbeat_timeout_s)
        except TimeoutError:
            if sent_at < self.rejoined_at[index]:
                return
            self.hung(index, f"no heartbeat within engine.heartbeat_timeout_s {self.heartbeat_timeout_s:g}")
            return
        except Exception as exc:  # noqa: BLE001 - a failing probe of a live engine is not a loss
            if is_actor_death(exc):
                self.lost(index, f"its actor died ({_short(exc)})", sent_at=sent_at)
            return
        if self.state[index] != "serving" or sent_at < self.rejoined_at[index]:
            return
        incarnation = report.get("incarnation")
        if self._incarnation[index] is None:
            self._incarnation[index] = incarnation
        elif incarnation != self._incarnation[index]:
            self.lost(index, "its actor was restarted")
            return
        in_flight = int(report.get("in_flight") or 0)
        key = report.get("progress")
        now = time.monotonic()
        seen = self._progress[index]
        if in_flight <= 0 or key is None or seen is None or seen[0] != key:
            self._progress[index] = (key, now) if in_flight > 0 else None
            return
        if now - seen[1] >= self.heartbeat_timeout_s:
            self.hung(index, f"{in_flight} requests in flight and no progress for {now - seen[1]:.0f} s "
                             f"(engine.heartbeat_timeout_s {self.heartbeat_timeout_s:g})")


def _restarting_now(exc: BaseException) -> bool:
    try:
        import ray.exceptions as rex
    except ImportError:  # pragma: no cover
        return False
    return isinstance(exc, rex.ActorUnavailableError) or (
        isinstance(exc, rex.RayActorError) and not isinstance(exc, rex.ActorDiedError))
