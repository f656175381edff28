"""``tito run CONFIG``: Ray, engine actors, renderer actors, the rollout driver, shards and a summary."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .config import RunConfig
from .loop import RolloutDriver, RolloutOutcome
from .outputs import check_resume, complete_groups, drop_groups, remove_temporaries, write_failure, write_outputs
from .progress import Progress, ready_line, startup_line
from .shards import DATA_DIR, ShardWriteError, output_shards, read_table, write_error_of


class RunInterrupted(Exception):
    """SIGINT/SIGTERM stopped ``tito run``: finished groups are on disk and the manifest and summary
    cover them (``summary``, once written). ``cmd_run`` prints one line and exits 128 + signal."""

    def __init__(self, signum: int, summary: dict[str, Any] | None = None) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum, self.summary = signum, summary


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The first SIGINT/SIGTERM a run got. Only that one stops it: a later one (Ctrl-C pressed twice, a
# supervisor repeating SIGTERM) is ignored, so it cannot cut short the flush, the summary or Ray's shutdown.
_first_signal: list[int] = []


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()  # signal handlers are set only there


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
    if not _main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is not _raise_first_signal:  # the outermost: a new run
        _first_signal.clear()
    old = {s: signal.signal(s, _raise_first_signal) for s in _STOP_SIGNALS}
    ended = False
    try:
        yield
        ended = True
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_IGN if ignore_after and ended else h)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """While Ray starts its processes: a SIGINT/SIGTERM is noted and raised as :class:`RunInterrupted` only
    once ``ray.init`` has returned. Cut short half-way, ``ray.init`` leaves the processes it already started
    running without a driver (for minutes); whole, Ray's shutdown stops every one of them. Ray's own
    SIGTERM handler (``sys.exit`` mid-start, exit status 15) is not installed for the same reason."""
    if not _main_thread():
        yield
        return
    import ray._private.utils as ray_utils  # Ray's hook for its driver SIGTERM handler

    noted: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: noted.append(signum)) for s in _STOP_SIGNALS}
    ray_sets_handler = getattr(ray_utils, "set_sigterm_handler", None)
    if ray_sets_handler is not None:
        ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        if ray_sets_handler is not None:
            ray_utils.set_sigterm_handler = ray_sets_handler
        for s, h in old.items():
            signal.signal(s, h)
    if noted and not _first_signal:
        _first_signal.append(noted[0])
        raise RunInterrupted(noted[0])


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """While finished groups are flushed after a signal, and Ray shuts down: a second Ctrl-C must not cut
    them short."""
    if not _main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in _STOP_SIGNALS}
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
        if not signals and not _first_signal:
            _first_signal.append(signum)
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


def _init_ray(cfg: RunConfig, *, defer_signals: bool = False) -> None:
    """Start a local Ray or join ``cfg.ray.address``; ``defer_signals`` (``tito run``): see
    :func:`_signals_deferred`."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    with _signals_deferred() if defer_signals else contextlib.nullcontext():
        if cfg.ray.address:
            ray.init(address=cfg.ray.address, log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=_local_ray_cpus(cfg), include_dashboard=False, log_to_driver=False)


def shutdown_ray() -> None:
    """Stop the Ray this process started (or leave the cluster it joined), with SIGINT/SIGTERM ignored
    meanwhile: ``cmd_run`` calls it once the run is over, so Ray is not left to an exit hook that a second
    Ctrl-C would interrupt with a traceback."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        with _signals_ignored():
            ray.shutdown()


def _check_engine_options(backend: str, options: dict[str, Any]) -> None:
    """Refuse options the backend's constructor does not take, naming them and the ones it does, before any
    engine starts (an actor would otherwise fail with a TypeError deep in its start-up)."""
    import inspect

    from .engines.factory import backend_class

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


def _engine_specs(cfg: RunConfig, model_path: str, num_cpus: float | None = None) -> list[dict[str, Any]]:
    """The engine actors' specs (the options checked first with :func:`_check_engine_options`); ``num_cpus``
    replaces the config's CPUs per engine (see :func:`_fit_cpus`)."""
    options = dict(cfg.engine.options)
    if cfg.engine.backend == "embedded":
        options.setdefault("model", model_path)
    elif cfg.engine.backend == "vllm":
        from .models import model_dir

        # vLLM loads a safetensors directory: a GGUF (the default model) is converted once into the cache
        options.setdefault("model", str(model_dir(model_path)))
    return [{"kind": cfg.engine.backend, "kwargs": options, "max_concurrency": cfg.engine.max_concurrency,
             "replicas": cfg.engine.count, "num_cpus": cfg.engine.num_cpus if num_cpus is None else num_cpus,
             "num_gpus": _engine_num_gpus(cfg), "placement": cfg.engine.placement, "custom_resources": dict(cfg.engine.resources)}]


