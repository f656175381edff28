"""Run untrusted Python in a subprocess with a wall-clock timeout, resource limits and no network.

What :func:`run_python` does, and what each guarantee relies on:

- **Process.** ``sys.executable -I -u -c BOOTSTRAP``; the code arrives on stdin (no argv size limit, nothing
  in ``ps``). ``-I`` (isolated mode) ignores ``PYTHON*`` environment variables, the user site directory and
  the current directory on ``sys.path``. The environment is replaced by a minimal one (``PATH``, ``LANG``,
  ``HOME`` = the work directory), so nothing of the service's environment (tokens, credentials) leaks in.
  The working directory is a fresh temporary directory, deleted afterwards.
- **No network.** Before running the code, the bootstrap moves its own process into a new, empty network
  namespace with ``unshare(CLONE_NEWNET)`` (via ctypes: ``os.unshare`` is Python 3.12+). The namespace
  has only a loopback interface, and it is down: every ``connect`` fails, including to 127.0.0.1 of the
  host, and DNS fails. This needs CAP_SYS_ADMIN (root, as on our machines); without it the bootstrap
  tries ``CLONE_NEWUSER | CLONE_NEWNET`` (an unprivileged user namespace, where the kernel allows them).
  If both fail, the bootstrap exits *before* running the code (it reports this on a header line the code
  cannot forge) and :func:`run_python` raises :class:`SandboxUnavailable` — unless
  ``network="best_effort"`` (run anyway, flagged in the result) or ``network="allowed"`` (no isolation
  attempted).
- **Limits** (``resource.setrlimit`` in the bootstrap, after the unshare and before the code):
  ``RLIMIT_AS`` (address space: allocations beyond it raise ``MemoryError``), ``RLIMIT_CPU`` (CPU seconds,
  SIGXCPU/SIGKILL), ``RLIMIT_FSIZE`` (largest file written), ``RLIMIT_CORE`` = 0. The wall-clock timeout
  is enforced by the parent: the child runs in its own session and the whole process group is SIGKILLed
  on timeout (and after a normal exit, to end anything it left running in the background). A process
  that leaves the group (``setsid``) survives that kill, but cannot hang the call (pipes are drained for
  at most a second after the kill) and keeps the inherited limits and the empty network namespace.
- **Output.** stdout and stderr are read as they come; only the first ``max_output_bytes`` of each are
  kept (the rest is drained and counted), so a print loop cannot exhaust the service's memory.

The limits are set inside the child by the bootstrap rather than in ``preexec_fn``, because ``preexec_fn``
is not safe in a process with threads (Ray workers have several): the forked child can deadlock before exec.

Not covered: the filesystem is the host's (readable as the service's user; writes are limited in size, not
in place), and the number of processes is not limited (``RLIMIT_NPROC`` does not apply to root); a
container or a dedicated user is the place for that. See docs/environments.md.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
from typing import Literal

import msgspec

NetworkPolicy = Literal["isolated", "best_effort", "allowed"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
# The bootstrap writes one header line to stdout before the untrusted code runs, so the first line of
# stdout is always its own: how isolation went. The code cannot forge it (it runs after), and the parent
# strips it. "tito-sandbox:" + one of: isolated | allowed | not-isolated <errno text> | refused <errno text>
_HEADER = b"tito-sandbox:"
_HEADER_ROOM = 256
# after the process group is killed, how long to wait for the pipes to close and the exit status to arrive
_DRAIN_S = 1.0

# Runs in the child, before the untrusted code: read the code, isolate, limit, then execute the code as
# __main__ with fresh globals. argv: [-c, policy, memory_bytes, cpu_s, fsize_bytes].
_BOOTSTRAP = f"""
import os, sys
code = sys.stdin.read()
policy, memory, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
status = "allowed"
if policy != "allowed":
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare({_CLONE_NEWNET}) == 0 or libc.unshare({_CLONE_NEWNET} | {_CLONE_NEWUSER}) == 0:
        status = "isolated"
    else:
        error = os.strerror(ctypes.get_errno())
        if policy == "isolated":
            os.write(1, ("{_HEADER.decode()}refused " + error + "\\n").encode())
            os._exit(0)
        status = "not-isolated " + error
    del ctypes, libc
os.write(1, ("{_HEADER.decode()}" + status + "\\n").encode())
import resource
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
sys.stdin = open(os.devnull)
del sys.argv[1:]
sys.argv[0] = "<tool>"
try:
    exec(compile(code, "<tool>", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
except SystemExit:
    raise
except BaseException:
    import traceback
    kind, value, tb = sys.exc_info()
    traceback.print_exception(kind, value, tb.tb_next)  # without the bootstrap's own frame
    sys.exit(1)
"""


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
) -> SandboxResult:
    """Run ``code`` in a sandboxed subprocess (see the module docstring) and return what it printed.

    ``cpu_s`` defaults to the timeout rounded up, plus one second: a single-threaded busy loop burns CPU
    time as fast as wall time, and at an equal limit SIGXCPU raced the wall-clock timeout, so a timed-out
    run was sometimes reported as a CPU kill. The CPU limit stays the backstop for code that burns CPU on
    several threads faster than the clock runs. Never raises for anything the code does (a crash, a
    timeout, a limit hit: all are in the result); raises :class:`SandboxUnavailable` when ``network`` is
    ``"isolated"`` and no network namespace can be created, and :class:`OSError` when the interpreter
    cannot be started.
    """
    cpu = cpu_s if cpu_s is not None else max(1, int(-(-timeout_s // 1))) + 1
    start = time.monotonic()
    # ignore_cleanup_errors: a process that escaped the kill may still be writing in the directory
    with tempfile.TemporaryDirectory(prefix="tito-sandbox-", ignore_cleanup_errors=True) as workdir:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
        args = [str(memory_mb * 2**20), str(cpu), str(max_file_mb * 2**20)]
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
            # also on cancellation: never leave a child (or its children) running
            _kill_group(process.pid)
            # Bounded waits: a process that left the group (setsid) and still holds the pipes must not hang
            # the rollout. What was read so far is kept; the runaway is still bound by the rlimits it inherited.
            try:
                await asyncio.wait_for(readers, _DRAIN_S)
            except TimeoutError:
                pass
            if process.returncode is None:
                try:
                    await asyncio.wait_for(process.wait(), _DRAIN_S)
                except TimeoutError:
                    pass
            transport = getattr(process, "_transport", None)  # close our pipe ends now, not at GC time
            if transport is not None:
                transport.close()
        out, out_dropped = bytes(out_capture.kept), out_capture.dropped
        err, err_dropped = bytes(err_capture.kept), err_capture.dropped
    header, _, out = out.partition(b"\n") if out.startswith(_HEADER) else (b"", b"", out)
    status = header[len(_HEADER) :].decode("utf-8", errors="replace")
    if status.startswith("refused"):
        raise SandboxUnavailable(
            f"sandbox: cannot create a network namespace (unshare: {status.removeprefix('refused ')}). Run as "
            "root / with CAP_SYS_ADMIN or enable unprivileged user namespaces, or set network='best_effort' or "
            "'allowed' to run without network isolation. The code was not run."
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
        network_isolated=status == "isolated",
    )
