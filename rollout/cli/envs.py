"""``tito envs [NAME]``: the environments ``env.name`` can name (built-ins and ``tito.environments`` entry
points; any ``package.module:Class`` besides), each with its options. Exit 1 when NAME does not resolve or an
entry point does not load, with the reason."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

from ..envs.base import EnvError
from ..envs.registry import ENTRY_POINT_GROUP, available_envs, describe_env


def _describe(env: dict) -> list[str]:
    lines = [f"{env['name']}  ({env['origin']})"]
    if "error" in env:
        return lines + [f"    cannot load: {env['error']}"]
    if env["summary"]:
        lines += textwrap.wrap(env["summary"], 100, initial_indent="    ", subsequent_indent="    ")
    for key, option in env["options"].items():
        default = "required" if option["required"] else f"default {option['default']!r}"
        lines.append(f"    options.{key}: {default}{' - ' + option['description'] if option['description'] else ''}")
    return lines


def cmd_envs(args: argparse.Namespace) -> int:
    try:
        envs = [describe_env(args.name)] if args.name else available_envs()
    except EnvError as e:
        print(f"tito envs: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(envs, indent=2, default=repr))
    else:
        print("\n".join(line for env in envs for line in _describe(env)))
        if not args.name:
            print(f"\nenv.name may also be 'package.module:Class'; packages add names as {ENTRY_POINT_GROUP} "
                  "entry points (docs/environments.md).")
    return 1 if any("error" in env for env in envs) else 0


def register(sub) -> None:
    p = sub.add_parser("envs", help="the environments env.name can name, with their options")
    p.add_argument("name", nargs="?", help="one environment (a name or 'package.module:Class')")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_envs)
