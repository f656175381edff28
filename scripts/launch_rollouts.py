"""Submit a rollout run to an existing Ray cluster with ``ray job submit``.

    .venv/bin/python scripts/launch_rollouts.py --address http://HEAD:8265 configs/demo.yaml \\
        [--set group_size=8 ...] [--resume] [--dry-run]

The config file travels with the job (the working directory is uploaded as the job's runtime_env,
without .venv, out/ and caches). The renderer package goes as a py_module: the uploaded tree has it as
``renderers/``, the name it is installed from, so a copy named ``tito_renderers`` is staged under
out/launch/ for Ray to put on the job's PYTHONPATH. The job runs ``tito run CONFIG --address auto`` on the cluster,
so engine and renderer actors are placed by Ray across its nodes. The config is validated here first,
so a typo fails before anything is submitted. ``--dry-run`` prints the command instead of running it.

Right after a cluster starts, its job server may not have a job agent yet: Ray then answers HTTP 500 "No
available agent to submit job" after waiting 10 s itself, and nothing was submitted. That one answer is
retried until ``--agent-wait`` seconds (default 60) have passed; every other failure is final.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollout.config import ConfigError, load_config  # noqa: E402

EXCLUDES = [".venv", "out", ".git", "**/__pycache__", ".pytest_cache", ".ruff_cache"]
STAGE = REPO / "out" / "launch"  # where the renderer package is staged (out/ is ignored by git and the upload)
# Ray's job head (dashboard/modules/job/job_head.py, submit_job) answers this, with HTTP 500, when the head
# node's job agent has not registered within its own 10 s: the job was not submitted, so trying again is safe
NO_AGENT = "No available agent to submit job"
RETRY_PAUSE_S = 2.0


def stage_renderers(into: Path = STAGE) -> Path:
    """A copy of renderers/ named ``tito_renderers`` (pyproject.toml installs the directory under that
    name; Ray's py_modules names a module after its directory), under a folder named by the sha256 of its
    files: a launch never changes a copy that an earlier launch may still be uploading."""
    files = sorted(p for p in (REPO / "renderers").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    dest = into / digest.hexdigest()[:16] / "tito_renderers"
    if not dest.is_dir():
        partial = dest.parent / f".tito_renderers.{os.getpid()}"
        shutil.copytree(REPO / "renderers", partial, ignore=shutil.ignore_patterns("__pycache__"))
        try:
            partial.rename(dest)
        except OSError:  # a concurrent launch staged the same files first
            shutil.rmtree(partial, ignore_errors=True)
    return dest


def runtime_env(args: argparse.Namespace) -> dict:
    """The job's runtime_env: this tree as its working directory, the staged renderer package as a
    py_module, offline model loading."""
    env = {"working_dir": str(REPO), "excludes": EXCLUDES, "py_modules": [str(stage_renderers())],
           "env_vars": {"HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}}
    if args.pip:
        env["pip"] = args.pip
    return env


def build_command(args: argparse.Namespace) -> list[str]:
    config = Path(args.config)
    try:
        rel = config.resolve().relative_to(REPO)
    except ValueError:
        raise SystemExit(f"{config}: the config must live inside the repository so that it is uploaded with the job") from None
    env = runtime_env(args)
    entry = [args.python, "-m", "actors.cli", "run", str(rel), "--address", "auto", "--quiet"]
    for item in args.set:
        entry += ["--set", item]
    if args.resume:
        entry.append("--resume")
    ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    cmd = [ray, "job", "submit", "--address", args.address, "--runtime-env-json", json.dumps(env)]
    if args.no_wait:
        cmd.append("--no-wait")
    return cmd + ["--"] + entry


def _echo(source: TextIO, sink: TextIO, seen: list[str]) -> None:
    """Copy a stream line by line as it comes, keeping every line for the caller to look at."""
    for line in source:
        sink.write(line)
        sink.flush()
        seen.append(line)


def run_echoing(cmd: list[str]) -> tuple[int, str]:
    """Run ``cmd`` with its stdout and stderr passed through as they come (the job's log while it runs);
    return its exit status and everything it printed."""
    seen: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1) as process:
        assert process.stdout is not None and process.stderr is not None
        copiers = [threading.Thread(target=_echo, args=(process.stdout, sys.stdout, seen), daemon=True),
                   threading.Thread(target=_echo, args=(process.stderr, sys.stderr, seen), daemon=True)]  # fmt: skip
        for copier in copiers:
            copier.start()
        for copier in copiers:
            copier.join()
        return process.wait(), "".join(seen)


def submit(cmd: list[str], agent_wait_s: float) -> int:
    """Run ``ray job submit``; while the cluster has no job agent yet, submit again, for up to ``agent_wait_s``."""
    deadline = time.monotonic() + agent_wait_s
    while True:
        status, printed = run_echoing(cmd)
        if status == 0 or NO_AGENT not in printed:
            return status
        if time.monotonic() + RETRY_PAUSE_S > deadline:
            print(
                f"launch_rollouts: the cluster's job server still had no job agent after {agent_wait_s:g} s "
                f"({NO_AGENT!r}); nothing was submitted. Check the head node's dashboard agent in "
                "<ray temp dir>/session_latest/logs/dashboard_agent.log: 'Failed to bind to port 52365' means "
                "another Ray on that machine holds the agent's default port (start the head with "
                "--dashboard-agent-listen-port=<a free port>); otherwise wait longer with --agent-wait.",
                file=sys.stderr,
            )
            return status
        print(
            f"launch_rollouts: the cluster's job server has no job agent yet; nothing was submitted, trying "
            f"again ({deadline - time.monotonic():.0f} s left of --agent-wait)",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(RETRY_PAUSE_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--address", required=True, help="the cluster's job server, e.g. http://head:8265")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--python", default="python", help="the interpreter on the cluster that has tito's dependencies")
    ap.add_argument("--pip", nargs="*", help="extra pip packages for the job's environment (e.g. tito[vllm])")
    ap.add_argument("--no-wait", action="store_true", help="return once submitted")
    ap.add_argument("--dry-run", action="store_true", help="print the command, submit nothing")
    ap.add_argument("--agent-wait", type=float, default=60.0, metavar="SECONDS",
                    help="how long to keep submitting while the cluster has no job agent yet (default 60)")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        load_config(args.config, args.set)
    except ConfigError as exc:
        print(f"launch_rollouts: {exc}", file=sys.stderr)
        return 2
    cmd = build_command(args)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    return submit(cmd, args.agent_wait)


if __name__ == "__main__":
    sys.exit(main())
