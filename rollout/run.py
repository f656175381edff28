"""``tito run CONFIG``: Ray, engine actors, renderer actors, the rollout driver, shards and a summary."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .config import RunConfig
from .loop import RolloutDriver, RolloutOutcome
from .outputs import check_resume, complete_groups, drop_groups, write_outputs
from .progress import Progress, ready_line, startup_line
from .shards import DATA_DIR, output_shards, read_table


class RunInterrupted(Exception):
    """SIGINT/SIGTERM stopped ``tito run``: finished groups are on disk and the manifest and summary
    cover them (``summary``, once written). ``cmd_run`` prints one line and exits 128 + signal."""

    def __init__(self, signum: int, summary: dict[str, Any] | None = None) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum, self.summary = signum, summary


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`RunInterrupted` (instead of a KeyboardInterrupt traceback, or
    Ray's exit on SIGTERM) while the run starts and stops; the rollout loop itself handles them in
    :func:`_drive`. Only in the main thread (signal handlers cannot be set elsewhere)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise RunInterrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """While finished groups are flushed after a signal: a second Ctrl-C must not cut the flush short."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


async def _drive(driver: RolloutDriver, tasks: list, signals: list[int]) -> list[RolloutOutcome]:
    """``driver.run(tasks)``; SIGINT/SIGTERM cancel it (running rollouts stop, finished groups were
    already handed to the renderers) and are recorded in ``signals``."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    installed = []

    def stop(signum: int) -> None:
        if not signals:
            signals.append(signum)
            main.cancel()

    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(s, stop, s)
            installed.append(s)
        except (ValueError, RuntimeError):  # not the main thread: no signal handling
            pass
    try:
        return await driver.run(tasks)
    except asyncio.CancelledError:
        if signals:
            return []
        raise
    finally:
        for s in installed:
            loop.remove_signal_handler(s)


def _init_ray(cfg: RunConfig) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    if cfg.ray.address:
        ray.init(address=cfg.ray.address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=cfg.ray.num_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=False)


def _check_engine_options(backend: str, options: dict[str, Any]) -> None:
    """Refuse options the backend's constructor does not take, naming them and the ones it does, before any
    engine starts (an actor would otherwise fail with a TypeError deep in its start-up)."""
    import inspect

    from actors.engine import backend_class

    params = inspect.signature(backend_class(backend)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    allowed = sorted(n for n, p in params.items() if p.kind is not p.VAR_POSITIONAL)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"engine.options: {', '.join(unknown)} not an option of the {backend} backend "
                         f"(its options: {', '.join(allowed)})")


def _engine_num_gpus(cfg: RunConfig) -> float | None:
    """GPUs per engine actor: the config's, else none on vLLM's CPU build (None: the kind's default)."""
    if cfg.engine.num_gpus is None and cfg.engine.backend == "vllm":
        from .engines.vllm_backend import vllm_platform

        if vllm_platform() == "cpu":
            return 0.0  # the engine actor holds one CPU, no GPU
    return cfg.engine.num_gpus


def _engine_specs(cfg: RunConfig, model_path: str) -> list[dict[str, Any]]:
    """The engine actors' specs (the options checked first with :func:`_check_engine_options`)."""
    options = dict(cfg.engine.options)
    if cfg.engine.backend == "embedded":
        options.setdefault("model", model_path)
    elif cfg.engine.backend == "vllm":
        from .models import model_dir

        # vLLM loads a safetensors directory: a GGUF (the default model) is converted once into the cache
        options.setdefault("model", str(model_dir(model_path)))
    return [{"kind": cfg.engine.backend, "kwargs": options, "max_concurrency": cfg.engine.max_concurrency,
             "replicas": cfg.engine.count, "num_cpus": cfg.engine.num_cpus, "num_gpus": _engine_num_gpus(cfg)}]


def _model_path(name: str) -> Path:
    """The model's file or directory; an alias that is not here yet is fetched first (the demo's first run)."""
    from .models import ALIASES, ModelNotFound, pull_model, resolve_model

    try:
        return resolve_model(name)
    except ModelNotFound:
        if name not in ALIASES:
            raise
        return pull_model(name)


def done_rollouts(out_dir: Path) -> set[str]:
    """Rollout ids already written to finished shard files (for --resume); reads one column."""
    from .data import open_shards

    if not output_shards(out_dir):
        return set()
    return set(open_shards(out_dir).to_table(columns=["rollout_id"])["rollout_id"].to_pylist())


def _preflight_engines(cfg: RunConfig, *, cluster: bool) -> None:
    """Fail in seconds, with the reason, where the engines could never start (vLLM without a GPU would
    otherwise wait forever for a GPU resource). Local: before Ray starts; a cluster: once joined."""
    if cfg.engine.backend != "vllm":
        return
    from .engines.vllm_backend import cluster_gpu_problem, local_vllm_problem

    problem = cluster_gpu_problem(cfg.engine.count, _engine_num_gpus(cfg)) if cluster else local_vllm_problem()
    if problem:
        raise ValueError(problem)


def _this_run(out_dir: Path, closed: list[dict]) -> tuple[int, int]:
    """(rollouts, sampled tokens) in the files this run wrote."""
    rollouts = tokens = 0
    for f in (f for c in closed for f in c["files"]):
        t = read_table(out_dir / DATA_DIR / f["file"], columns=["segment_index", "completion_tokens"])
        rollouts += t["segment_index"].to_pylist().count(0)
        tokens += sum(t["completion_tokens"].to_pylist())
    return rollouts, tokens


def run(cfg: RunConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run every task's group (skipping, with ``resume``, the groups complete on disk) and return the
    summary written to ``_summary.json``. Raises :class:`RunInterrupted` on SIGINT/SIGTERM after the
    finished groups, the manifest and the summary are on disk."""
    import ray

    from actors.engine import start_engine_actors
    from actors.renderer import start_renderer_actors
    from tito_renderers import create_renderer, load_tokenizer

    from .envs import load_tasks, make_env

    out_dir = Path(cfg.output.dir)
    if out_dir.exists() and output_shards(out_dir) and not resume:
        raise ValueError(f"output directory {out_dir} already holds shards: pass --resume to continue it, "
                         "or choose another output.dir")
    _check_engine_options(cfg.engine.backend, dict(cfg.engine.options))
    if not cfg.ray.address:  # first: a run that cannot start says so in seconds, before any loading
        _preflight_engines(cfg, cluster=False)
    config = cfg.model_dump(mode="json")
    model_path = str(_model_path(cfg.model))
    # the driver parses completions itself (same renderer code and tokenizer as the renderer actors);
    # built first, so a resume is checked against the template hash before anything runs
    parser = create_renderer(load_tokenizer(model_path), name=cfg.renderer.name,
                             thinking_retention=cfg.renderer.thinking_retention, **cfg.renderer.template_kwargs)
    if resume and out_dir.exists() and output_shards(out_dir):
        check_resume(out_dir, config, parser.template_sha256 or "")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = make_env(cfg.env.name, **cfg.env.options)
    if cfg.tasks.path:
        tasks = load_tasks(cfg.tasks.path).tasks[: cfg.tasks.count]
    else:
        tasks = env.generate_tasks(cfg.tasks.count or 8, cfg.tasks.seed)
    skipped, repaired = 0, []
    if resume:
        done, broken = complete_groups(out_dir, cfg.group_size)
        # partial or duplicated groups (written by versions that split groups across files) are
        # removed from their files and run again whole: see rollout/outputs.py
        repaired = sorted(broken)
        drop_groups(out_dir, broken)
        keep = [t for t in tasks if t.task_id not in done]
        skipped = len(tasks) - len(keep)
        tasks = keep

    bar = Progress(len(tasks) * cfg.group_size, enabled=progress)
    bar.note(startup_line(cfg, model_path, len(tasks) * cfg.group_size))
    signals: list[int] = []
    engines: list[Any] = []
    renderer_actors: list[Any] = []
    driver: RolloutDriver | None = None
    rinfo = {"renderer": parser.name, "template_sha256": parser.template_sha256}
    startup_s = wall_s = 0.0
    error: Exception | None = None
    t0 = time.perf_counter()
    with _signals_raise():
        try:
            _init_ray(cfg)
            if cfg.ray.address:
                _preflight_engines(cfg, cluster=True)
            engines = start_engine_actors(_engine_specs(cfg, model_path))
            infos = ray.get([e.start.remote() for e in engines])
            renderer_actors = start_renderer_actors(
                cfg.renderer.actors, model_path, renderer_name=cfg.renderer.name,
                template_kwargs=cfg.renderer.template_kwargs, thinking_retention=cfg.renderer.thinking_retention,
                out_dir=str(out_dir), fmt=cfg.output.format, rows_per_file=cfg.output.rows_per_file,
                flush_interval_s=cfg.output.flush_interval_s, model_name=cfg.model,
            )
            rinfo = ray.get(renderer_actors[0].info.remote())
            startup_s = time.perf_counter() - t0
            bar.note(ready_line(startup_s, len(engines), rinfo))
            bar.start()
            driver = RolloutDriver(cfg, env, engines, renderer_actors, infos[0], parser, on_progress=bar)
            bar.driver = driver
            t1 = time.perf_counter()
            asyncio.run(_drive(driver, tasks, signals))
            wall_s = time.perf_counter() - t1
        except RunInterrupted as exc:  # during start-up, or at the very end
            signals.append(exc.signum)
        except Exception as exc:  # still flush what finished and record it, then re-raise
            error = exc
    with _signals_ignored():
        # flush: every finished group still pending in a renderer goes to a file now
        try:
            closed = ray.get([r.close.remote() for r in renderer_actors]) if renderer_actors else []
        except Exception:
            if error is None:
                raise
            closed = []  # the renderers died with the run: what they wrote is on disk
        bar.finish()
        rollouts, tokens = _this_run(out_dir, closed)
        busy = driver.router.busy_s if driver is not None else [0.0]
        run_info = {
            "rollouts": rollouts, "completion_tokens": tokens, "tasks": len(tasks), "skipped_tasks_resumed": skipped,
            "resumed": resume, "groups_rerun_after_repair": repaired,
            "interrupted": signal.Signals(signals[0]).name if signals else None,
            "reruns_after_engine_death": driver.reruns if driver is not None else 0,
            "wall_s": round(wall_s, 3), "startup_s": round(startup_s, 3),
            # wall time each engine had a request in flight; wall / busy is the orchestration overhead
            "engine_busy_s": [round(b, 3) for b in busy],
            "overhead": round(wall_s / max(max(busy), 1e-9), 3),
            "renderer": rinfo["renderer"], "template_sha256": rinfo["template_sha256"],
        }
        summary = write_outputs(out_dir, config, run_info)
        for actor in engines + renderer_actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
    if error is not None:
        raise error
    if signals:
        raise RunInterrupted(signals[0], summary)
    return summary


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