def _model_path(name: str) -> Path:
    """The model's file or directory; an alias that is not here yet is fetched first (the demo's first run)."""
    from .models import ALIASES, ModelNotFound, pull_model, resolve_model

    try:
        return resolve_model(name)
    except ModelNotFound:
        if name not in ALIASES:
            raise
        return pull_model(name)


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


def _check_output_dir(out_dir: Path) -> None:
    """Refuse, before anything runs, an output directory the run could not create or write: the path of a
    file, a path under a file, a place nobody can write (``/proc``, a read-only mount, an immutable
    directory). A probe file is created and removed where the run's first file or directory will go
    (the directory itself, its ``data/``, or the nearest existing parent); nothing else is written."""
    where = f"output.dir {out_dir}"
    probe_in = out_dir
    try:
        while not probe_in.exists() and probe_in != probe_in.parent:
            probe_in = probe_in.parent
    except OSError as exc:  # e.g. a parent that cannot be searched
        raise ValueError(f"{where}: cannot look at {probe_in}: {exc.strerror}") from None
    if not probe_in.is_dir():
        what = "is a file" if probe_in == out_dir else f"is under {probe_in}, a file"
        raise ValueError(f"{where}: {what}, not a directory; choose another output.dir (--out)")
    targets = [probe_in] + [out_dir / DATA_DIR] * (out_dir / DATA_DIR).is_dir()
    for directory in targets:
        try:
            before = directory.stat()
            fd, probe = tempfile.mkstemp(prefix=".tito-write-probe-", dir=directory)
            os.close(fd)
            os.unlink(probe)
            # the directory's times as they were: a run refused later (a resume with another config) changed nothing
            os.utime(directory, ns=(before.st_atime_ns, before.st_mtime_ns))
        except OSError as exc:
            raise ValueError(f"{where}: cannot write in {directory}: {exc.strerror}; choose another output.dir "
                             "(--out)") from None


# Ray places an actor only where its CPUs are free; quantities below 1 go in steps of 1/10000
_RAY_CPU_STEP = 1e-4
# joining a cluster (--address), how long nodes may take to join before a run that cannot be placed stops
CLUSTER_CPU_WAIT_S = 60.0


def _default_engine_cpus(cfg: RunConfig) -> float:
    from .engines.factory import DEFAULT_RESOURCES

    return DEFAULT_RESOURCES[cfg.engine.backend]["num_cpus"]


def _cpus_needed(cfg: RunConfig, engine_cpus: float) -> tuple[float, str]:
    """The CPUs every actor of the run holds, and how they add up (for messages)."""
    n, r, r_cpus = cfg.engine.count, cfg.renderer.actors, cfg.renderer.num_cpus
    need = n * engine_cpus + r * r_cpus
    return need, f"{n} engine actor(s) x {engine_cpus:g} + {r} renderer actor(s) x {r_cpus:g} = {need:g} CPUs"


def _local_ray_cpus(cfg: RunConfig) -> int:
    return cfg.ray.num_cpus or os.cpu_count() or 1


def _fit_cpus(cfg: RunConfig, available: float) -> tuple[float | None, str | None]:
    """CPUs per engine actor such that every actor can be placed on ``available`` Ray CPUs (a local Ray):
    ``(None, None)`` where the config's already fit. Where ``engine.num_cpus`` is unset, the engines share
    what the renderer actors leave, in equal parts (``(share, a note saying so)``); otherwise, or where no
    share is left, a ValueError with the numbers and what to set. Without this Ray never places the actors
    it has no CPUs for, and the run waits forever at 0 rollouts."""
    per_engine = cfg.engine.num_cpus if cfg.engine.num_cpus is not None else _default_engine_cpus(cfg)
    need, sums = _cpus_needed(cfg, per_engine)
    if need <= available + _RAY_CPU_STEP / 2:
        return None, None
    left = available - cfg.renderer.actors * cfg.renderer.num_cpus
    share = min(int(left / cfg.engine.count / _RAY_CPU_STEP) * _RAY_CPU_STEP, per_engine)
    if cfg.engine.num_cpus is None and share > 0:
        return share, (f"the actors would need {sums} and the local Ray has {available:g}: each engine actor "
                       f"takes {share:g} CPU (set engine.num_cpus or ray.num_cpus to choose)")
    fix = (f"--set engine.num_cpus={share:g}" if share > 0 else
           f"fewer renderer actors or a smaller renderer.num_cpus (the renderers alone need "
           f"{cfg.renderer.actors * cfg.renderer.num_cpus:g})")
    raise ValueError(f"the actors need {sums} but the local Ray has {available:g} CPUs (ray.num_cpus, default: "
                     f"this machine's): they would wait forever; use {fix}, or raise ray.num_cpus")


