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
- **System calls.** A seccomp filter (classic BPF, installed through ctypes) answers EPERM to what Docker's
  default profile refuses a container without capabilities: keyrings, ``unshare``/``setns``/``mount``, namespace
  flags of ``clone``, ``ptrace``, ``bpf``, ``perf_event_open``, io_uring, ``userfaultfd``, AF_VSOCK/AF_ALG
  sockets, other architectures' and x32 calls, and more (the list: ``sandbox_init._DENIED_SYSCALLS``). Each
  run gets a fresh, empty session keyring, and ``/proc/keys`` reads empty: no key of the service or of another
  run is reachable.
- **Limits** (``resource.setrlimit``, before the code): ``RLIMIT_AS`` (allocations beyond it raise
  ``MemoryError``), ``RLIMIT_CPU`` (SIGXCPU/SIGKILL), ``RLIMIT_FSIZE`` (largest file), ``RLIMIT_CORE`` = 0,
  and ``RLIMIT_NPROC`` (``max_processes``, threads included; the kernel counts it per user namespace and uid,
  so it counts exactly this run's processes, and it binds because the uid is not host root).
- **Memory in total.** Where this service can make a cgroup (a child of its own: root, or a delegated v2
  subtree), every process of the run is in one with ``memory_mb`` as its limit (``memory.limit_in_bytes`` on
  v1, ``memory.max`` on v2; tmpfs files count too) and ``pids.max``; the kernel's OOM killer ends a process
  when the sum would pass it. Elsewhere only the per-process ``RLIMIT_AS`` applies. ``memory_bound`` in the
  result says which; the cgroup is removed after the run, and anything still in it killed.
- **Nothing outlives the call.** The code runs as the child of the sandbox's pid 1; when it ends, pid 1 ends,
  and the kernel kills everything else in the pid namespace (``setsid`` and double-forked children
  included) before the call returns. On timeout or cancellation, pid 1 is SIGKILLed (same effect) and the
  whole process group too.
- **Output.** stdout and stderr are read as they come; only the first ``max_output_bytes`` of each are kept
  (the rest is drained and counted), so a print loop cannot exhaust the service's memory. A process killed by
  a signal (a timeout's SIGKILL, SIGXCPU, the OOM killer) is reported as such (``signal``, ``exit_code`` = -n as
  :mod:`subprocess` does), with nothing of the bootstrap's own on stderr.

The bootstrap reports how isolation went on a header line, before the code runs (so the code cannot forge
it). Without isolation (``SandboxUnavailable`` unless ``network`` is ``"best_effort"`` or ``"allowed"``), the
code runs as the service's user on the host file system, as before: only the rlimits, the process group kill
and the minimal environment apply. The limits are set inside the child rather than in ``preexec_fn``,
because ``preexec_fn`` is not safe in a process with threads (Ray workers have several).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Literal

import msgspec

from . import sandbox_init
from .sandbox_init import HEADER

NetworkPolicy = Literal["isolated", "best_effort", "allowed"]
MemoryBound = Literal["cgroup", "rlimit"]

logger = logging.getLogger(__name__)

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
    """The outcome of one run. ``exit_code`` is the process's status as :mod:`subprocess` reports it (negative:
    killed by that signal, which ``signal`` also holds), None only when it could not be collected.
    ``*_truncated`` count the bytes dropped from each stream. ``memory_bound`` says how ``memory_mb`` applied:
    ``"cgroup"``, to all the run's processes together (and to each one's address space), or ``"rlimit"``, to
    each process's address space only (no cgroup could be made here). ``oom_kills`` counts the processes the
    cgroup's out-of-memory killer ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    stdout_truncated: int = 0
    stderr_truncated: int = 0
    network_isolated: bool = True
    signal: int | None = None
    memory_bound: MemoryBound = "rlimit"
    oom_kills: int = 0

    @property
    def signal_name(self) -> str | None:
        """``"SIGKILL"`` and so on; ``"signal N"`` for a number without a name; None when not killed."""
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def describe(self, timeout_s: float) -> str:
        """The result as text for a tool message: status line, then stdout and stderr when not empty."""
        if self.timed_out:  # the sandbox killed it (whatever signal the process saw last)
            status = f"killed by SIGKILL (timeout after {timeout_s:g} s)"
        elif self.signal is not None:
            status = f"killed by {self.signal_name}"
            if self.signal == signal.SIGXCPU:
                status += " (CPU time limit)"
            elif self.signal == signal.SIGKILL and self.oom_kills:
                status += " (out of memory: the memory limit is for all its processes together)"
        else:
            status = f"exit code {self.exit_code}"
        if self.oom_kills and not (self.signal == signal.SIGKILL and not self.timed_out):
            plural = "es" if self.oom_kills > 1 else ""
            status += f" ({self.oom_kills} process{plural} killed: out of memory)"
        parts = [status]
        for label, text, dropped in (
            ("stdout", self.stdout, self.stdout_truncated),
            ("stderr", self.stderr, self.stderr_truncated),
        ):
            if text or dropped:
                note = f"\n[... {dropped} more bytes truncated]" if dropped else ""
                parts.append(f"{label}:\n{text}{note}")
        return "\n".join(parts)


# -- the run's cgroup: memory (and pids) bounded for all its processes together ----------------------------


def _mountinfo() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, file system type, super options) of each mount of this process."""
    mounts = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            before, _, after = line.decode(errors="replace").partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) >= 5 and len(tail) >= 3:
                root, point = (sandbox_init._unescape(x.encode()) for x in fields[3:5])
                mounts.append((root, point, tail[0], set(tail[2].split(","))))
    return mounts


