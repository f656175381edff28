"""The sandbox's bootstrap: run by :func:`rollout.envs.sandbox.run_python` as ``python -I -u -c <this file's
source> policy memory cpu fsize nproc disk workdir``, with the untrusted code on stdin. Importing this module
does nothing; only :func:`main` does. See :mod:`rollout.envs.sandbox` for what the sandbox guarantees.

Four processes, so that each step runs where the kernel allows it:

- **P** (started by ``run_python``, in the host's namespaces) reads the code, forks C, writes C's uid/gid maps
  (only a process outside a user namespace may map ids other than its own), then waits and exits the way the
  code's process did (same exit code, or killed by the same signal).
- **C** leaves the host: ``unshare(CLONE_NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS)``, then forks I.
- **I** is pid 1 of the new pid namespace. It builds the file system view (a tmpfs root holding read-only
  binds of /usr and the Python installation, a fresh /proc, a minimal /dev and /etc, a private tmpfs /tmp
  holding the work directory; ``/proc/keys`` masked), ``pivot_root``s into it, joins a fresh session keyring,
  drops every capability, sets no_new_privs, switches to the unprivileged uid, installs the seccomp filter,
  writes the header line, forks W and waits for it. When W ends, I ends, and the kernel kills whatever else is
  left in the namespace (``setsid`` and double-forked children included).
- **W** sets the resource limits and runs the code.

C and I report failures (and I reports W's wait status) to P on a pipe the code never holds: the header
line on stdout, which the code cannot forge because it runs after it, says how isolation went.
"""

from __future__ import annotations

import os
import sys

HEADER = "tito-sandbox:"
SANDBOX_UID = 1000  # the code's uid (and gid) inside the sandbox
# the host uid/gid the code's id maps to when the service runs as root: not root, so that RLIMIT_NPROC applies
# (the kernel exempts uid 0) and host files are reached, if at all, with "other" permissions only
HOST_NOBODY = 65534

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_NAMESPACES = _CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND = 0x20, 0x400, 0x800, 0x1000
_MS_REC, _MS_PRIVATE, _MS_RELATIME = 0x4000, 0x40000, 0x200000
_MNT_DETACH = 2
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 4, 24, 38, 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SYSCALLS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}
_DEVICES = ("null", "zero", "full", "random", "urandom")
# /proc files the code must not read (as container runtimes mask them): the kernel keyrings it can view
_MASKED_PROC = ("keys", "key-users")

