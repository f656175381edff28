"""``tito serve``: the engines and renderers behind a vLLM-compatible HTTP API with chat sessions."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..startup import Placement


def cmd_serve(args, placement: Placement | None) -> int:
    from ..config import ServeConfig, load_config
    from ..serve.launch import serve
    from .run_cmd import needs_placement

    placement = needs_placement("serve", placement)

    overrides = list(args.set)
    if args.host:
        overrides.append(f"server.host={args.host}")
    if args.port is not None:
        overrides.append(f"server.port={args.port}")
    if args.address:
        overrides.append(f"ray.address={args.address}")
    cfg = load_config(args.config, overrides, schema=ServeConfig)
    print(f"tito serve: {cfg.served_model_name or cfg.model} on http://{cfg.server.host}:{cfg.server.port}: starting "
          f"model {cfg.model}, {cfg.engine.count} x {cfg.engine.backend} engine, renderer {cfg.renderer.name or 'auto'} "
          f"x {cfg.renderer.actors}, samples {cfg.output.dir or 'not written'}", flush=True)
    serve(cfg, placement)
    return 0


def register(sub: argparse._SubParsersAction, placement: Placement | None) -> None:
    p = sub.add_parser("serve", help="serve the engines over HTTP: vLLM's token-in/token-out API and chat sessions")
    p.add_argument("config", nargs="?", help="YAML serve configuration (see configs/serve.yaml); none = defaults")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set engine.count=2 (repeatable)")
    p.add_argument("--host", help="address to listen on (default from the config: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default from the config: 8000; 0 = any free port)")
    p.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    p.set_defaults(func=functools.partial(cmd_serve, placement=placement))
