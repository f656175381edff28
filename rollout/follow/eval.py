"""Held-out evaluation while ``tito run --follow`` trains (``follow.eval``).

Version 0 is evaluated first, then each version that reaches the next multiple of ``eval.every`` (a version that
skips past one is evaluated under its own number). An evaluation is a set of groups like a batch's, but of
held-out tasks (``eval.tasks``; any that is also in the training pool is dropped), with ``eval.env``,
``eval.sampling`` and ``eval.group_size`` (each the run's unless given). It runs beside the training batches on the
same engines: it never holds a batch back nor changes the off-policy rule, and a weight update that comes during
it is handled as for any rollout (``follow.inflight``). Only rollouts sampled wholly by the evaluated version count
in its figures; the others are counted as ``spanned``.

Results: ``RUN_DIR/evals/step_N/`` (N the version; shards as a batch's, ``_summary.json``, ``_manifest.json``
last) and one metrics.jsonl line ``{"kind": "eval", "step": <batches sealed>, "eval_version": N, "eval": {...}}``
(W&B: ``eval/accuracy``, ``eval/reward_mean``, ``eval/pass@k``, ...). An evaluation left without its manifest
by a stop is removed and run again at the next start if the engines still hold its version.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..data.shards import (
    DATA_DIR,
    SUMMARY,
    read_manifest,
    shard_entries,
    write_json_atomic,
    write_manifest,
    written_checksums,
)
from ..envs import load_tasks, make_env
from ..envs.base import Task
from ..envs.guard import GuardedEnv
from ..loop import GroupPlan, RolloutDriver, RolloutOutcome, gather_settling

EVALS = "evals"


def eval_dir(run_dir: Path, version: int) -> Path:
    return Path(run_dir) / EVALS / f"step_{version}"


def held_out_tasks(cfg: RunConfig, train: Sequence[Task]) -> tuple[list[Task], int]:
    """The eval tasks (environment, ids unique) and how many were dropped for being in the training pool."""
    e = cfg.follow.eval
    env_cfg = e.env or cfg.env
    if e.tasks.path:
        tasks = load_tasks(e.tasks.path).tasks[: e.tasks.count]
    else:
        seed = e.tasks.seed if e.tasks.seed is not None else cfg.tasks.seed + 1
        tasks = make_env(env_cfg.name, **env_cfg.options).generate_tasks(e.tasks.count, seed)
    seen = {json.dumps(t.messages, sort_keys=True) for t in train}
    kept = [t for t in tasks if json.dumps(t.messages, sort_keys=True) not in seen]
    if not kept:
        raise ValueError(f"follow.eval: all {len(tasks)} eval tasks are also in the training pool; give "
                         "follow.eval.tasks another seed or a task file")
    if len({t.task_id for t in kept}) != len(kept):
        raise ValueError("follow.eval: eval task ids repeat; each group needs its own id")
    return kept, len(tasks) - len(kept)


def figures(outcomes: Sequence[Sequence[RolloutOutcome]], version: int, correct_at: float) -> dict[str, Any]:
    """An evaluation's figures over the rollouts sampled wholly by ``version`` (per group: one task)."""
    pure = [[o for o in group if o.error is None and o.version_min in (None, version) and
             o.version_max in (None, version)] for group in outcomes]
    flat = [o for group in pure for o in group]
    every = [o for group in outcomes for o in group]
    k = max((len(g) for g in outcomes), default=0)
    rewards = [o.reward for o in flat]
    scored_tasks = [g for g in pure if g]
    return {
        "version": version, "tasks": len(outcomes), "rollouts": len(every), "counted": len(flat),
        "spanned": sum(o.error is None for o in every) - len(flat), "errors": sum(o.error is not None for o in every),
        "accuracy": round(sum(r >= correct_at for r in rewards) / len(rewards), 4) if rewards else None,
        "reward_mean": round(sum(rewards) / len(rewards), 4) if rewards else None,
        f"pass@{k}": round(sum(any(o.reward >= correct_at for o in g) for g in scored_tasks) / len(scored_tasks), 4)
        if scored_tasks else None,
    }


class Evaluator:
    """Runs the evaluations of a follow service (see the module doc); ``run`` until cancelled."""

    def __init__(self, cfg: RunConfig, run_dir: Path, driver: RolloutDriver, tasks: Sequence[Task], *,
                 version: Callable[[], int], changed: asyncio.Condition, sealed: Callable[[], int],
                 close_outputs: Callable[[str], Any], log_metrics: Callable[[dict], None],
                 log: Callable[[str], None]) -> None:
        e = cfg.follow.eval
        assert e is not None
        self.cfg, self.eval, self.run_dir, self.driver = cfg, e, Path(run_dir), driver
        self.tasks = list(tasks)
        guarded = driver.guarded if e.env is None else GuardedEnv(
            make_env(e.env.name, **e.env.options), name=e.env.name, timeout_s=e.env.timeout_s,
            max_message_chars=e.env.max_message_chars)
        self.plan = GroupPlan(guarded, e.group_size, e.sampling or cfg.sampling)
        self.version, self.changed, self.sealed = version, changed, sealed
        self.close_outputs, self.log_metrics, self.log = close_outputs, log_metrics, log
        self.busy = False  # an evaluation is running
        self.done: dict[int, dict] = {}

    def _recover(self) -> None:
        for path in sorted((self.run_dir / EVALS).glob("step_*")):
            manifest = read_manifest(path)
            if manifest is None:  # stopped before it sealed: nothing of it counts
                shutil.rmtree(path, ignore_errors=True)
            elif isinstance(manifest.get("eval"), dict):
                self.done[int(manifest["eval"]["version"])] = manifest["eval"]

    def due(self, v: int) -> bool:
        if v in self.done:
            return False
        last = max(self.done, default=None)
        return last is None or v // self.eval.every > last // self.eval.every

    async def run(self) -> None:
        self._recover()
        while True:
            v = self.version()
            if self.due(v):
                self.busy = True
                try:
                    await self.evaluate(v)
                finally:
                    self.busy = False
            async with self.changed:
                await self.changed.wait_for(lambda v=v: self.version() != v)

    async def evaluate(self, v: int) -> dict[str, Any]:
        out = eval_dir(self.run_dir, v)
        shutil.rmtree(out, ignore_errors=True)
        (out / DATA_DIR).mkdir(parents=True)
        t0 = time.time()
        self.log(f"eval of version {v}: {len(self.tasks)} tasks x {self.plan.group_size} started")
        outcomes = await gather_settling(
            self.driver.run_group(task, i, group_id=f"eval{v}/{task.task_id}", out_dir=str(out), plan=self.plan)
            for i, task in enumerate(self.tasks))
        entries = shard_entries(out, written_checksums(await self.close_outputs(str(out))))
        result = {**figures(outcomes, v, self.eval.correct_at), "eval_s": round(time.time() - t0, 3)}
        write_json_atomic(out / SUMMARY, {"eval": result, "config": self.cfg.model_dump(mode="json")})
        write_manifest(out, entries, {"summary": SUMMARY, "eval": result})  # last: it seals the evaluation
        self.done[v] = result
        self.log_metrics({"kind": "eval", "step": self.sealed(), "eval_version": v, "eval": result})
        k = next(key for key in result if key.startswith("pass@"))
        acc = "-" if result["accuracy"] is None else f"{result['accuracy']:.3f}"
        self.log(f"eval of version {v}: accuracy {acc} over {result['counted']} rollouts ({result['spanned']} "
                 f"spanned an update), {k} {result[k]}, {result['eval_s']:.1f} s")
        return result
