"""``tito run CONFIG``: Ray, engine actors, renderer actors, the rollout driver, shards and a summary.

The start-up steps it shares with ``tito serve`` are in rollout/startup.py; the actors come from the
:class:`~rollout.startup.Placement` the caller passes (the ``tito`` command: actors/placement.py, on Ray)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .. import startup
from ..config import RunConfig
from ..data.outputs import check_resume, complete_groups, drop_groups, remove_temporaries, write_failure, write_outputs
from ..data.shards import DATA_DIR, ShardWriteError, output_shards, read_table, write_error_of
from ..handles import EngineHandle, RendererHandle, RendererHung
from ..loop import AllEnginesDied, EnvErrorRate, RolloutDriver
from ..startup import STOP_SIGNALS, Placement, in_main_thread
from .progress import Progress, ready_line, startup_line

T = TypeVar("T")


class RunInterrupted(Exception):
    """SIGINT/SIGTERM stopped ``tito run``: finished groups are on disk and the manifest and summary
    cover them (``summary``, once written). ``cmd_run`` prints one line and exits 128 + signal."""

    def __init__(self, signum: int, summary: dict[str, Any] | None = None) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum, self.summary = signum, summary


# The first SIGINT/SIGTERM a run got. Only that one stops it: a later one (Ctrl-C pressed twice, a
# supervisor repeating SIGTERM) is ignored, so it cannot cut short the flush, the summary or Ray's shutdown.
_first_signal: list[int] = []


def _raise_first_signal(signum: int, _frame: Any) -> None:
    if not _first_signal:
        _first_signal.append(signum)
        raise RunInterrupted(signum)


@contextlib.contextmanager
def _signals_raise(*, ignore_after: bool = False) -> Iterator[None]:
    """The first SIGINT or SIGTERM raises :class:`RunInterrupted` (instead of a KeyboardInterrupt traceback, or
    Ray's exit on SIGTERM) while the run starts and stops, later ones are ignored; the rollout loop itself
    handles them in :func:`_drive`. Only in the main thread. ``ignore_after`` (``cmd_run``, whose process
    exits next): once the block ended without an exception, both stay ignored instead of being restored,
    so a second Ctrl-C cannot break the interpreter's exit hooks (Ray's, torch's) with a traceback."""
    if not in_main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not _raise_first_signal:  # the outermost: a new run
        _first_signal.clear()
    old = {s: signal.signal(s, _raise_first_signal) for s in STOP_SIGNALS}
    ended = False
    try:
        yield
        ended = True
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_IGN if ignore_after and ended else h)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """While finished groups are flushed after a signal, and Ray shuts down: a second Ctrl-C must not cut
    them short."""
    if not in_main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


async def _drive(work: Awaitable[T], signals: list[int]) -> T | None:
    """Await ``work`` (``driver.run(tasks)``, or a follow service); SIGINT/SIGTERM cancel it (running rollouts
    stop, finished groups were already handed to the renderers) and are recorded in ``signals``."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    installed = []

    def stop(signum: int) -> None:
        if not signals and not _first_signal:
            _first_signal.append(signum)
            signals.append(signum)
            main.cancel()

    for s in (signal.SIGINT, signal.SIGTERM):
        before = signal.getsignal(s)
        try:
            loop.add_signal_handler(s, stop, s)
            installed.append((s, before))
        except (ValueError, RuntimeError):  # not the main thread: no signal handling
            pass
    try:
        return await work
    except asyncio.CancelledError:
        if signals:
            return None
        raise
    finally:
        for s, before in installed:
            loop.remove_signal_handler(s)  # resets the Python default handler, not the one found ...
            signal.signal(s, before)  # ... so until the run's own block ends, a signal still flushes first


def shutdown_ray() -> None:
    """Stop the Ray this process started (or leave the cluster it joined), with SIGINT/SIGTERM ignored
    meanwhile: ``cmd_run`` calls it once the run is over, so Ray is not left to an exit hook that a second
    Ctrl-C would interrupt with a traceback."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        with _signals_ignored():
            ray.shutdown()


