"""Run untrusted Python in a sandboxed subprocess: no network, no view of the host, an unprivileged user,
resource limits, a wall-clock timeout, and nothing left running afterwards.

What :func:`run_python` does, and what each guarantee relies on (details: docs/environments.md):

- **Process.** ``sys.executable -I -u -c BOOTSTRAP`` (``sandbox_init.py``); the code arrives on stdin (no
  argv size limit, nothing in ``ps``). ``-I`` ignores ``PYTHON*`` variables, the user site directory and the
  current directory. The environment is replaced by a minimal one (``PATH``, ``LANG``, ``HOME``), so nothing
  of the service's environment (tokens, credentials) leaks in.
- **Namespaces** (``network="isolated"``, the default). The bootstrap moves the code into new user, mount,
  pid, network, IPC and UTS namespaces (``unshare`` via ctypes; no external binary). The network namespace
  has only a loopback interface, down: every ``connect`` fails, the host's 127.0.0.1, its abstract Unix
  sockets (Ray's) and DNS included. The pid namespace holds only the sandbox: host processes, their
  ``/proc/<pid>/environ`` and ``/proc/<pid>/ns/*`` do not exist there; the code's parent is the sandbox's pid 1.
- **File system.** A fresh root: read-only binds of ``/usr`` (and the merged-/usr links) and of the Python
  installation (the interpreter's prefix and the venv), a fresh ``/proc``, a minimal ``/dev`` (null, zero,
  full, random, urandom, shm), a private ``/etc`` (the sandbox's own ``passwd``/``group``/``hosts``) and a
  private tmpfs ``/tmp`` (``disk_mb``) holding the work directory (cwd and ``HOME``). Everything else of the
  host (``/etc``, ``/home``, ``/root``, this repository, other Unix sockets, ``/sys``) is absent, the root is
  read-only, and the tmpfs vanishes with the sandbox.
- **Privileges.** The code runs as uid/gid 1000 of the user namespace, mapped to host ``nobody`` when the
  service is root (its own uid otherwise), with every capability dropped (bounding set included) and
  no_new_privs, so it cannot ``setns`` back, mount, or gain privileges through setuid files.
- **Limits** (``resource.setrlimit``, before the code): ``RLIMIT_AS`` (allocations beyond it raise
  ``MemoryError``), ``RLIMIT_CPU`` (SIGXCPU/SIGKILL), ``RLIMIT_FSIZE`` (largest file), ``RLIMIT_CORE`` = 0,
  and ``RLIMIT_NPROC`` (``max_processes``, threads included; the kernel counts it per user namespace and uid,
  so it counts exactly this run's processes, and it binds because the uid is not host root).
- **Nothing outlives the call.** The code runs as the child of the sandbox's pid 1; when it ends, pid 1 ends,
  and the kernel kills everything else in the pid namespace (``setsid`` and double-forked children
  included) before the call returns. On timeout or cancellation, pid 1 is SIGKILLed (same effect) and the
  whole process group too.
- **Output.** stdout and stderr are read as they come; only the first ``max_output_bytes`` of each are kept
  (the rest is drained and counted), so a print loop cannot exhaust the service's memory.

The bootstrap reports how isolation went on a header line, before the code runs (so the code cannot forge
it). Without isolation (``SandboxUnavailable`` unless ``network`` is ``"best_effort"`` or ``"allowed"``), the
code runs as the service's user on the host file system, as before: only the rlimits, the process group kill
and the minimal environment apply. The limits are set inside the child rather than in ``preexec_fn``,
because ``preexec_fn`` is not safe in a process with threads (Ray workers have several).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import msgspec

from . import sandbox_init
from .sandbox_init import HEADER

NetworkPolicy = Literal["isolated", "best_effort", "allowed"]

# The bootstrap writes one header line to stdout before the untrusted code runs, so the first line of
# stdout is always its own: how isolation went. The code cannot forge it (it runs after), and the parent
# strips it. "tito-sandbox:" + one of: isolated | allowed | not-isolated <error> | refused <error>
_HEADER = HEADER.encode()
_HEADER_ROOM = 1024
# after the process group is killed, how long to wait for the pipes to close and the exit status to arrive
_DRAIN_S = 1.0
# after the sandbox's pid 1 is killed, how long to wait for the kernel to end the rest of its pid namespace (a
# fork bomb's processes take a while to die on a loaded machine); past it, the process group is killed anyway
_TEARDOWN_S = 5.0

# Runs as the child, before the untrusted code: read the code, isolate, limit, then execute the code as
# __main__ with fresh globals (see sandbox_init.py). Its source is read once here and passed with -c, so the
# child needs no path of this repository.
_BOOTSTRAP = Path(sandbox_init.__file__).read_text()


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot provide the isolation it was asked for; the code was not run."""


