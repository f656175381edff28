"""The trainer's weights followed from the file system: :class:`WeightFollower` polls ``broadcasts/`` for a newer
``step_N`` with ``STABLE``, validates it on one engine before anything pauses (a bad checkpoint is one log line and
changes nothing), holds the driver (``follow.inflight``), loads it into every engine, and releases. A published LoRA
adapter is loaded in place as :data:`LORA_NAME`. ``follow.weights: wire`` (wire.py) follows pushed tensors instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..data import layout
from ..engines.healer import is_actor_death
from ..engines.lora import is_adapter_dir
from ..handles import EngineHandle
from ..loop import AllEnginesDied, RolloutDriver

# the name follow mode serves a published LoRA adapter as (on its own engines; recorded in each shard row's ``lora``)
LORA_NAME = "policy"


class WeightFollower:
    """Loads the trainer's newest stable checkpoint into every engine, one validation first.

    ``holder`` is the driver (its ``hold_for_update`` / ``release``); ``on_version`` is told each new
    version once every engine holds it."""

    def __init__(self, run_dir: Path, engines: Sequence[EngineHandle], holder: RolloutDriver, *, inflight: str,
                 poll_interval_s: float, log: Callable[[str], None], start_version: int = 0,
                 keep_broadcasts: int | None = None, load_timeout_s: float = 600.0) -> None:
        self.run_dir = run_dir
        self.load_timeout_s = load_timeout_s
        self.engines = list(engines)
        self.holder = holder
        self.inflight = inflight
        self.poll_interval_s = poll_interval_s
        self.log = log
        self.keep_broadcasts = keep_broadcasts
        self.removed_broadcasts = 0
        self.version = start_version  # the version every engine holds
        self.engine_versions: list[int] = [start_version] * len(self.engines)  # each engine's (status.json)
        self.refused: dict[int, float] = {}  # version -> STABLE mtime of a checkpoint that was refused
        # one record per load, with the unix time it completed (``at``): each batch lists those in its window
        self.loads: list[dict[str, Any]] = []
        self.changed = asyncio.Condition()
        # what status.json shows: the phase of a load in progress, its checkpoint and since when, the last failure
        self.phase: str | None = None  # "validating" | "loading"
        self.phase_of: tuple[int, float] | None = None  # (version, since)
        self.last_error: dict[str, Any] | None = None
        self.on_change: Callable[[], None] = lambda: None
        # what the engines serve beyond their base weights (a restarted engine gets the same: bring_up)
        self.full: tuple[Path, int] | None = None  # the last full checkpoint loaded, and its version
        self.adapter: tuple[Path, int] | None = None  # the adapter served on top of it
        self._loading = asyncio.Lock()
        # broadcast faults that change nothing are each named once (_notice): the steps seen so far, and the
        # STABLE (version, mtime) of the step the engines hold
        self._known: set[int] = set(layout.stable_versions(run_dir))
        self.loaded_stable: tuple[int, float] | None = None
        self._ignored: set[str] = set()  # broadcasts/ entries named like a step that are not one (named once)

    def newest(self) -> int | None:
        """The newest stable version newer than the engines' and not already refused (as it is now)."""
        for n in reversed(layout.stable_versions(self.run_dir)):
            if n <= self.version:
                return None
            stable = layout.broadcast_dir(self.run_dir, n) / layout.STABLE
            with contextlib.suppress(OSError):
                if self.refused.get(n) != stable.stat().st_mtime:
                    return n
        return None

    def _skipped(self, n: int) -> str:
        """The log's note for a step that skips ahead of the engines' version + 1 (empty when it does not)."""
        if n <= self.version + 1:
            return ""
        gap = f"v{self.version + 1}" if n == self.version + 2 else f"v{self.version + 1}..v{n - 1}"
        return f"; skipped ahead from v{self.version}: {gap} not published, or not stable when v{n} was found"

    async def _bounded(self, index: int, call: Any, what: str) -> Any:
        """Await engine ``index``'s ``call`` for at most ``load_timeout_s``; past it the engine is hung (killed,
        restarted on the current weights) and :class:`TimeoutError` is raised."""
        try:
            return await asyncio.wait_for(call, self.load_timeout_s)
        except TimeoutError:
            self.holder.healer.hung(index, f"{what} did not finish within follow.load_timeout_s "
                                           f"{self.load_timeout_s:g}")
            raise

    def _live(self) -> list[int]:
        """The engines still alive; none: :class:`AllEnginesDied` (a service waiting on a trainer would otherwise
        wait for ever on engines that can no longer load anything)."""
        live = self.holder.router.alive()
        if not live:
            raise AllEnginesDied.of(len(self.engines))
        return live

    async def poll_once(self) -> bool:
        """Load the newest new version if there is one; True when the engines changed version."""
        if not self.holder.router.alive() and self.holder.healer.any_coming_back():
            return False  # no engine to load into until one is back (it comes back on self.version)
        self._notice()
        n = self.newest()
        changed = n is not None and await self.load(n)
        if changed and self.keep_broadcasts is not None:
            self.prune()
        return changed

    def prune(self) -> None:
        """``follow.keep_broadcasts: N``: remove the steps older than the newest N seen, except what the engines
        hold (a restarted engine is brought up from it). A step that cannot be removed is named and left."""
        keep = {held[0] for held in (self.full, self.adapter) if held is not None}
        steps = sorted(n for n in layout.step_numbers(self.run_dir) if n > 0)
        for n in steps[:-self.keep_broadcasts]:
            path = layout.broadcast_dir(self.run_dir, n)
            if path in keep or n > self.version:
                continue
            try:
                shutil.rmtree(path)
            except FileNotFoundError:  # the trainer removed it first (prime-rl deletes step_{N-2})
                continue
            except OSError as exc:
                self._error(f"follow.keep_broadcasts: could not remove {path} ({exc}); it is left")
                continue
            self.removed_broadcasts += 1

    def _notice(self) -> None:
        """One line for each broadcast fault that changes nothing: a step older than the engines' version that
        appears after that version was loaded, an entry named like a step that is not one, and the STABLE of the
        step the engines hold removed or rewritten."""
        stable = layout.stable_versions(self.run_dir)
        for n in stable:
            if n < self.version and n not in self._known:
                self._error(f"{layout.broadcast_dir(self.run_dir, n)} appeared after version {self.version} was "
                            "loaded: older than what the engines hold, ignored")
        self._known.update(stable)
        for name, why in layout.not_broadcasts(self.run_dir).items():
            if name not in self._ignored:
                self._ignored.add(name)
                self._error(f"{self.run_dir / layout.BROADCASTS / name} is not a broadcast, ignored: {why}")
        if self.loaded_stable is None:
            return
        n, mtime = self.loaded_stable
        marker = layout.broadcast_dir(self.run_dir, n) / layout.STABLE
        try:
            now: float | None = marker.stat().st_mtime
        except OSError:
            now = None
        if now != mtime:
            self.loaded_stable = None  # named once
            self._error(f"{marker} was {'removed' if now is None else 'rewritten'} after version {n} was loaded: "
                        "the engines keep the weights they validated and loaded (a version is loaded once)")

    def pending_what(self, n: int, phase: str) -> str:
        """status.json's ``waiting_for`` while version ``n`` is in ``phase`` (validating | loading)."""
        verb = "validated" if phase == "validating" else "loaded into every engine"
        return f"{layout.broadcast_dir(self.run_dir, n)} to be {verb}"

    async def watch(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.poll_interval_s)

    def _phase(self, phase: str | None, n: int | None = None) -> None:
        self.phase = phase
        self.phase_of = None if n is None else (n, time.time())
        self.on_change()

    def _error(self, message: str) -> None:
        self.last_error = {"message": message, "at": round(time.time(), 3)}
        self.log(message)

    async def load(self, n: int) -> bool:
        async with self._loading:
            self._phase("validating", n)
            try:
                return await self._load(n)
            except FileNotFoundError as exc:  # the trainer removed it (prime-rl deletes step_{N-2}) under us
                self._error(f"weights {layout.broadcast_dir(self.run_dir, n)} vanished before it was loaded "
                            f"({exc.filename or exc}); the engines stay on version {self.version}")
                return False
            finally:
                self._phase(None)

    async def bring_up(self, index: int) -> int:
        """Load what every other engine serves into restarted engine ``index`` (its fresh incarnation holds the
        base weights, version 0): the last full checkpoint, then the adapter, if any. Returns the version. A load
        in progress finishes first, so the engine rejoins on the version the others hold."""
        async with self._loading:
            engine = self.engines[index]
            if self.full is not None:
                path, version = self.full
                await engine.update_weights(str(path), version)
            if self.adapter is not None:
                path, version = self.adapter
                await engine.load_lora_adapter(LORA_NAME, str(path), version)
            self.engine_versions[index] = self.version
            return self.version

    async def _load(self, n: int) -> bool:
        path = layout.broadcast_dir(self.run_dir, n)
        stable_mtime = (path / layout.STABLE).stat().st_mtime
        seen = time.time()
        blocking = unreadable_entries(path)
        if blocking:  # a read of a FIFO or device may never return: refused before any engine opens it
            self.refused[n] = stable_mtime
            self._error(f"weights {path} refused: {blocking[0]} is not a regular file (a FIFO, socket or device "
                        f"would block or never end); the engines stay on version {self.version}")
            return False
        if is_adapter_dir(path):
            return await self._load_adapter(n, path, stable_mtime, seen)
        t0 = time.perf_counter()
        while True:  # before anything pauses: a bad checkpoint must not cost the running rollouts anything
            live = self._live()  # an engine that died is out of routing: nothing to load into it
            try:
                await self._bounded(live[0], self.engines[live[0]].validate_weights(str(path)),
                                    f"validating {path.name}")
                break
            except TimeoutError:  # a stalled file system or a file that never ends: refused, not retried
                self.refused[n] = stable_mtime
                self._error(f"weights {path} refused: engine {live[0]} did not validate it within "
                            f"follow.load_timeout_s {self.load_timeout_s:g}; the engines stay on version "
                            f"{self.version}")
                return False
            except Exception as exc:  # noqa: BLE001 - any refusal: named, logged once, the run goes on
                if is_actor_death(exc):  # the validating engine died (maybe while the service idled): the next
                    self.holder.healer.lost(live[0], f"it died validating {path.name} ({type(exc).__name__})")
                    continue
                self.refused[n] = stable_mtime
                self._error(f"weights {path} refused: {exc}; the engines stay on version {self.version}")
                return False
        t1 = time.perf_counter()
        self._phase("loading", n)
        try:
            aborted = await self.holder.hold_for_update(self.inflight)  # type: ignore[arg-type]
            t2 = time.perf_counter()
            # keep: the turns in flight go on under the new weights, each token stamped by the engine
            keep = {"keep_running": True} if self.inflight == "keep" else {}
            results = await asyncio.gather(*(self._bounded(i, self.engines[i].update_weights(str(path), n, **keep),
                                                           f"loading {path.name}") for i in live),
                                           return_exceptions=True)
        finally:
            self.holder.release()
        t3 = time.perf_counter()
        failed = []
        for i, r in zip(live, results):
            if isinstance(r, BaseException):
                if is_actor_death(r):  # its turns are re-sent to the others, as in any run
                    self.holder.healer.lost(i, f"it died loading {path.name} ({type(r).__name__})")
                elif isinstance(r, TimeoutError):
                    pass  # named and restarting (_bounded): it comes back on the version the others load
                else:
                    failed.append(r)
            else:
                self.engine_versions[i] = n
        self._live()  # every engine died during the load: the service ends (AllEnginesDied), nothing to wait for
        if failed:
            # validated yet refused by an engine: those that loaded it stamp version n, the others keep theirs,
            # and each token records the version that sampled it, so the sealing check still holds
            self.refused[n] = stable_mtime
            self._error(f"weights {path}: {len(failed)} of {len(live)} engines failed to load it "
                        f"({failed[0]}); the others hold version {n}")
            return False
        self.full = (path, n)  # an adapter served before stays on top of it (the driver still samples with it)
        skipped = self._skipped(n)
        self.loaded_stable = (n, stable_mtime)
        async with self.changed:
            self.version = n
            self.changed.notify_all()
        record = {"version": n, "validate_s": round(t1 - t0, 3), "hold_s": round(t2 - t1, 3),
                  "load_s": round(t3 - t2, 3), "aborted_requests": aborted,
                  # STABLE written -> every engine generating again under the new weights (poll delay included)
                  "stable_to_resumed_s": round(time.time() - stable_mtime, 3),
                  "detect_s": round(max(0.0, seen - stable_mtime), 3), "at": round(time.time(), 3)}
        self.loads.append(record)
        held = ("the turns in flight kept running under them" if self.inflight == "keep"
                else f"{aborted} turns stopped to go on under them")
        self.log(f"weights v{n} loaded in {record['load_s']:.2f} s (validated in {record['validate_s']:.2f} s; "
                 f"{held}); STABLE -> generating {record['stable_to_resumed_s']:.2f} s{skipped}")
        return True


    async def _load_adapter(self, n: int, path: Path, stable_mtime: float, seen: float) -> bool:
        """A step holding a LoRA adapter (prime-rl's LoRA runs publish only ``adapter_model.safetensors`` and
        ``adapter_config.json``): every engine loads it as :data:`LORA_NAME` at version ``n``, in place, and the
        rollouts' turns are sampled with it from then on. Nothing is held: each engine checks the adapter before
        installing it (a refused one changes no engine), and swaps it between two steps, each token stamped with
        the version that sampled it (the vLLM backend lets the running turns of the adapter finish first)."""
        live = self._live()
        self._phase("loading", n)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self._bounded(i, self.engines[i].load_lora_adapter(LORA_NAME, str(path), n),
                                                       f"loading adapter {path.name}") for i in live),
                                       return_exceptions=True)
        failed = []
        for i, r in zip(live, results):
            if isinstance(r, BaseException):
                if is_actor_death(r):
                    self.holder.healer.lost(i, f"it died loading adapter {path.name} ({type(r).__name__})")
                elif isinstance(r, TimeoutError):
                    pass  # named and restarting (_bounded)
                else:
                    failed.append(r)
            else:
                self.engine_versions[i] = n
        self._live()
        if failed:
            self.refused[n] = stable_mtime
            self._error(f"adapter {path} refused: {root_message(failed[0])}; the engines stay on version "
                        f"{self.version}")
            return False
        self.holder.lora = LORA_NAME
        self.adapter = (path, n)
        skipped = self._skipped(n)
        self.loaded_stable = (n, stable_mtime)
        async with self.changed:
            self.version = n
            self.changed.notify_all()
        load_s = time.perf_counter() - t0
        record = {"version": n, "validate_s": 0.0, "hold_s": 0.0, "load_s": round(load_s, 3), "aborted_requests": 0,
                  "adapter": True, "stable_to_resumed_s": round(time.time() - stable_mtime, 3),
                  "detect_s": round(max(0.0, seen - stable_mtime), 3), "at": round(time.time(), 3)}
        self.loads.append(record)
        self.log(f"adapter v{n} loaded in {load_s:.2f} s (checked and swapped in place); STABLE -> generating "
                 f"{record['stable_to_resumed_s']:.2f} s{skipped}")
        return True


def unreadable_entries(path: Path) -> list[str]:
    """The names in checkpoint ``path`` that are not regular files or directories (symlinks followed)."""
    bad = []
    for entry in sorted(path.iterdir()):
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue  # a dangling link or a file removed meanwhile: validation names what is missing
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            bad.append(entry.name)
    return bad


def root_message(exc: BaseException) -> str:
    """The engine's own message of an exception that came through Ray (its ``cause``), else its text."""
    cause = getattr(exc, "cause", None)
    return str(cause if cause is not None else exc)