# -- the seccomp filter ---------------------------------------------------------------------------------------
# A deny list modelled on Docker's default profile: the system calls that profile refuses to a container without
# capabilities (its allow list's complement, for the calls these kernels have), answered with EPERM as Docker
# does. Numbers from the kernel's tables (x86_64: asm/unistd_64.h; aarch64: asm-generic/unistd.h; the calls
# numbered 424 and up are the same on every architecture). Keyrings (shared per host uid: a key one run adds is
# readable by the next), namespaces and mounts, tracing, BPF, perf, io_uring, userfaultfd, modules, kexec, time,
# swap, quotas, NUMA policy, handles, and the rest that needs a capability the code does not have anyway.
_DENIED_SYSCALLS = {
    "x86_64": {
        "add_key": 248, "keyctl": 250, "request_key": 249, "unshare": 272, "setns": 308, "mount": 165,
        "umount2": 166, "pivot_root": 155, "chroot": 161, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "move_mount": 429, "open_tree": 428, "open_tree_attr": 467, "mount_setattr": 442,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "pidfd_getfd": 438,
        "process_madvise": 440, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "create_module": 174, "kexec_load": 246, "kexec_file_load": 320, "reboot": 169,
        "swapon": 167, "swapoff": 168, "acct": 163, "syslog": 103, "quotactl": 179, "quotactl_fd": 443,
        "lookup_dcookie": 212, "nfsservctl": 180, "get_kernel_syms": 177, "query_module": 178, "uselib": 134,
        "ustat": 136, "sysfs": 139, "_sysctl": 156, "vhangup": 153, "iopl": 172, "ioperm": 173,
        "settimeofday": 164, "clock_settime": 227, "sethostname": 170, "setdomainname": 171,
        "fanotify_init": 300, "open_by_handle_at": 304, "get_mempolicy": 239, "set_mempolicy": 238,
        "mbind": 237, "set_mempolicy_home_node": 450, "move_pages": 279, "migrate_pages": 256,
        "lsm_get_self_attr": 459, "lsm_set_self_attr": 460, "lsm_list_modules": 461,
    },
    "aarch64": {
        "add_key": 217, "keyctl": 219, "request_key": 218, "unshare": 97, "setns": 268, "mount": 40,
        "umount2": 39, "pivot_root": 41, "chroot": 51, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "move_mount": 429, "open_tree": 428, "open_tree_attr": 467, "mount_setattr": 442,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272, "pidfd_getfd": 438,
        "process_madvise": 440, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "kexec_load": 104, "kexec_file_load": 294, "reboot": 142, "swapon": 224,
        "swapoff": 225, "acct": 89, "syslog": 116, "quotactl": 60, "quotactl_fd": 443, "lookup_dcookie": 18,
        "nfsservctl": 42, "vhangup": 58, "settimeofday": 170, "clock_settime": 112, "sethostname": 161,
        "setdomainname": 162, "fanotify_init": 262, "open_by_handle_at": 265, "get_mempolicy": 236,
        "set_mempolicy": 237, "mbind": 235, "set_mempolicy_home_node": 450, "move_pages": 239,
        "migrate_pages": 238, "lsm_get_self_attr": 459, "lsm_set_self_attr": 460, "lsm_list_modules": 461,
    },
}  # fmt: skip
# calls allowed with some arguments only: clone (no new namespaces), socket (no AF_VSOCK: vsock is not
# network-namespaced, so it would reach the VM's host; no AF_ALG: kernel crypto), personality (Docker's values);
# clone3 gets ENOSYS, as in Docker (its flags sit behind a pointer), and glibc falls back to clone
_FILTERED_SYSCALLS = {
    "x86_64": {"clone": 56, "clone3": 435, "socket": 41, "personality": 135},
    "aarch64": {"clone": 220, "clone3": 435, "socket": 198, "personality": 92},
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000  # x86_64 only: the x32 ABI's calls, refused as a whole
_CLONE_NEW_ANY = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_AF_ALG, _AF_VSOCK = 38, 40
_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # PER_LINUX, ...32BIT, UNAME26 and the query
_EPERM, _ENOSYS = 1, 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_KEYCTL_JOIN_SESSION_KEYRING = 1


class _Failed(Exception):
    """A setup step failed; the message names the step and the error."""


def _libc():  # ctypes is imported lazily: importing this module stays free
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(step: str, result: int) -> None:
    if result != 0:
        import ctypes

        raise _Failed(f"{step}: {os.strerror(ctypes.get_errno())}")


def _describe(error: BaseException) -> str:
    """One line for the report pipe: a named step as it is, anything else with its type (never a newline)."""
    text = str(error) if isinstance(error, _Failed) else f"setup: {error!r}"
    return text.replace("\n", " ")


def _say(fd: int, message: str) -> None:
    os.write(fd, (message + "\n").encode())


def _limit_and_run(code: str, memory: int, cpu: int, fsize: int, nproc: int | None) -> None:
    """In the process that runs the code: set the limits, then execute the code as ``__main__``."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    if nproc is not None:  # already counting the sandbox's own processes that share the code's uid
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    sys.stdin = open(os.devnull)
    del sys.argv[1:]
    sys.argv[0] = "<tool>"
    try:
        exec(compile(code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException:
        import traceback

        kind, value, tb = sys.exc_info()
        assert tb is not None
        traceback.print_exception(kind, value, tb.tb_next)  # without the bootstrap's own frame
        sys.exit(1)


def _seccomp_program(machine: str) -> bytes:
    """The classic-BPF program of the filter (``struct sock_filter`` array) for this architecture. Any other
    architecture's calls (i386 through ``int 0x80``, 32-bit ARM) and x32 calls get EPERM: their numbers mean
    other calls, which this list does not name."""
    import struct

    if machine not in _AUDIT_ARCH:
        raise _Failed(f"seccomp: unsupported architecture {machine} (the filter knows x86_64 and aarch64)")
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    nr, arch, arg0 = 0, 4, 16  # offsets in struct seccomp_data (the low word of args[0], little-endian)
    allow, errno = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno
    calls = _FILTERED_SYSCALLS[machine]
    # (code, jump if true, jump if false, k): a jump is 0 (next) or the name of a label below
    program: list[tuple[int, int | str, int | str, int]] = [(ld, 0, 0, arch), (jeq, 0, "deny", _AUDIT_ARCH[machine])]
    program.append((ld, 0, 0, nr))
    if machine == "x86_64":
        program.append((jge, "deny", 0, _X32_SYSCALL_BIT))
    program += [(jeq, "deny", 0, number) for number in sorted(_DENIED_SYSCALLS[machine].values())]
    program += [(jeq, "nosys", 0, calls["clone3"]), (jeq, "clone", 0, calls["clone"])]
    program += [(jeq, "socket", 0, calls["socket"]), (jeq, "personality", 0, calls["personality"])]
    program.append((ret, 0, 0, allow))
    labels = {"clone": len(program)}  # (classic BPF jumps only forward: the returns come last)
    program += [(ld, 0, 0, arg0), (jset, "deny", "allow", _CLONE_NEW_ANY)]
    labels["socket"] = len(program)
    program += [(ld, 0, 0, arg0), (jeq, "deny", 0, _AF_VSOCK), (jeq, "deny", "allow", _AF_ALG)]
    labels["personality"] = len(program)
    program.append((ld, 0, 0, arg0))
    program += [(jeq, "allow", 0, value) for value in _PERSONALITIES[:-1]]
    program.append((jeq, "allow", "deny", _PERSONALITIES[-1]))
    labels["allow"] = len(program)
    program.append((ret, 0, 0, allow))
    labels["nosys"] = len(program)
    program.append((ret, 0, 0, errno | _ENOSYS))
    labels["deny"] = len(program)
    program.append((ret, 0, 0, errno | _EPERM))
    code = bytearray()
    for i, (op, true, false, k) in enumerate(program):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (true, false))
        assert 0 <= jt < 256 and 0 <= jf < 256, "a jump of the seccomp filter is out of range"
        code += struct.pack("=HBBI", op, jt, jf, k)
    return bytes(code)


def _install_seccomp(ctypes, libc) -> None:
    """Install the filter on this process (after no_new_privs, which an unprivileged process needs for it);
    every process it forks inherits it, and no process can remove it."""
    program = _seccomp_program(os.uname().machine)

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check("install the seccomp filter", libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0))


def _join_fresh_session_keyring(ctypes, libc) -> None:
    """A new, empty session keyring for this process and the code: nothing of the service's is inherited. Done
    while still the namespace's root, so the keyring counts against host root's key quota, not the code's uid's
    (shared by every run). A kernel without keyrings (ENOSYS) has nothing to inherit."""
    number = _DENIED_SYSCALLS.get(os.uname().machine, {}).get("keyctl")
    if number is None:
        raise _Failed(f"join a session keyring: unsupported architecture {os.uname().machine}")
    if libc.syscall(number, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0 and ctypes.get_errno() != 38:  # ENOSYS
        raise _Failed(f"join a fresh session keyring: {os.strerror(ctypes.get_errno())}")


def _mount(libc, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    result = libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data))
    _check(f"mount {fstype or source or 'flags'} on {target}", result)


def _unescape(field: bytes) -> str:
    for escaped, char in ((b"\\040", b" "), (b"\\011", b"\t"), (b"\\012", b"\n"), (b"\\134", b"\\")):
        field = field.replace(escaped, char)  # the only characters the kernel escapes there ("\\" last)
    return os.fsdecode(field)


def _bind_read_only(libc, source: str, target: str) -> None:
    """Bind ``source`` (and the mounts below it) at ``target``, every one of them read-only. Flags the host
    set on a mount (noexec, atime) are kept: a user namespace may not clear them, only add to them."""
    os.makedirs(target, exist_ok=True)
    _mount(libc, source, target, None, _MS_BIND | _MS_REC)
    with open("/proc/self/mountinfo", "rb") as f:  # mount points with space, tab, newline, \\ octal-escaped
        points = [_unescape(line.split()[4]) for line in f]
    for point in points:
        if point == target or point.startswith(target.rstrip("/") + "/"):
            flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
            have = os.statvfs(point).f_flag
            for st, ms in ((os.ST_NOEXEC, _MS_NOEXEC), (os.ST_NOATIME, _MS_NOATIME),
                           (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME)):  # fmt: skip
                if have & st:
                    flags |= ms
            _mount(libc, None, point, None, flags)


def _python_dirs() -> list[str]:
    """The Python installation the code needs, outside /usr: the interpreter's prefixes and the venv's."""
    dirs = {os.path.abspath(p) for p in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix)}
    dirs.add(os.path.dirname(os.path.abspath(sys.executable)))
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    kept = []
    for d in sorted(dirs):  # parents sort before their children: a covered directory is not bound twice
        if d != "/" and not d.startswith("/usr/") and not any(d.startswith(k + "/") or d == k for k in kept):
            kept.append(d)
    return kept


class _Step:
    """Names a setup step: an OSError inside becomes a :class:`_Failed` naming the step, the error and the path."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, error, tb) -> None:
        if isinstance(error, OSError):
            path = f" ({error.filename})" if error.filename else ""
            raise _Failed(f"{self.name}: {error.strerror or error}{path}") from None


def _build_root(libc, new_root: str, workdir: str, disk: int) -> None:
    """The file system the code sees, built at ``new_root`` (then pivoted into)."""
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing done below propagates to the host
    _mount(libc, "tmpfs", new_root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=755")
    with _Step("bind /usr and the merged-/usr links"):
        for name in sorted(os.listdir("/")):  # /bin, /lib, ... : the merged-/usr symlinks, or the directories
            if name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr"):
                path = "/" + name
                if os.path.islink(path):
                    os.symlink(os.readlink(path), new_root + path)
                elif os.path.isdir(path):
                    _bind_read_only(libc, path, new_root + path)
    with _Step("make /proc"):
        os.mkdir(new_root + "/proc")
    _mount(libc, "proc", new_root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)  # this pid ns only
    for name in _MASKED_PROC:  # /dev/null over them: they read empty
        if os.path.exists(f"{new_root}/proc/{name}"):
            _mount(libc, "/dev/null", f"{new_root}/proc/{name}", None, _MS_BIND)
    dev = new_root + "/dev"
    with _Step("make /dev"):
        os.mkdir(dev)
    _mount(libc, "tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,mode=755")
    with _Step("make /dev"):
        for name in _DEVICES:
            open(f"{dev}/{name}", "w").close()
            _mount(libc, f"/dev/{name}", f"{dev}/{name}", None, _MS_BIND)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                             ("stderr", "/proc/self/fd/2")):  # fmt: skip
            os.symlink(target, f"{dev}/{name}")
        os.mkdir(dev + "/shm")
    _mount(libc, "tmpfs", dev + "/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk},mode=1777")
    with _Step("make /tmp"):
        os.mkdir(new_root + "/tmp")
    _mount(libc, "tmpfs", new_root + "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk},mode=1777")
    with _Step(f"make the work directory {workdir}"):
        if not (workdir + "/").startswith("/tmp/"):  # an unusual TMPDIR: the work directory gets its own tmpfs
            os.makedirs(new_root + workdir)
            _mount(libc, "tmpfs", new_root + workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={disk},mode=700")
        os.makedirs(new_root + workdir, mode=0o700, exist_ok=True)
        os.chown(new_root + workdir, SANDBOX_UID, SANDBOX_UID)
    # After /tmp and the work directory: a venv under /tmp (a clone there) is bound inside the private /tmp
    # rather than under a directory that the /tmp mount would then hide (or that its mkdir would collide with).
    for d in _python_dirs():
        with _Step(f"bind the Python installation {d}"):
            _bind_read_only(libc, d, new_root + d)
    # a private /etc: the sandbox's own user (so getpass / pwd work), never the host's accounts
    with _Step("make /etc"):
        os.makedirs(new_root + "/etc", exist_ok=True)  # (exists if the Python installation lives under /etc)
        for name, text in (
            ("passwd", f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:tito sandbox:{workdir}:/usr/sbin/nologin\n"),
            ("group", f"sandbox:x:{SANDBOX_UID}:\n"),
            ("hosts", "127.0.0.1 localhost\n::1 localhost\n"),
        ):
            with open(f"{new_root}/etc/{name}", "w") as f:
                f.write(text)


def _enter(ctypes, libc, new_root: str) -> None:
    """pivot_root into the new root, detach the host's, and make the root and /dev read-only."""
    numbers = _SYSCALLS.get(os.uname().machine)  # (os.uname rather than platform: importing that costs ms)
    if numbers is None:
        raise _Failed(f"pivot_root: unsupported architecture {os.uname().machine}")
    os.chdir(new_root)
    _check("pivot_root", libc.syscall(numbers["pivot_root"], b".", b"."))  # the old root ends up on top ...
    _check("detach the host root", libc.umount2(b".", _MNT_DETACH))  # ... and is detached from there
    os.chdir("/")
    _mount(libc, None, "/", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    _mount(libc, None, "/dev", None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NOEXEC)
    _check("sethostname", libc.sethostname(b"sandbox", 7))


def _drop_privileges(ctypes, libc, root_service: bool) -> None:
    """No capabilities (bounding, ambient, effective, permitted, inheritable), no way to gain any (no_new_privs:
    setuid binaries and file capabilities do nothing), and the unprivileged uid/gid."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(f"drop capability {cap}", libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0))
    _check("clear ambient capabilities", libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0))
    if root_service:  # uid 0 in the namespace (host root) did the setup; the code runs as SANDBOX_UID
        os.setresgid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
        os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)  # leaving uid 0 also clears the capability sets
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all empty
    _check("capset", libc.syscall(_SYSCALLS[os.uname().machine]["capset"], header, data))
    _check("no_new_privs", libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))


def _init(
    report: int, code: str, limits: tuple[int, int, int, int], workdir: str, disk: int, root_service: bool
) -> None:
    """I: pid 1 of the sandbox. Never returns."""
    try:
        ctypes, libc = _libc()
        host_pid = os.readlink("/proc/self")  # the host's /proc is still mounted: this is our pid out there
        new_root = workdir  # any empty directory will do as the mount point of the new root
        _build_root(libc, new_root, workdir, disk)
        _enter(ctypes, libc, new_root)
        _join_fresh_session_keyring(ctypes, libc)
        _drop_privileges(ctypes, libc, root_service)
        os.chdir(workdir)
        # last: the filter refuses what the setup above used (mount, keyctl); I and the code both run under it
        _install_seccomp(ctypes, libc)
    except BaseException as error:  # every failure is reported; none runs the code
        _say(report, f"error {_describe(error)}")
        os._exit(1)
    import signal

    # Before the fork, so that no signal or ptrace from the code can come first: from inside its namespace,
    # pid 1 gets only the signals it handles, so with none (Python's SIGINT handler removed) the code can
    # neither kill nor interrupt it; and not dumpable, so the code (same uid) cannot ptrace it and forge its
    # report. The code's process gets both back.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    # the host pid lets run_python end the sandbox by killing pid 1, and know when all of it is gone
    os.write(1, f"{HEADER}isolated {host_pid}\n".encode())
    worker = os.fork()
    if worker == 0:
        os.close(report)
        libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc/self stays its own
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # RLIMIT_NPROC is counted per (user namespace, uid): exactly this run's processes and threads with the
        # code's uid, which are the code's plus I -- and C too when the service is not root (C has that uid)
        memory, cpu, fsize, nproc = limits
        _limit_and_run(code, memory, cpu, fsize, nproc + (1 if root_service else 2))
        sys.exit(0)
    while True:  # pid 1 reaps every orphan; it ends, and with it the namespace, when the code's process does
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            status = 0x7F00  # cannot happen (the worker is our child); reported as "exit code 127"
            break
        if pid == worker:
            break
    _say(report, f"status {status}")
    os._exit(0)


def _leave_host(report: int, go: int, code: str, limits: tuple[int, int, int, int], workdir: str, disk: int) -> None:
    """C: into new namespaces, wait for P to map the ids, then start I. Never returns."""
    try:
        ctypes, libc = _libc()
        root_service = os.geteuid() == 0
        if root_service:
            os.setgroups([])  # host root's supplementary groups must not follow the code in
        _check("unshare(CLONE_NEWUSER|NEWNS|NEWPID|NEWNET|NEWIPC|NEWUTS)", libc.unshare(_NAMESPACES))
        _say(report, "unshared")
        if os.read(go, 16) != b"mapped":
            raise _Failed("uid/gid maps were not written")
        os.close(go)
        init = os.fork()  # the first child in the new pid namespace is its pid 1
    except BaseException as error:
        _say(report, f"error {_describe(error)}")
        os._exit(1)
    if init == 0:
        _init(report, code, limits, workdir, disk, root_service)
    os.close(report)
    try:
        os.waitpid(init, 0)
    finally:
        os._exit(0)


def _isolate(code: str, limits: tuple[int, int, int, int], workdir: str, disk: int) -> str:
    """P: start C, map its ids, and wait. Returns an error text when isolation failed before the code ran;
    otherwise exits the way the code's process did."""
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(report_r)
        os.close(go_w)
        _leave_host(report_w, go_r, code, limits, workdir, disk)
    os.close(report_w)
    os.close(go_r)
    messages, buffer = [], b""
    while chunk := os.read(report_r, 4096):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            message = line.decode(errors="replace")
            messages.append(message)
            if message == "unshared":
                try:
                    _map_ids(child)
                    os.write(go_w, b"mapped")
                except OSError as error:
                    messages.append(f"error write uid/gid maps: {error.strerror}")
                    os.write(go_w, b"failed")
    os.waitpid(child, 0)
    os.close(report_r)  # (the code may yet run in this process: best_effort)
    os.close(go_w)
    errors = [m.removeprefix("error ") for m in messages if m.startswith("error ")]
    if errors:
        return errors[0]
    statuses = [int(m.split()[1]) for m in messages if m.startswith("status ")]
    if not statuses:  # I was killed before W ended: only a kill from outside does that
        _exit_like(0x09)
    _exit_like(statuses[0])
    return ""  # not reached


def _map_ids(child: int) -> None:
    """Write C's uid/gid maps from outside its user namespace. As root: the namespace's root is host root
    (for the setup only) and the code's id is host nobody; otherwise the code's id is the service's own."""
    with open(f"/proc/{child}/setgroups", "w") as f:
        f.write("deny")  # required for an unprivileged gid_map; and no one inside changes groups afterwards
    if os.geteuid() == 0:
        uids = f"0 0 1\n{SANDBOX_UID} {HOST_NOBODY} 1\n"
        gids = f"0 0 1\n{SANDBOX_UID} {HOST_NOBODY} 1\n"
    else:
        uids, gids = f"{SANDBOX_UID} {os.geteuid()} 1\n", f"{SANDBOX_UID} {os.getegid()} 1\n"
    for name, text in (("uid_map", uids), ("gid_map", gids)):
        with open(f"/proc/{child}/{name}", "w") as f:
            f.write(text)


def _exit_like(status: int) -> None:
    """End P the way the code's process ended: its exit code, or killed by the same signal. Never raises: a
    traceback here would reach the model's stderr as if the code had printed it."""
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    signum = os.WTERMSIG(status)
    try:
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # re-raising SIGXCPU/SIGSEGV must not dump a core
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # (their disposition cannot be changed, nor blocked)
            signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
    except BaseException:
        pass
    os._exit(128 + signum)  # a signal whose default is not to terminate: the shell's convention


def main() -> None:
    code = sys.stdin.read()
    policy = sys.argv[1]
    memory, cpu, fsize, nproc, disk = (int(a) for a in sys.argv[2:7])
    workdir = sys.argv[7]
    if policy != "allowed":
        error = _isolate(code, (memory, cpu, fsize, nproc), workdir, disk)
        if policy == "isolated":
            os.write(1, f"{HEADER}refused {error}\n".encode())
            os._exit(0)
        os.write(1, f"{HEADER}not-isolated {error}\n".encode())
    else:
        os.write(1, f"{HEADER}allowed\n".encode())
    _limit_and_run(code, memory, cpu, fsize, None)  # RLIMIT_NPROC would not bind host root: not set here
    sys.exit(0)


if __name__ == "__main__":
    main()