class SandboxResult(msgspec.Struct, kw_only=True):
    """The outcome of one run. ``exit_code`` is the process's status (negative: killed by that signal),
    None only when it could not be collected. ``*_truncated`` count the bytes dropped from each stream."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    stdout_truncated: int = 0
    stderr_truncated: int = 0
    network_isolated: bool = True

    def describe(self, timeout_s: float) -> str:
        """The result as text for a tool message: status line, then stdout and stderr when not empty."""
        if self.timed_out:
            status = f"timed out after {timeout_s:g} s (killed)"
        elif self.exit_code is not None and self.exit_code < 0:
            try:
                status = f"killed by {signal.Signals(-self.exit_code).name}"
            except ValueError:
                status = f"killed by signal {-self.exit_code}"
            if self.exit_code == -signal.SIGXCPU:
                status += " (CPU time limit)"
        else:
            status = f"exit code {self.exit_code}"
        parts = [status]
        for label, text, dropped in (
            ("stdout", self.stdout, self.stdout_truncated),
            ("stderr", self.stderr, self.stderr_truncated),
        ):
            if text or dropped:
                note = f"\n[... {dropped} more bytes truncated]" if dropped else ""
                parts.append(f"{label}:\n{text}{note}")
        return "\n".join(parts)


class _Capture:
    """Up to ``limit`` bytes of a stream, and how many bytes after them were read and dropped. Kept on an
    object (not returned) so that what was read survives the reader being cancelled."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]
            self.dropped += max(0, len(chunk) - max(room, 0))


