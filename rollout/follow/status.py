"""``RUN_DIR/status.json``: what a running ``tito run --follow`` is doing, rewritten every few seconds.

:class:`StatusWriter` runs a thread (``tito-follow-status``) that asks the service for a snapshot and writes it
atomically (a hidden temporary, then a rename: a reader never sees half a file) every
``follow.status_interval_s`` seconds, idle included, and at once when :meth:`StatusWriter.poke` is called (a
state change). A thread, not an event-loop task: a service whose loop is stuck still says so, through the
progress fields, rather than going silent (which reads as a dead service).

The file (every key always present; docs/follow.md, "Status"):

* ``state`` — ``starting``, ``sampling``, ``waiting_for_weights``, ``validating``, ``loading``, ``stopping``, or
  ``stopped`` (written last, on the way out: a clean end or a signal);
* ``batch`` (the batch it works on: the oldest one sampling, else the one waiting to be admitted), ``sealed``,
  ``sampling`` (the batches whose rollouts run), ``rollouts_done`` (since start);
* ``version`` (per engine, by index; None for a dead one), ``engines_alive``, ``engines_configured``;
* ``waiting_for`` (``{"what", "since"}``: the weights admission needs, a checkpoint being validated or loaded,
  the rollouts of a batch, or the previous batch's seal), ``last_error`` (``{"message", "at"}`` or None);
* ``updated_at``, ``progressed_at`` (the last time a rollout finished, a batch was admitted or sealed, or the
  engines changed version), ``started_at`` (unix seconds), ``interval_s``, ``stall_after_s``;
* ``pid``, ``host``, ``argv``, ``run_dir``, ``recent`` (the last state changes, ``{"state", "at"}``).

:func:`health` judges a status as ``tito status`` does: ``stale`` (the service is gone: ``updated_at`` older
than 3 intervals, or its pid is dead on this host), ``stalled`` (nothing progressed for ``stall_after_s``),
else ``healthy``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

STATUS = "status.json"
STATES = ("starting", "sampling", "waiting_for_weights", "validating", "loading", "stopping", "stopped")
RECENT = 12  # state changes kept in the file
STALE_INTERVALS = 3  # updated_at older than this many intervals: the writer is gone

Health = Literal["healthy", "stale", "stalled"]


def status_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STATUS


def write_status_atomic(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON to a hidden temporary beside ``path``, then renamed onto it. No fsync: the file is
    rewritten every few seconds, and a rename is atomic against a reader (and a killed writer) without it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def read_status(run_dir: str | Path) -> dict[str, Any] | None:
    """RUN_DIR's status.json, or None when it has none. Raises ValueError naming the file if it is not JSON."""
    path = status_path(run_dir)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _pid_stopped(pid: int) -> bool:
    """Linux: the process is stopped (SIGSTOP, a debugger); elsewhere, or unreadable: False."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] in (["T"], ["t"])


def health(status: dict[str, Any], now: float | None = None) -> tuple[Health, str]:
    """(``healthy`` | ``stale`` | ``stalled``, one line saying why)."""
    now = time.time() if now is None else now
    interval = float(status.get("interval_s") or 2.0)
    age = now - float(status.get("updated_at") or 0.0)
    pid, host = status.get("pid"), status.get("host")
    if status.get("state") == "stopped":
        return "stale", f"the service stopped {age:.0f} s ago (pid {pid})"
    if isinstance(pid, int) and host == socket.gethostname() and not _pid_alive(pid):
        return "stale", f"the service is gone: pid {pid} is not running (last update {age:.0f} s ago)"
    if age > STALE_INTERVALS * interval:
        if isinstance(pid, int) and host == socket.gethostname() and _pid_stopped(pid):
            return "stale", (f"the service is stopped: pid {pid} is in state T (SIGSTOP or a debugger; SIGCONT "
                             f"resumes it), status.json last updated {age:.0f} s ago")
        return "stale", (f"the service is gone: status.json last updated {age:.0f} s ago (it is rewritten every "
                         f"{interval:g} s)")
    stall = status.get("stall_after_s")
    quiet = now - float(status.get("progressed_at") or status.get("started_at") or now)
    if stall is not None and quiet > float(stall):
        w = status.get("waiting_for") or {}
        what = w.get("what") or status.get("state")
        return "stalled", f"stalled: nothing progressed for {quiet:.0f} s (follow.stall_after_s {stall:g}); waiting for {what}"
    return "healthy", f"healthy: {status.get('state')}"


class StatusWriter:
    """Writes ``snapshot()`` (a dict, the service's part of the file) to RUN_DIR/status.json from a thread.

    ``snapshot`` is called on the writer's thread: it must only read the service's attributes (copies of
    lists and dicts; a RuntimeError from a dict changing size is retried at the next write)."""

    def __init__(self, run_dir: str | Path, snapshot: Callable[[], dict[str, Any]], *, interval_s: float,
                 stall_after_s: float | None) -> None:
        self.path = status_path(run_dir)
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.stall_after_s = stall_after_s
        self.started_at = time.time()
        self.progressed_at = self.started_at
        self._progress_key: Any = None
        self.recent: list[dict[str, Any]] = []
        self._state: str | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one write at a time (the thread's, and the last one from close)
        self._thread: threading.Thread | None = None
        self.writes = 0

    def start(self) -> None:
        self.write()
        self._thread = threading.Thread(target=self._loop, name="tito-follow-status", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Write soon (a state change): the thread wakes now instead of at the next interval."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            with contextlib.suppress(RuntimeError, OSError):  # a torn snapshot or a full disk: the next one
                self.write()

    def write(self, **override: Any) -> dict[str, Any]:
        with self._lock:
            snap = {**self.snapshot(), **override}
            now = time.time()
            key = snap.pop("progress", None)
            if key != self._progress_key:
                self._progress_key = key
                self.progressed_at = now
            state = snap.get("state")
            if state != self._state:
                self._state = state
                self.recent = [*self.recent, {"state": state, "at": round(now, 3)}][-RECENT:]
            data = {**snap, "updated_at": round(now, 3), "progressed_at": round(self.progressed_at, 3),
                    "started_at": round(self.started_at, 3), "interval_s": self.interval_s,
                    "stall_after_s": self.stall_after_s, "pid": os.getpid(), "host": socket.gethostname(),
                    "recent": self.recent}
            write_status_atomic(self.path, data)
            self.writes += 1
            return data

    def close(self, **final: Any) -> None:
        """Stop the thread and write once more (``final`` overrides the snapshot: ``state="stopped"``)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(RuntimeError, OSError):
            self.write(**final)