def _check_unique_ids(tasks: list, env_name: str) -> None:
    """A generator's task ids must be unique: a task's rollouts are named ``<task_id>#<i>``."""
    seen: set[str] = set()
    for task in tasks:
        if task.task_id in seen:
            raise ValueError(f"environment {env_name} generated task id {task.task_id!r} twice: rollouts are named "
                             "by it, so its ids must be unique")
        seen.add(task.task_id)


def done_rollouts(out_dir: Path) -> set[str]:
    """Rollout ids already written to finished shard files (for --resume); reads one column."""
    from ..data.readers import open_shards

    if not output_shards(out_dir):
        return set()
    return set(open_shards(out_dir).to_table(columns=["rollout_id"])["rollout_id"].to_pylist())


def _this_run(out_dir: Path, closed: list[dict]) -> tuple[int, int]:
    """(rollouts, sampled tokens) in the files this run wrote."""
    rollouts = tokens = 0
    for f in (f for c in closed for f in c["files"]):
        t = read_table(out_dir / DATA_DIR / f["file"], columns=["segment_index", "completion_tokens"])
        rollouts += t["segment_index"].to_pylist().count(0)
        tokens += sum(t["completion_tokens"].to_pylist())
    return rollouts, tokens


def run(cfg: RunConfig, placement: Placement, *, resume: bool = False, progress: bool = True,
        follow: str | Path | None = None) -> dict[str, Any]:
    """Run every task's group (skipping, with ``resume``, the groups complete on disk) on actors that
    ``placement`` starts, and return the summary written to ``_summary.json``. Raises
    :class:`RunInterrupted` on SIGINT/SIGTERM, and :class:`~rollout.loop.AllEnginesDied` (its ``summary`` set)
    once every engine died, after the finished groups, the manifest and the summary are on disk.

    ``follow=RUN_DIR``: continuous RL instead (rollout/follow/): batches of ``follow.groups_per_step`` groups
    drawn from the tasks go to ``RUN_DIR/rollouts/step_k/`` while the trainer's weights are loaded as they
    appear; returns the follow summary once ``follow.max_steps`` batches are sealed."""
    import ray

    from ..envs import load_tasks, make_env

    if follow is not None:
        from ..data import layout

        if resume:
            raise ValueError("--resume is for a batch run: a --follow run always goes on from its last sealed batch")
        follow = Path(follow)
        out_dir = follow / layout.ROLLOUTS  # renderers' break log; each batch writes its own step_k/
    else:
        out_dir = Path(cfg.output.dir)
    if out_dir.exists() and output_shards(out_dir) and not resume:
        raise ValueError(f"output directory {out_dir} already holds shards: pass --resume to continue it, "
                         "or choose another output.dir")
    local_ray = not cfg.ray.address and not ray.is_initialized()
    engine_cpus, cpu_note = startup.preflight(cfg, out_dir)  # a run that cannot start says so in seconds
    listener = None
    if follow is not None and cfg.follow.weights == "wire":  # a port in use is named before any engine loads
        from ..follow.wire import bind_listener

        listener = bind_listener(cfg.follow.listen)
    env = make_env(cfg.env.name, **cfg.env.options)
    if cfg.tasks.path:  # a bad or repeated row is named (file and line) before the model is loaded
        tasks = load_tasks(cfg.tasks.path).tasks[: cfg.tasks.count]
    else:
        tasks = env.generate_tasks(cfg.tasks.count or 8, cfg.tasks.seed)
        _check_unique_ids(tasks, cfg.env.name)
    eval_tasks = None
    if follow is not None and cfg.follow.eval is not None:  # its environment and tasks checked before any engine
        from ..follow.eval import held_out_tasks

        eval_tasks, _ = held_out_tasks(cfg, tasks)
    config = cfg.model_dump(mode="json")
    model_path = str(startup.find_model(cfg.model))
    # the driver parses completions itself (same renderer code and tokenizer as the renderer actors);
    # built first, so a resume is checked against the template hash before anything runs
    parser = startup.create_parser(cfg.renderer, model_path)
    if resume and out_dir.exists() and output_shards(out_dir):
        check_resume(out_dir, config, parser.template_sha256 or "")
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_temporaries(out_dir)  # what a failed or killed run left half-written: never a complete file
    skipped, repaired = 0, []
    if resume:
        done, broken = complete_groups(out_dir, cfg.group_size)
        # partial or duplicated groups (written by versions that split groups across files) are
        # removed from their files and run again whole: see rollout/data/outputs.py
        repaired = sorted(broken)
        drop_groups(out_dir, broken)
        keep = [t for t in tasks if t.task_id not in done]
        skipped = len(tasks) - len(keep)
        tasks = keep

    bar = Progress(len(tasks) * cfg.group_size, enabled=progress and follow is None)  # follow: a line per event
    bar.watch(out_dir / DATA_DIR)  # counts the rollouts written to disk, beside those finished
    bar.note(startup_line(cfg, model_path, len(tasks) * cfg.group_size))
    if cpu_note:
        bar.note(cpu_note)
    signals: list[int] = []
    engines: list[EngineHandle] = []
    renderer_actors: list[RendererHandle] = []
    driver: RolloutDriver | None = None
    rinfo = {"renderer": parser.name, "template_sha256": parser.template_sha256}
    startup_s = wall_s = 0.0
    t1: float | None = None
    error: Exception | None = None
    t0 = time.perf_counter()
    with _signals_raise():
        try:
            startup.init_ray(cfg.ray, defer_signals=True)
            if cfg.ray.address:
                startup.check_cluster_gpus(cfg.engine)
            if not local_ray:
                startup.wait_for_cluster_cpus(cfg, engine_cpus, bar.note)
            engines = placement.start_engines(startup.engine_specs(cfg.engine, model_path, engine_cpus))
            infos = placement.engine_infos(engines)
            renderer_actors = placement.start_renderers(startup.RendererSpec(
                model_path, cfg.renderer, model_name=cfg.model, out_dir=str(out_dir), fmt=cfg.output.format,
                rows_per_file=cfg.output.rows_per_file, flush_interval_s=cfg.output.flush_interval_s))
            rinfo = placement.renderer_infos(renderer_actors[:1])[0]
            startup_s = time.perf_counter() - t0
            bar.note(ready_line(startup_s, len(engines), rinfo))
            bar.start()
            driver = RolloutDriver(cfg, env, engines, renderer_actors, infos[0], parser,
                                   on_progress=None if follow else bar)
            bar.driver = driver
            if follow is None:
                # a lost engine, its restart: lines above the progress bar, or plain lines without one
                driver.log = bar.note if bar.enabled else _stderr_line
            t1 = time.perf_counter()
            if follow is None:
                asyncio.run(_drive(driver.run(tasks), signals))
            else:
                from ..follow.service import FollowService

                async def serve_batches() -> int:  # built on the loop that runs it (asyncio primitives)
                    return await FollowService(cfg, follow, driver, engines, renderer_actors, tasks, config=config,
                                               eval_tasks=eval_tasks, listener=listener,
                                               renderer_info=rinfo).run()

                asyncio.run(_drive(serve_batches(), signals))
        except RunInterrupted as exc:  # during start-up, or at the very end
            signals.append(exc.signum)
        except Exception as exc:  # still flush what finished and record it, then re-raise
            error = write_error_of(exc) or exc  # a failed shard write: its own one-line message
        if t1 is not None:
            wall_s = time.perf_counter() - t1
    with _signals_ignored():
        # flush: every finished group still pending in a renderer goes to a file now; one at a time, each bounded,
        # so a renderer that died or hung costs only its own pending rows
        closed = []
        for index, renderer in enumerate(renderer_actors):
            try:
                closed += placement.close_renderers([renderer], timeout_s=cfg.renderer.call_timeout_s)
            except Exception as exc:
                if error is None:
                    if not is_timeout(exc):
                        raise
                    error = RendererHung(f"renderer {index} did not close within renderer.call_timeout_s "
                                         f"{cfg.renderer.call_timeout_s:g} (stopped or hung)")
        failed_writes = [c["write_error"] for c in closed if c.get("write_error")]
        if error is None and failed_writes:  # e.g. the last timed flush hit a full disk
            error = ShardWriteError(failed_writes[0])
        bar.finish()
        if follow is not None:
            from ..follow.service import recover

            placement.stop([*engines, *renderer_actors])
            if listener is not None:
                listener.close()
            # what the renderers flushed into batches that were never sealed is removed: a trainer never sees it
            summary = {"run_dir": str(follow), "sealed": recover(follow), "wall_s": round(wall_s, 3),
                       "startup_s": round(startup_s, 3), "resumed_turns": driver.resumed_turns if driver else 0,
                       "interrupted": signal.Signals(signals[0]).name if signals else None}
            if isinstance(error, AllEnginesDied | RendererHung | EnvErrorRate):
                error.summary = summary  # type: ignore[union-attr]
            if error is not None:
                raise error
            if signals:
                raise RunInterrupted(signals[0], summary)
            return summary
        rollouts, tokens = _this_run(out_dir, closed)
        busy = driver.router.busy_s if driver is not None else [0.0]
        groups_written = rollouts // cfg.group_size  # groups are written whole
        run_info = {
            "rollouts": rollouts, "completion_tokens": tokens, "tasks": len(tasks), "skipped_tasks_resumed": skipped,
            "resumed": resume, "groups_rerun_after_repair": repaired,
            "interrupted": signal.Signals(signals[0]).name if signals else None,
            # a run cut short (a signal, every engine dead): what --resume has left to run
            "groups_written": groups_written, "groups_not_run": len(tasks) - groups_written,
            "engines_died": str(error) if isinstance(error, AllEnginesDied) else None,
            "reruns_after_engine_death": driver.reruns if driver is not None else 0,
            # engines lost (killed, OOM, hung) and restarted with the run going on (rollout/engines/healer.py)
            "engines_lost": driver.healer.lost_total if driver is not None else 0,
            "engines_restarted": driver.healer.restarted_total if driver is not None else 0,
            "env_errors": driver.env_errors if driver is not None else 0,  # rollouts the environment failed
            "wall_s": round(wall_s, 3), "startup_s": round(startup_s, 3),
            # wall time each engine had a request in flight; wall / busy is the orchestration overhead
            "engine_busy_s": [round(b, 3) for b in busy],
            "overhead": round(wall_s / max(max(busy), 1e-9), 3),
            "renderer": rinfo["renderer"], "template_sha256": rinfo["template_sha256"],
        }
        try:
            summary = write_outputs(out_dir, config, run_info, [f for c in closed for f in c["files"]])
        except ShardWriteError as exc:
            if not isinstance(error, ShardWriteError):
                raise
            summary, error = None, write_failure(error, out_dir, manifest_error=exc)
        else:
            if isinstance(error, ShardWriteError):
                error = write_failure(error, out_dir, summary=summary)
            elif isinstance(error, AllEnginesDied | RendererHung | EnvErrorRate):
                error.summary = summary  # type: ignore[union-attr]
        placement.stop([*engines, *renderer_actors])
    if error is not None:
        raise error
    if signals:
        raise RunInterrupted(signals[0], summary)
    return summary