async def _exited(process: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Whether the process exited within ``timeout_s``. ``Process.wait()`` alone is not enough: it also waits
    for the output pipes to close, which a background child that inherited them can delay forever; the
    exit status itself (``returncode``) arrives when the process exits, so it is checked on a short poll."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    waiter = asyncio.ensure_future(process.wait())  # the fast path: exit and pipes closed together
    delay = 0.005
    try:
        while process.returncode is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await asyncio.wait({waiter}, timeout=min(delay, remaining))
            delay = min(delay * 2, 0.05)
        return True
    finally:
        waiter.cancel()


# The steps where a host policy, not the sandbox, is the usual cause: creating the namespaces, mapping the ids,
# and any step the kernel refused with EPERM/EACCES (AppArmor and seccomp policies let unshare succeed and
# refuse the mounts).
_POLICY_STEPS = ("unshare(", "write uid/gid maps", "uid/gid maps were not written")
_POLICY_ERRORS = ("Operation not permitted", "Permission denied")


def _refusal_hint(reason: str) -> str:
    """What to do about a failed setup step: blame the host's namespace policy only when that can be the cause."""
    if reason.startswith(_POLICY_STEPS) or any(error in reason for error in _POLICY_ERRORS):
        return (
            "The sandbox needs user namespaces (run as root, or allow unprivileged ones: sysctl "
            "user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1 where that exists, no "
            "AppArmor/container policy denying them)."
        )
    return (
        "The namespaces were created, so the host allows them: building the sandbox's file system failed at "
        "the step named."
    )


def _init_pid(header: bytes) -> int | None:
    """The host pid of the sandbox's pid 1, from the header line (complete or not yet there)."""
    line, newline, _ = header.partition(b"\n")
    words = line.removeprefix(_HEADER).split()
    if newline and line.startswith(_HEADER) and len(words) == 2 and words[0] == b"isolated" and words[1].isdigit():
        return int(words[1])
    return None


def _kill_init(pid: int) -> None:
    """SIGKILL the sandbox's pid 1: the kernel then kills every process in its pid namespace, and the call's
    own process exits only once they are all gone. Through a pidfd, and only while the call's process is
    still running (so the sandbox's parent has not reaped pid 1, and its number cannot have been reused)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def _retrieve(future: asyncio.Future) -> None:
    """Mark a future's outcome as seen: a cancelled gather holds a CancelledError that, never retrieved, is
    logged with a traceback when the future is collected, at any later point of the program."""
    if not future.cancelled():
        future.exception()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    cpu_s: int | None = None,
    max_output_bytes: int = 8192,
    max_file_mb: int = 64,
    network: NetworkPolicy = "isolated",
    max_processes: int = 128,
    disk_mb: int = 256,
) -> SandboxResult:
    """Run ``code`` in a sandboxed subprocess (see the module docstring) and return what it printed.

    ``cpu_s`` defaults to the timeout rounded up, plus one second: a single-threaded busy loop burns CPU
    time as fast as wall time, and at an equal limit SIGXCPU raced the wall-clock timeout, so a timed-out
    run was sometimes reported as a CPU kill. The CPU limit stays the backstop for code that burns CPU on
    several threads faster than the clock runs. Never raises for anything the code does (a crash, a
    timeout, a limit hit: all are in the result); raises :class:`SandboxUnavailable` (naming the step that
    failed) when ``network`` is ``"isolated"`` and the sandbox cannot be built, and :class:`OSError` when
    the interpreter cannot be started. ``max_processes`` bounds the code's processes and threads together
    (its own included); ``disk_mb`` sizes the private ``/tmp`` (and ``/dev/shm``), which live in memory.
    """
    cpu = cpu_s if cpu_s is not None else max(1, int(-(-timeout_s // 1))) + 1
    start = time.monotonic()
    # ignore_cleanup_errors: without the sandbox, a process that escaped the kill may still be writing there
    with tempfile.TemporaryDirectory(prefix="tito-sandbox-", ignore_cleanup_errors=True) as workdir:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
        limits = (memory_mb * 2**20, cpu, max_file_mb * 2**20, max_processes, disk_mb * 2**20)
        args = [*(str(n) for n in limits), workdir]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",  # isolated mode: no PYTHON* variables, no user site, no cwd on sys.path
            "-u",  # unbuffered, so output printed before a timeout kill is not lost
            "-c",
            _BOOTSTRAP,
            network,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,  # its own process group, so a timeout kills everything it started
        )
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        out_capture, err_capture = _Capture(max_output_bytes + _HEADER_ROOM), _Capture(max_output_bytes)
        readers = asyncio.gather(out_capture.read(process.stdout), err_capture.read(process.stderr))
        readers.add_done_callback(_retrieve)  # a cancelled gather otherwise logs "exception was never retrieved"
        timed_out = False
        try:
            try:
                process.stdin.write(code.encode("utf-8", errors="replace"))
                await process.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the child died before reading all of it; its status says why
            process.stdin.close()
            timed_out = not await _exited(process, timeout_s)
        finally:
            # also on cancellation: never leave a child (or its children) running. In the sandbox, kill its
            # pid 1 and wait for the call's process: it exits when the whole pid namespace is gone, so no
            # process of the code outlives the call, not even one that left the process group. Then (and
            # without the sandbox: only) the process group.
            try:
                init = _init_pid(bytes(out_capture.kept[:_HEADER_ROOM])) if process.returncode is None else None
                if init is not None:
                    _kill_init(init)
                    await _exited(process, _TEARDOWN_S)
                _kill_group(process.pid)
                # Bounded waits: without the sandbox, a process that left the group (setsid) and still holds the
                # pipes must not hang the rollout. What was read so far is kept; the runaway keeps its rlimits.
                try:
                    await asyncio.wait_for(readers, _DRAIN_S)
                except TimeoutError:
                    pass
                if process.returncode is None:
                    try:
                        await asyncio.wait_for(process.wait(), _DRAIN_S)
                    except TimeoutError:
                        pass
            finally:
                # Even when a second cancellation ends the waits above (asyncio.run cancelling a gather's other
                # runs): kill the group, and close our pipe ends now, while the loop runs. Left to the transport's
                # __del__, the close runs after the loop closed and raises "Event loop is closed" (issue 23).
                _kill_group(process.pid)
                readers.cancel()
                transport = getattr(process, "_transport", None)
                if transport is not None:
                    transport.close()
        out, out_dropped = bytes(out_capture.kept), out_capture.dropped
        err, err_dropped = bytes(err_capture.kept), err_capture.dropped
    header, _, out = out.partition(b"\n") if out.startswith(_HEADER) else (b"", b"", out)
    status = header[len(_HEADER) :].decode("utf-8", errors="replace")
    if status.startswith("refused"):
        reason = status.removeprefix("refused ")
        raise SandboxUnavailable(
            f"sandbox: cannot isolate the code ({reason}). {_refusal_hint(reason)} Or set network='best_effort' "
            "or 'allowed' to run without isolation. The code was not run."
        )
    # the header's room was read on top of the cap: re-apply the cap to what the code printed
    out_dropped += max(0, len(out) - max_output_bytes)
    return SandboxResult(
        stdout=out[:max_output_bytes].decode("utf-8", errors="replace"),
        stderr=err.decode("utf-8", errors="replace"),
        exit_code=process.returncode,
        timed_out=timed_out,
        duration_s=time.monotonic() - start,
        stdout_truncated=out_dropped,
        stderr_truncated=err_dropped,
        network_isolated=status.startswith("isolated"),
    )
