"""Per-call overhead of the Python sandbox: the round trip of ``print(1)`` through ``run_python``, old vs new.

    .venv/bin/python scripts/bench_sandbox.py [--repeats 30] [--write docs/benchmarks.md]

Five paths, measured interleaved (one call of each per round, so machine noise hits all alike) in one process:

- ``no isolation``: today's ``run_python(..., network="allowed")``: just the interpreter start-up and the
  pipes, the floor every path pays;
- ``old sandbox``: ``run_python`` as of commit ``OLD_COMMIT`` (only ``unshare(CLONE_NEWNET)``), loaded from git;
- ``namespaces only``: ``run_python`` as of commit ``PREV_COMMIT`` (user/mount/pid/net/IPC/UTS namespaces, the
  minimal root, pid 1; no seccomp, no cgroup), loaded from git;
- ``new sandbox without cgroup``: today's, with the run's cgroup turned off (namespaces, seccomp filter, fresh
  session keyring): against the row above, the cost of the filter and the keyring;
- ``new sandbox``: today's, with the run's cgroup where one can be made (the row says whether it was).

Each figure is the median (and 90th percentile) of ``--repeats`` calls; every call's stdout is checked.
``--write`` replaces the section between ``<!-- bench_sandbox:begin -->`` and ``<!-- bench_sandbox:end -->``
(appending it when absent) and leaves the rest of the file alone.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchdoc import markers, replace_section  # noqa: E402

from rollout.envs import sandbox  # noqa: E402

OLD_COMMIT = "db8030f"  # the last version of rollout/envs/sandbox.py before the namespaces of issue 11
PREV_COMMIT = "abca101"  # the last version before the seccomp filter and the cgroup of issue 23
BEGIN, END = markers("bench_sandbox")


def load(commit: str) -> object:
    """``rollout.envs.sandbox`` as of ``commit``, from git, as a package of its own (with ``sandbox_init``
    where that existed): it imports nothing else of the repository."""
    name = f"sandbox_at_{commit}"
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as directory:  # only needed while importing
        package = Path(directory) / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        for module in ("sandbox", "sandbox_init"):
            shown = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{commit}:rollout/envs/{module}.py"], capture_output=True, text=True
            )
            if shown.returncode == 0:
                (package / f"{module}.py").write_text(shown.stdout)
        sys.path.insert(0, directory)
        try:
            return importlib.import_module(f"{name}.sandbox")
        finally:
            sys.path.remove(directory)


async def without_cgroup(code: str, **options) -> object:
    """Today's run_python with the run's cgroup turned off (as where none can be made)."""
    refused, sandbox._cgroup_refused = sandbox._cgroup_refused, "turned off by the benchmark"
    try:
        return await sandbox.run_python(code, **options)
    finally:
        sandbox._cgroup_refused = refused


async def one(run, **options) -> float:  # noqa: ANN001 - either module's run_python
    start = time.perf_counter()
    result = await run("print(1)", **options)
    elapsed = time.perf_counter() - start
    if result.stdout != "1\n" or result.exit_code != 0:
        raise SystemExit(f"unexpected result: {result}")
    return elapsed


async def mounts_inside() -> int:
    """How many mounts the new sandbox builds: the lines of its own mountinfo."""
    result = await sandbox.run_python("print(len(open('/proc/self/mountinfo').readlines()))")
    return int(result.stdout)


async def memory_bound() -> str:
    """How today's sandbox bounds memory on this machine: "cgroup" or "rlimit"."""
    return (await sandbox.run_python("pass")).memory_bound


async def measure(repeats: int) -> dict[str, list[float]]:
    old, prev = load(OLD_COMMIT), load(PREV_COMMIT)
    bound = await memory_bound()
    paths = {
        'no isolation (`network="allowed"`)': (sandbox.run_python, {"network": "allowed"}),
        f"old sandbox ({OLD_COMMIT}: network namespace only)": (old.run_python, {}),
        f"namespaces only ({PREV_COMMIT}: 6 namespaces, minimal root, pid 1)": (prev.run_python, {}),
        "new sandbox without cgroup (+ seccomp filter, fresh keyring)": (without_cgroup, {}),
        f"new sandbox (+ the run's cgroup: memory bound {bound})": (sandbox.run_python, {}),
    }
    for run, options in paths.values():  # warm-up: page cache, imports
        await one(run, **options)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, (run, options) in paths.items():
            times[name].append(await one(run, **options))
    return times


def report(times: dict[str, list[float]], repeats: int, load: float, mounts: int) -> str:
    old_median = statistics.median(next(v for k, v in times.items() if k.startswith("old")))
    prev_median = statistics.median(next(v for k, v in times.items() if k.startswith("namespaces only")))
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        rows.append(
            f"| {name} | {median * 1000:.1f} | {p90 * 1000:.1f} | {median / old_median:.2f}x "
            f"| {(median - prev_median) * 1000:+.1f} |"
        )
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    return "\n".join(
        [
            BEGIN,
            "## Python sandbox: per-call overhead",
            "",
            f"Command: `.venv/bin/python scripts/bench_sandbox.py --repeats {repeats} --write docs/benchmarks.md`  ",
            f"Machine: {machine}; {datetime.date.today().isoformat()}; run as root; 1-minute load average "
            f"{load:.1f} at the start (the machine is shared: read the ratios).",
            "",
            f'`run_python("print(1)")` round trip, {repeats} calls per path, interleaved; milliseconds.',
            "",
            "| path | median ms | p90 ms | vs old | ms vs namespaces only |",
            "|---|---:|---:|---:|---:|",
            *rows,
            "",
            "The namespaced sandboxes fork three more processes (one to enter the namespaces, the pid namespace's "
            f"init, the code's process) and build their file system view ({mounts} mounts today, counted inside) on "
            "every call; the interpreter start-up is paid by every path (first row). Today's sandbox adds a seccomp "
            "filter, a fresh session keyring and two masked /proc files (the row without cgroup), and makes, fills "
            "and removes the run's memory and pids cgroups (the last row, where a cgroup can be made).",
            END,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--write", type=Path, help="markdown file whose bench_sandbox section to replace")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    times = asyncio.run(measure(args.repeats))
    text = report(times, args.repeats, load, asyncio.run(mounts_inside()))
    print(text)
    if args.write:
        replace_section(args.write, "bench_sandbox", text)


if __name__ == "__main__":
    main()
