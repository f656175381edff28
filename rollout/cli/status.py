"""``tito status RUN_DIR``: what a ``tito run --follow`` on RUN_DIR is doing, from its status.json, in one screen.

Exit statuses: 0 healthy; 1 stale (the service is gone: status.json not rewritten for 3 intervals, its pid dead,
or it stopped); 2 RUN_DIR has no (readable) status.json; 3 stalled (nothing progressed for follow.stall_after_s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..follow.status import health, read_status, status_path

EXIT = {"healthy": 0, "stale": 1, "stalled": 3}
NO_STATUS = 2


def _ago(t: float | None, now: float) -> str:
    if not t:
        return "-"
    return f"{time.strftime('%H:%M:%S', time.localtime(t))} ({now - t:.0f} s ago)"


def render(status: dict, now: float) -> str:
    verdict, why = health(status, now)
    w = status.get("waiting_for") or {}
    err = status.get("last_error")
    versions = ", ".join(f"{i}: {'dead' if v is None else f'v{v}'}" for i, v in enumerate(status.get("version") or []))
    lines = [
        f"tito status {status.get('run_dir')}: {why}",
        f"  state        {status.get('state')}, batch {status.get('batch')} (sealed {status.get('sealed')}"
        f"{'' if status.get('max_steps') is None else ' of ' + str(status.get('max_steps'))})",
        f"  engines      {status.get('engines_alive')} of {status.get('engines_configured')} alive; versions {versions}",
        f"  waiting for  {w.get('what', '-')} since {_ago(w.get('since'), now)}",
        f"  progressed   {_ago(status.get('progressed_at'), now)}; {status.get('rollouts_done')} rollouts done",
        f"  last error   {'-' if not err else err.get('message')}",
        f"  updated      {_ago(status.get('updated_at'), now)}, every {status.get('interval_s')} s; pid "
        f"{status.get('pid')} on {status.get('host')}, started {_ago(status.get('started_at'), now)}",
    ]
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        status = read_status(args.run_dir)
    except (ValueError, OSError) as exc:
        print(f"tito status: {exc}", file=sys.stderr)
        return NO_STATUS
    if status is None:
        print(f"tito status: {status_path(args.run_dir)} does not exist: no `tito run --follow {args.run_dir}` has "
              "written a status there (it writes one once its engines are up)", file=sys.stderr)
        return NO_STATUS
    now = time.time()
    print(json.dumps(status, indent=1) if args.json else render(status, now))
    return EXIT[health(status, now)[0]]


def register(sub) -> None:
    p = sub.add_parser("status", help="what a `tito run --follow` on RUN_DIR is doing (exit 0 healthy, 1 gone, "
                                      "2 no status.json, 3 stalled)")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print status.json as it is")
    p.set_defaults(func=cmd_status)