def _wait_for_cluster_cpus(cfg: RunConfig, engine_cpus: float | None, note: Any) -> None:
    """Joined to a cluster (or a Ray started before the run): wait up to :data:`CLUSTER_CPU_WAIT_S` for its
    CPUs to hold every actor (nodes may still be joining), then stop with the numbers. A total that suffices
    can still fail to place an actor whose CPUs no single node has free; that is Ray's to report."""
    import ray

    need, sums = _cpus_needed(cfg, engine_cpus if engine_cpus is not None else _default_engine_cpus(cfg))
    deadline = time.monotonic() + (CLUSTER_CPU_WAIT_S if cfg.ray.address else 0.0)
    while (have := ray.cluster_resources().get("CPU", 0.0)) < need - _RAY_CPU_STEP / 2:
        if time.monotonic() >= deadline:
            waited = f" after waiting {CLUSTER_CPU_WAIT_S:g} s for nodes" if cfg.ray.address else ""
            raise ValueError(f"the actors need {sums} but the Ray cluster has {have:g} CPUs{waited}: add nodes, "
                             "or lower engine.num_cpus, renderer.num_cpus, engine.count or renderer.actors")
        if note is not None:
            note(f"waiting for the cluster's CPUs: {have:g} of the {need:g} the actors need ({sums})")
            note = None
        time.sleep(1.0)


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
    _check_output_dir(out_dir)
    _check_engine_options(cfg.engine.backend, dict(cfg.engine.options))
    engine_cpus, cpu_note = None, None
    local_ray = not cfg.ray.address and not ray.is_initialized()
    if not cfg.ray.address:  # first: a run that cannot start says so in seconds, before any loading
        _preflight_engines(cfg, cluster=False)
    if local_ray:
        engine_cpus, cpu_note = _fit_cpus(cfg, _local_ray_cpus(cfg))
    env = make_env(cfg.env.name, **cfg.env.options)
    if cfg.tasks.path:  # a bad or repeated row is named (file and line) before the model is loaded
        tasks = load_tasks(cfg.tasks.path).tasks[: cfg.tasks.count]
    else:
        tasks = env.generate_tasks(cfg.tasks.count or 8, cfg.tasks.seed)
        _check_unique_ids(tasks, cfg.env.name)
    config = cfg.model_dump(mode="json")
    model_path = str(_model_path(cfg.model))
    # the driver parses completions itself (same renderer code and tokenizer as the renderer actors);
    # built first, so a resume is checked against the template hash before anything runs
    parser = create_renderer(load_tokenizer(model_path), name=cfg.renderer.name,
                             thinking_retention=cfg.renderer.thinking_retention, **cfg.renderer.template_kwargs)
    if resume and out_dir.exists() and output_shards(out_dir):
        check_resume(out_dir, config, parser.template_sha256 or "")
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_temporaries(out_dir)  # what a failed or killed run left half-written: never a complete file
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
    bar.watch(out_dir / DATA_DIR)  # counts the rollouts written to disk, beside those finished
    bar.note(startup_line(cfg, model_path, len(tasks) * cfg.group_size))
    if cpu_note:
        bar.note(cpu_note)
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
            _init_ray(cfg, defer_signals=True)
            if cfg.ray.address:
                _preflight_engines(cfg, cluster=True)
            if not local_ray:
                _wait_for_cluster_cpus(cfg, engine_cpus, bar.note)
            engines = start_engine_actors(_engine_specs(cfg, model_path, engine_cpus))
            infos = ray.get([e.start.remote() for e in engines])
            renderer_actors = start_renderer_actors(
                cfg.renderer.actors, model_path, num_cpus=cfg.renderer.num_cpus, resources=dict(cfg.renderer.resources),
                renderer_name=cfg.renderer.name, template_kwargs=cfg.renderer.template_kwargs,
                thinking_retention=cfg.renderer.thinking_retention,
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
            error = write_error_of(exc) or exc  # a failed shard write: its own one-line message
    with _signals_ignored():
        # flush: every finished group still pending in a renderer goes to a file now
        try:
            closed = ray.get([r.close.remote() for r in renderer_actors]) if renderer_actors else []
        except Exception:
            if error is None:
                raise
            closed = []  # the renderers died with the run: what they wrote is on disk
        failed_writes = [c["write_error"] for c in closed if c.get("write_error")]
        if error is None and failed_writes:  # e.g. the last timed flush hit a full disk
            error = ShardWriteError(failed_writes[0])
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
        try:
            summary = write_outputs(out_dir, config, run_info, [f for c in closed for f in c["files"]])
        except ShardWriteError as exc:
            if not isinstance(error, ShardWriteError):
                raise
            summary, error = None, write_failure(error, out_dir, manifest_error=exc)
        else:
            if isinstance(error, ShardWriteError):
                error = write_failure(error, out_dir, summary=summary)
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
