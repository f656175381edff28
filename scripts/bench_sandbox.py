"""Per-call overhead of the Python sandbox: the round trip of ``print(1)`` through ``run_python``, old vs new.

    .venv/bin/python scripts/bench_sandbox.py [--repeats 30] [--write docs/benchmarks.md]

Three paths, measured interleaved (one call of each per round, so machine noise hits all three alike) in one
process:

- ``no isolation``: today's ``run_python(..., network="allowed")``: just the interpreter start-up and the
  pipes, the floor every path pays;
- ``old sandbox``: ``run_python`` as of commit ``OLD_COMMIT`` (only ``unshare(CLONE_NEWNET)``), loaded from git;
- ``new sandbox``: today's ``run_python`` (user/mount/pid/net/IPC/UTS namespaces, the minimal root, pid 1).

Each figure is the median (and 90th percentile) of ``--repeats`` calls; every call's stdout is checked.
``--write`` replaces the section between ``<!-- bench_sandbox:begin -->`` and ``<!-- bench_sandbox:end -->``
(appending it when absent) and leaves the rest of the file alone.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
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
BEGIN, END = markers("bench_sandbox")


def load_old() -> object:
    """The old sandbox module, from git: it is self-contained (no relative imports)."""
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:rollout/envs/sandbox.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as directory:  # only needed while importing
        path = Path(directory) / "old_sandbox.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("old_sandbox", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


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


async def measure(repeats: int) -> dict[str, list[float]]:
    old = load_old()
    paths = {
        'no isolation (`network="allowed"`)': (sandbox.run_python, {"network": "allowed"}),
        f"old sandbox ({OLD_COMMIT}: network namespace only)": (old.run_python, {}),
        "new sandbox (6 namespaces, minimal root, pid 1)": (sandbox.run_python, {}),
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
    rows = []
    for name, values in times.items():
        median = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        rows.append(f"| {name} | {median * 1000:.1f} | {p90 * 1000:.1f} | {median / old_median:.2f}x |")
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
            "| path | median ms | p90 ms | vs old |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            "The new sandbox forks three more processes (one to enter the namespaces, the pid namespace's init, the "
            f"code's process) and builds its file system view ({mounts} mounts, counted inside) on every call; the "
            "interpreter start-up is paid by every path (first row).",
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
