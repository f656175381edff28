"""``tito run`` and ``tito inspect``: the main job and a look at its output."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..startup import Placement


def needs_placement(command: str, placement: Placement | None) -> Placement:
    """The placement ``tito run`` and ``tito serve`` start their actors with; a clear error without one."""
    if placement is None:
        raise ValueError(f"{command} starts Ray actors: run it as `tito {command}` or `python -m actors.cli "
                         f"{command}` (rollout.cli alone has no way to place them)")
    return placement


# `tito run`'s exit status when every engine died: finished groups (or sealed batches) are on disk, the rest
# needs engines (2 is a usage or config error, 1 a run that wrote nothing, 128 + N a signal)
EXIT_ENGINES_DIED = 3
# a renderer did not answer within renderer.call_timeout_s: the run stopped, keeping what was written or sealed
EXIT_RENDERER_HUNG = 4
# more rollouts than env.max_error_rate ended with env_error: the environment is broken, the written work stays
EXIT_ENV_ERRORS = 5


def _command(args, *extra: str) -> str:
    """The ``tito run`` command line ``args`` came from (its settings in the same order), plus ``extra``."""
    import shlex

    words = ["tito", "run", args.config, *(w for kv in args.set for w in ("--set", kv))]
    for flag in ("format", "address", "out", "follow"):
        if getattr(args, flag) is not None:
            words += [f"--{flag}", getattr(args, flag)]
    return shlex.join([*words, *(["--quiet"] if args.quiet else []), *extra])


def cmd_run(args, placement: Placement | None) -> int:
    import sys

    from ..config import ConfigError, load_config
    from ..handles import RendererHung
    from ..loop import AllEnginesDied, EnvErrorRate
    from .run import RunInterrupted, _signals_raise, print_summary, run, shutdown_ray

    placement = needs_placement("run", placement)

    for flag in ("out", "follow"):
        # an empty path is no directory: `Path("")` is the current one, where the config's would have gone
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise ConfigError(f"--{flag} {getattr(args, flag)!r}: an empty path; name a directory")
    overrides = list(args.set)
    if args.format:
        overrides.append(f"output.format={args.format}")
    if args.address:
        overrides.append(f"ray.address={args.address}")
    if args.out is not None:
        overrides.append(f"output.dir={args.out}")
    cfg = load_config(args.config, overrides)
    # Ctrl-C / SIGTERM: one line and 128 + signal, never a traceback; later ones are ignored until the exit
    with _signals_raise(ignore_after=True):
        try:
            summary = run(cfg, placement, resume=args.resume, progress=not args.quiet, follow=args.follow)
        except RunInterrupted as exc:
            if args.follow:
                sealed = exc.summary["sealed"] if exc.summary else "no new"
                print(f"tito run --follow: {exc}: {sealed} batches sealed in {args.follow}; the same command "
                      "goes on from the next batch", file=sys.stderr)
            elif exc.summary is None:
                print(f"tito run: {exc}: before any rollout ran; nothing new written to {cfg.output.dir}",
                      file=sys.stderr)
            else:
                s = exc.summary
                print(f"tito run: {exc}: {s['this_run']['rollouts']} rollouts written this run, {s['rollouts']} in "
                      f"all in {cfg.output.dir}; rerun with --resume to finish", file=sys.stderr)
            return 128 + exc.signum
        except EnvErrorRate as exc:
            if args.follow:
                sealed = exc.summary["sealed"] if exc.summary else "no new"
                print(f"tito run --follow: {exc}: stopping; {sealed} batches sealed in {args.follow}", file=sys.stderr)
            else:
                print(f"tito run: {exc}: stopping; what finished is in {cfg.output.dir}", file=sys.stderr)
            return EXIT_ENV_ERRORS
        except RendererHung as exc:  # its rollouts' state is lost with it: what is sealed (or written) stays
            if args.follow:
                sealed = exc.summary["sealed"] if exc.summary else "no new"
                print(f"tito run --follow: {exc}: stopping; {sealed} batches sealed in {args.follow}; "
                      f"`{_command(args)}` goes on from the next batch", file=sys.stderr)
            else:
                print(f"tito run: {exc}: stopping; what finished is in {cfg.output.dir}: "
                      f"`{_command(args, '--resume')}` runs the rest", file=sys.stderr)
            return EXIT_RENDERER_HUNG
        except AllEnginesDied as exc:  # run() raises it once the finished work is on disk, with its summary
            s = exc.summary
            if args.follow:
                print(f"tito run --follow: {exc}: {s['sealed']} batches sealed in {args.follow}; once engines can "
                      f"run, `{_command(args)}` goes on from the next batch", file=sys.stderr)
            else:
                this = s["this_run"]
                print(f"tito run: {exc}: {this['groups_written']} finished groups ({this['rollouts']} rollouts) written "
                      f"this run, {s['rollouts']} rollouts in all in {cfg.output.dir}; {this['groups_not_run']} groups "
                      f"not run: `{_command(args, '--resume')}` runs them", file=sys.stderr)
            return EXIT_ENGINES_DIED
        else:
            if args.follow:
                print(f"tito run --follow: {args.follow}: {summary['sealed']} batches sealed")
                return 0
            print(f"tito run: {cfg.output.dir}")
            print_summary(summary)
            return 0 if summary["rollouts"] else 1
        finally:  # Ray stops now, with signals ignored, rather than in its exit hook
            shutdown_ray()


def cmd_inspect(args) -> int:
    import sys

    from tito_renderers import load_tokenizer

    from ..data.inspect_shards import _sample, inspect
    from ..models import resolve_model
    from .progress import use_color

    tokenizer = None
    if not args.no_sample:
        model = args.model or _sample(args.path, args.sample)["model"]
        try:
            tokenizer = load_tokenizer(resolve_model(model))
        except (ValueError, OSError):
            if args.model or not args.html:
                raise
            # the HTML viewer shows token ids where the shards' model is not on this machine
    print(inspect(args.path, sample=args.sample, html_out=None if args.no_sample else args.html, tokenizer=tokenizer,
                  limit=args.limit, color=use_color(sys.stdout)))
    return 0


def register(sub: argparse._SubParsersAction, placement: Placement | None) -> None:
    run = sub.add_parser("run", help="run rollouts from a config and write training shards")
    run.add_argument("config", help="YAML run configuration (see configs/demo.yaml)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set group_size=8 (repeatable)")
    run.add_argument("--format", choices=["arrow", "parquet"], help="shard format (default from the config)")
    run.add_argument("--address", help="join this Ray cluster instead of starting a local one")
    run.add_argument("--out", help="output directory (default from the config)")
    run.add_argument("--resume", action="store_true", help="continue a run: skip groups already in the shards")
    run.add_argument("--quiet", action="store_true", help="no progress line")
    run.add_argument("--follow", metavar="RUN_DIR",
                     help="continuous RL: write batches to RUN_DIR/rollouts/step_k/ while loading the trainer's "
                          "weights from RUN_DIR/broadcasts/step_N/ (docs/follow.md; settings: follow.*)")
    run.set_defaults(func=functools.partial(cmd_run, placement=placement))

    ins = sub.add_parser("inspect", help="summarise shards and show one sample with its trainable tokens")
    ins.add_argument("path", help="a shard directory or file")
    ins.add_argument("--sample", type=int, default=0, help="row to show (default 0)")
    ins.add_argument("--html", metavar="FILE",
                     help="write an HTML viewer of the samples (from --sample, up to --limit) to this file")
    ins.add_argument("--limit", type=int, default=200, help="samples in the HTML viewer (default 200)")
    ins.add_argument("--model", help="tokenizer to decode with (default: the shards' model)")
    ins.add_argument("--no-sample", action="store_true", help="only the summary")
    ins.set_defaults(func=cmd_inspect)


