"""Submit a rollout run to an existing Ray cluster with ``ray job submit``.

    .venv/bin/python scripts/launch_rollouts.py --address http://HEAD:8265 configs/demo.yaml \\
        [--set group_size=8 ...] [--resume] [--dry-run]

The config file travels with the job (the working directory is uploaded as the job's runtime_env,
without .venv, out/ and caches); the job runs ``tito run CONFIG --address auto`` on the cluster,
so engine and renderer actors are placed by Ray across its nodes. The config is validated here first,
so a typo fails before anything is submitted. ``--dry-run`` prints the command instead of running it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollout.config import ConfigError, load_config  # noqa: E402

EXCLUDES = [".venv", "out", ".git", "**/__pycache__", ".pytest_cache", ".ruff_cache"]


def build_command(args: argparse.Namespace) -> list[str]:
    config = Path(args.config)
    try:
        rel = config.resolve().relative_to(REPO)
    except ValueError:
        raise SystemExit(f"{config}: the config must live inside the repository so that it is uploaded with the job") from None
    runtime_env = {"working_dir": str(REPO), "excludes": EXCLUDES,
                   "env_vars": {"HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}}
    if args.pip:
        runtime_env["pip"] = args.pip
    entry = [args.python, "-m", "rollout.cli", "run", str(rel), "--address", "auto", "--quiet"]
    for item in args.set:
        entry += ["--set", item]
    if args.resume:
        entry.append("--resume")
    ray = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    cmd = [ray, "job", "submit", "--address", args.address, "--runtime-env-json", json.dumps(runtime_env)]
    if args.no_wait:
        cmd.append("--no-wait")
    return cmd + ["--"] + entry


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
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
