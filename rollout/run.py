"""``tito run CONFIG``: Ray, engine actors, renderer actors, the rollout driver, shards and a summary."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .config import RunConfig
from .loop import RolloutDriver
from .progress import Progress, ready_line, startup_line
from .shards import write_manifest


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


def _engine_specs(cfg: RunConfig, model_path: str) -> list[dict[str, Any]]:
    options = dict(cfg.engine.options)
    if cfg.engine.backend in ("embedded", "vllm"):
        options.setdefault("model", model_path)
    return [{"kind": cfg.engine.backend, "kwargs": options, "max_concurrency": cfg.engine.max_concurrency,
             "replicas": cfg.engine.count, "num_cpus": cfg.engine.num_cpus, "num_gpus": cfg.engine.num_gpus}]


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

    if not any(out_dir.glob("shard-*")):
        return set()
    return set(open_shards(out_dir).to_table(columns=["rollout_id"])["rollout_id"].to_pylist())


def run(cfg: RunConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    import ray

    from actors.engine import start_engine_actors
    from actors.renderer import start_renderer_actors
    from renderers import create_renderer, load_tokenizer

    from .envs import load_tasks, make_env

    out_dir = Path(cfg.output.dir)
    if out_dir.exists() and any(out_dir.glob("shard-*")) and not resume:
        raise ValueError(f"output directory {out_dir} already holds shards: pass --resume to continue it, "
                         "or choose another output.dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = str(_model_path(cfg.model))
    env = make_env(cfg.env.name, **cfg.env.options)
    if cfg.tasks.path:
        tasks = load_tasks(cfg.tasks.path).tasks[: cfg.tasks.count]
    else:
        tasks = env.generate_tasks(cfg.tasks.count or 8, cfg.tasks.seed)
    skipped = 0
    if resume:
        done = done_rollouts(out_dir)
        keep = [t for t in tasks if not all(f"{t.task_id}#{k}" in done for k in range(cfg.group_size))]
        skipped = len(tasks) - len(keep)
        tasks = keep

    bar = Progress(len(tasks) * cfg.group_size, enabled=progress)
    bar.note(startup_line(cfg, model_path, len(tasks) * cfg.group_size))
    _init_ray(cfg)
    t0 = time.perf_counter()
    engines = start_engine_actors(_engine_specs(cfg, model_path))
    infos = ray.get([e.start.remote() for e in engines])
    renderer_actors = start_renderer_actors(
        cfg.renderer.actors, model_path, renderer_name=cfg.renderer.name, template_kwargs=cfg.renderer.template_kwargs,
        thinking_retention=cfg.renderer.thinking_retention, out_dir=str(out_dir), fmt=cfg.output.format,
        rows_per_file=cfg.output.rows_per_file, model_name=cfg.model,
    )
    rinfo = ray.get(renderer_actors[0].info.remote())
    # the driver parses completions itself (same renderer code and tokenizer as the renderer actors)
    parser = create_renderer(load_tokenizer(model_path), name=cfg.renderer.name,
                             thinking_retention=cfg.renderer.thinking_retention, **cfg.renderer.template_kwargs)
    startup_s = time.perf_counter() - t0
    bar.note(ready_line(startup_s, len(engines), rinfo))
    bar.start()
    driver = RolloutDriver(cfg, env, engines, renderer_actors, infos[0], parser, on_progress=bar)
    bar.driver = driver
    t1 = time.perf_counter()
    outcomes = asyncio.run(driver.run(tasks))
    wall_s = time.perf_counter() - t1
    closed = ray.get([r.close.remote() for r in renderer_actors])
    bar.finish()
    files = [f for c in closed for f in c["files"]]
    previous = json.loads((out_dir / "manifest.json").read_text())["files"] if resume and (out_dir / "manifest.json").exists() else []
    break_counts: dict[str, int] = {}
    for c in closed:
        for k, v in c["break_counts"].items():
            break_counts[k] = break_counts.get(k, 0) + v
    turns = sum(o.turns for o in outcomes)
    summary = {
        "rollouts": len(outcomes), "tasks": len(tasks), "skipped_tasks_resumed": skipped,
        "group_size": cfg.group_size, "turns": turns,
        "completion_tokens": sum(o.completion_tokens for o in outcomes),
        "mean_reward": (sum(o.reward for o in outcomes) / len(outcomes)) if outcomes else 0.0,
        "errors": sum(o.error is not None for o in outcomes),
        "finish_reasons": dict(driver.finish_counts), "breaks": break_counts,
        "break_rate": (sum(break_counts.values()) / turns) if turns else 0.0,
        "reruns_after_engine_death": driver.reruns,
        "wall_s": round(wall_s, 3), "startup_s": round(startup_s, 3),
        # wall time each engine had a request in flight; wall / busy is the orchestration overhead
        "engine_busy_s": [round(b, 3) for b in driver.router.busy_s],
        "overhead": round(wall_s / max(max(driver.router.busy_s), 1e-9), 3),
        "renderer": rinfo["renderer"], "template_sha256": rinfo["template_sha256"],
        "model": cfg.model, "engine": cfg.engine.backend,
    }
    write_manifest(out_dir, previous + files, {"summary": "summary.json"})
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    for actor in engines + renderer_actors:
        ray.kill(actor)
    return summary


def print_summary(summary: dict[str, Any], out=sys.stdout) -> None:
    rows = [
        ("rollouts", f"{summary['rollouts']} ({summary['tasks']} tasks x {summary['group_size']})"),
        ("turns", summary["turns"]),
        ("sampled tokens", summary["completion_tokens"]),
        ("tokens/s", f"{summary['completion_tokens'] / max(summary['wall_s'], 1e-9):,.1f}"),
        ("mean reward", f"{summary['mean_reward']:.3f}"),
        ("finish reasons", ", ".join(f"{k} {v}" for k, v in sorted(summary["finish_reasons"].items())) or "-"),
        ("breaks", ", ".join(f"{k} {v}" for k, v in sorted(summary["breaks"].items())) or "none"),
        ("break rate (per turn)", f"{summary['break_rate']:.3f}"),
        ("errors", summary["errors"]),
        ("wall time", f"{summary['wall_s']:.1f} s (+{summary['startup_s']:.1f} s start-up)"),
        ("renderer", f"{summary['renderer']} ({(summary['template_sha256'] or '')[:16]})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)
