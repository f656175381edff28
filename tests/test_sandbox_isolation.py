"""The Python sandbox's cgroup (issue 23): memory bounded for all of a run's processes together, the result saying
which bound applied, and the cgroup gone after the run, with whatever was left in it. Real cgroups of this machine
(made as children of this process's own, as run_python does): the tests skip where none can be made. Slower than
tests/test_sandbox.py (they allocate hundreds of MB and wait for the kernel's OOM killer): run by `make test-e2e`."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from rollout.envs import run_python, sandbox

from .test_sandbox import NAME_ITSELF, host_processes_named


def run(code: str, **options) -> sandbox.SandboxResult:
    return asyncio.run(run_python(code, **options))


def run_cgroups() -> list[str]:
    """The cgroups run_python made (and not yet removed) under this process's own ones."""
    parents = sandbox._cgroup_parents()
    if isinstance(parents, str):
        return []
    return sorted(
        os.path.join(parent, name)
        for _, parent in set(parents.values())
        for name in os.listdir(parent)
        if name.startswith(f"tito-sandbox-{os.getpid()}-")
    )


def dead(pid: int) -> bool:
    """Killed, and only waiting to be reaped by whichever process adopted it (not us): a zombie, or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.fixture(scope="module")
def cgroups() -> None:
    probe = run("pass")
    if probe.memory_bound != "cgroup":
        pytest.skip(f"no cgroup can be made here: {sandbox._cgroup_refused or sandbox._cgroup_parents()}")


# four children writing 400 MB each, at the same time (each sleeps once it holds its block)
FOUR_CHILDREN = """
import os, time
children = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        try:
            block = b"x" * (400 * 2**20)  # written, so resident: not just address space
        except MemoryError:
            os._exit(3)
        time.sleep(2)
        os._exit(0)
    children.append(pid)
print(sorted(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children))
"""


@pytest.mark.usefixtures("cgroups")
@pytest.mark.parametrize("network", ["isolated", "allowed"])
def test_memory_is_bounded_for_all_processes_together(network: str) -> None:
    # Issue 23: RLIMIT_AS is per process, so four children each took 400 MB under memory_mb=512 (1.6 GB in all).
    # In the run's cgroup, at most one of them can hold its block; the others are killed by the OOM killer.
    result = run(FOUR_CHILDREN, memory_mb=512, timeout_s=60.0, network=network)
    assert result.exit_code == 0 and result.memory_bound == "cgroup", result.stderr
    statuses = eval(result.stdout)  # a sorted list of ints we printed
    assert statuses.count(0) <= 1 and all(s in (0, 3, -signal.SIGKILL) for s in statuses), statuses
    assert result.oom_kills == statuses.count(-signal.SIGKILL) >= 2
    assert result.describe(60.0).startswith(f"exit code 0 ({result.oom_kills} processes killed: out of memory)")
    assert run_cgroups() == []  # removed after the run


@pytest.mark.usefixtures("cgroups")
def test_the_code_itself_killed_for_memory_says_so() -> None:
    code = "import os\nos.fork()\nblock = b'x' * (300 * 2**20)\nimport time\ntime.sleep(2)"  # 2 x 300 MB
    result = run(code, memory_mb=400, timeout_s=60.0)
    assert result.oom_kills >= 1 and result.memory_bound == "cgroup"
    if result.signal == signal.SIGKILL:  # the OOM killer chose the code's own process, not its child
        assert result.describe(60.0).startswith("killed by SIGKILL (out of memory")
    else:
        assert result.describe(60.0).startswith("exit code 0 (1 process killed: out of memory)")
    assert run_cgroups() == []


@pytest.mark.usefixtures("cgroups")
def test_a_process_left_behind_without_the_sandbox_is_killed_with_the_cgroup() -> None:
    # Without the namespaces (network="allowed"), a child that leaves the process group and closes the pipes
    # used to outlive the call; it is in the run's cgroup, which is emptied and removed after the run.
    name = f"tito-{uuid.uuid4().hex[:10]}"
    code = NAME_ITSELF.format(name=name) + (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.close(1); os.close(2)\n"
        "    time.sleep(30)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
    )
    result = run(code, network="allowed", timeout_s=10.0)
    survivors = [pid for pid in host_processes_named(name) if not dead(pid)]
    for pid in survivors:  # (on an implementation that lets it live, end it)
        os.kill(pid, signal.SIGKILL)
    assert result.exit_code == 0 and result.memory_bound == "cgroup"
    assert survivors == [] and run_cgroups() == []


@pytest.mark.usefixtures("cgroups")
def test_a_timed_out_run_leaves_no_cgroup() -> None:
    start = time.monotonic()
    result = run("import os\nfor _ in range(3):\n    os.fork()\nwhile True: pass", timeout_s=2.0)
    assert result.timed_out and result.signal == signal.SIGKILL and result.stderr == ""
    assert time.monotonic() - start < 2.0 + sandbox._TEARDOWN_S + 2 * sandbox._DRAIN_S
    assert run_cgroups() == []