@functools.cache
def _cgroup_parents() -> dict[str, tuple[str, str]] | str:
    """Where this process may make its runs' cgroups: ``{"memory": (version, directory), "pids": ...}``, each
    directory this process's own cgroup of that controller; or why none can be made. Cached: the hierarchy of a
    running service does not change. cgroup v2 where the controller is delegated to our cgroup's children
    (``cgroup.subtree_control``), otherwise the v1 hierarchy of that controller; nothing else is changed."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
        mounts = _mountinfo()
    except OSError as error:
        return f"cannot read this process's cgroups: {error}"

    def directory(fstype: str, controller: str | None, path: str) -> str | None:
        for root, point, kind, options in mounts:
            if kind == fstype and (controller is None or controller in options):
                if root == "/" or path == root or path.startswith(root.rstrip("/") + "/"):
                    inside = path if root == "/" else path[len(root) :]
                    return point.rstrip("/") + inside
        return None

    found: dict[str, tuple[str, str]] = {}
    unified = next((path for hierarchy, _, path in own if hierarchy == "0"), None)
    v2 = directory("cgroup2", None, unified) if unified is not None else None
    delegated: set[str] = set()
    if v2 is not None:
        try:
            with open(os.path.join(v2, "cgroup.subtree_control")) as f:
                delegated = set(f.read().split())
        except OSError:
            pass
    for controller in ("memory", "pids"):
        if controller in delegated:
            found[controller] = ("v2", v2)
            continue
        path = next((p for _, names, p in own if controller in names.split(",")), None)
        v1 = directory("cgroup", controller, path) if path is not None else None
        if v1 is not None and os.path.isdir(v1):
            found[controller] = ("v1", v1)
    if "memory" not in found:
        return "no memory cgroup controller: neither delegated on cgroup v2 nor mounted as cgroup v1"
    return found


class _RunCgroup:
    """The cgroups of one run: made as children of the service's own, the run's processes moved in, removed
    after. Only the directories this object made are ever written or removed."""

    def __init__(self, made: list[tuple[str, str, str]]) -> None:
        self.made = made  # (controller, version, directory)

    @classmethod
    def make(cls, memory: int, processes: int) -> _RunCgroup:
        """Raises OSError when a cgroup cannot be made or limited here (the caller falls back to rlimits)."""
        parents = _cgroup_parents()
        if isinstance(parents, str):
            raise OSError(errno.ENOTSUP, parents)
        name = f"tito-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        run = cls([])
        try:
            for controller, (version, parent) in parents.items():
                directory = os.path.join(parent, name)
                if any(d == directory for _, _, d in run.made):  # v2: one directory for both controllers
                    run.made.append((controller, version, directory))
                else:
                    os.mkdir(directory, 0o755)
                    run.made.append((controller, version, directory))
                limits = {
                    ("memory", "v1"): [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)],
                    ("memory", "v2"): [("memory.max", memory), ("memory.swap.max", 0)],
                    ("pids", "v1"): [("pids.max", processes)],
                    ("pids", "v2"): [("pids.max", processes)],
                }[(controller, version)]
                for file, value in limits:
                    path = os.path.join(directory, file)
                    if file.startswith("memory.memsw") or file == "memory.swap.max":
                        if not os.path.exists(path):  # no swap accounting: nothing to bound there
                            continue
                    with open(path, "w") as f:
                        f.write(str(value))
        except BaseException:
            run.remove_now()
            raise
        return run

    def add(self, pid: int) -> None:
        for directory in dict.fromkeys(d for _, _, d in self.made):
            with open(os.path.join(directory, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def oom_kills(self) -> int:
        for controller, version, directory in self.made:
            if controller == "memory":
                name = "memory.oom_control" if version == "v1" else "memory.events"
                try:
                    with open(os.path.join(directory, name)) as f:
                        for line in f:
                            key, _, value = line.partition(" ")
                            if key == "oom_kill":
                                return int(value)
                except (OSError, ValueError):
                    pass
        return 0

    def _pids(self, directory: str) -> list[int]:
        try:
            with open(os.path.join(directory, "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []

    def remove_now(self) -> list[str]:
        """rmdir each directory made; returns those still busy (a process of the run not yet gone)."""
        busy = []
        for directory in reversed(list(dict.fromkeys(d for _, _, d in self.made))):
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(directory)
        return busy

    async def remove(self) -> None:
        """Remove the cgroups. Normally empty by now (the whole sandbox ended before the call's process did);
        without the namespaces, a process that left the process group may remain: it is killed, it being in the
        run's cgroup."""
        deadline = time.monotonic() + 2 * _DRAIN_S
        while busy := self.remove_now():
            for directory in busy:
                for pid in self._pids(directory):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            if time.monotonic() > deadline:
                logger.warning("sandbox: could not remove the cgroups %s (still busy); left in place", busy)
                return
            await asyncio.sleep(0.01)


# why this service cannot make cgroups, once found out (a refused mkdir stays refused): not tried again
_cgroup_refused: str | None = None


def _make_cgroup(memory: int, processes: int) -> _RunCgroup | None:
    """The run's cgroup, or None where none can be made (the run then has its rlimits only; said once)."""
    global _cgroup_refused
    if _cgroup_refused is not None:
        return None
    try:
        return _RunCgroup.make(memory, processes)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTSUP, errno.ENOENT):
            _cgroup_refused = str(error)
            logger.warning("sandbox: no cgroup can be made here (%s): memory is bounded per process only", error)
        else:  # something of this run only (ENOMEM, a race): the next run tries again
            logger.warning("sandbox: cannot make this run's cgroup (%s): memory bounded per process", error)
        return None


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
    # P, and C and I of the sandbox, share the run's pids cgroup with the code's max_processes
    cgroup = _make_cgroup(memory_mb * 2**20, max_processes + 3)
    bound: MemoryBound = "cgroup" if cgroup is not None else "rlimit"
    oom_kills = 0
    try:
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
            if cgroup is not None:
                # P reads all of the code before it forks anything: moved in now, every process of the run is in.
                # In a thread: on cgroup v1 a move waits for an RCU grace period (12 ms median here), which would
                # block the event loop; P's interpreter starts up meanwhile.
                try:
                    await asyncio.to_thread(cgroup.add, process.pid)
                except OSError as error:
                    logger.warning("sandbox: cannot move the run into its cgroup (%s): rlimits only", error)
                    bound = "rlimit"
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
    finally:
        if cgroup is not None:
            oom_kills = cgroup.oom_kills()
            await cgroup.remove()
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
        signal=-process.returncode if process.returncode is not None and process.returncode < 0 else None,
        memory_bound=bound,
        oom_kills=oom_kills,
    )