def is_timeout(exc: BaseException) -> bool:
    """A bounded wait that ran out (Ray's GetTimeoutError, or asyncio's / the builtin TimeoutError)."""
    try:
        from ray.exceptions import GetTimeoutError
    except ImportError:  # pragma: no cover - ray is a dependency
        return isinstance(exc, TimeoutError)
    return isinstance(exc, (TimeoutError, GetTimeoutError))


def _stderr_line(line: str) -> None:
    print(f"tito run: {line}", file=sys.stderr, flush=True)


def print_summary(summary: dict[str, Any], out=sys.stdout) -> None:
    this = summary["this_run"]
    resumed = f", {this['rollouts']} this run" if this.get("resumed") else ""
    rows = [
        ("rollouts", f"{summary['rollouts']} ({summary['tasks']} tasks x {summary['group_size']}{resumed})"),
        ("turns", summary["turns"]),
        ("sampled tokens", summary["completion_tokens"]),
        ("tokens/s", f"{this['completion_tokens'] / max(this['wall_s'], 1e-9):,.1f}"),
        ("mean reward", f"{summary['mean_reward']:.3f}"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(summary["finish_reasons"].items())) or "-"),
        ("breaks", ", ".join(f"{k} {v}" for k, v in sorted(summary["breaks"].items())) or "none"),
        ("break rate (per turn)", f"{summary['break_rate']:.3f}"),
        ("errors", summary["errors"]),
        ("wall time", f"{this['wall_s']:.1f} s (+{this['startup_s']:.1f} s start-up)"),
        ("renderer", f"{summary['renderer']} ({(summary['template_sha256'] or '')[:16]})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
