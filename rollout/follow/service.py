"""The rollout side of continuous RL: batches sampled while a trainer trains, its weights followed.

:class:`FollowService` runs on a :class:`~rollout.loop.RolloutDriver` (the same engines, renderers and
multi-turn loop as ``tito run``) and loops:

* **admission** — batch k (``follow.groups_per_step`` groups from the task pool) starts only once every
  engine holds a version >= k - 1 - S (S = ``follow.max_off_policy_steps``). Versions only grow, so every
  token any of its rollouts samples, before or after a weight update, meets the bound: nothing is sampled
  to be thrown away. With a trainer that publishes nothing the service seals S + 1 batches and waits.
* **weights** — :class:`~rollout.follow.weights.WeightFollower` polls ``broadcasts/`` for a newer ``step_N`` with ``STABLE``,
  validates it on one engine before anything pauses (a bad checkpoint is one log line and changes nothing),
  holds the driver (``follow.inflight``), loads it into every engine, and releases.
* **sealing** — batch k is sealed after batch k - 1 (the sealed batches are always 1..m): its renderers
  close its shard files, every sampled token on disk is checked against the bound once more, then
  ``_summary.json`` and, last, ``_manifest.json`` are written and a line goes to ``metrics.jsonl``.

A restart on the same RUN_DIR (after SIGKILL, say) removes the unsealed ``step_k`` directories and goes on
at the first unsealed batch; the task pool draws the same groups for the same batch.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from ..config import RunConfig
from ..data import layout
from ..data.outputs import rollout_totals
from ..data.prime_rl import PrimeRLOptions
from ..data.prime_rl import write_step as write_prime_rl_step
from ..data.shards import (
    DATA_DIR,
    SUMMARY,
    ShardWriteError,
    output_shards,
    read_table,
    shard_entries,
    write_json_atomic,
    write_manifest,
    written_checksums,
)
from ..envs.base import Task
from ..handles import BoundedRenderer, EngineHandle, RendererHandle
from ..loop import AllEnginesDied, RolloutDriver, RolloutOutcome, gather_settling
from .eval import Evaluator, held_out_tasks
from .metrics import MetricsSink
from .status import StatusWriter
from .weights import LORA_NAME, WeightFollower  # noqa: F401 - LORA_NAME: what tests and users import here

# the engine backends whose update_weights(keep_running=True) stamps each token's version (follow.inflight keep)
KEEPS_RUNNING = frozenset({"embedded", "replay", "vllm"})


def min_version(k: int, max_off_policy_steps: int) -> int:
    """The oldest version that may sample a token of batch k (the one off-policy rule)."""
    return k - 1 - max_off_policy_steps


class TaskPool:
    """The groups of batch k: the tasks cycled, each pass (epoch) in its own seeded shuffle. The draw depends
    only on (tasks, seed, k), so a restarted service samples the same tasks for the same batch."""

    def __init__(self, tasks: Sequence[Task], seed: int) -> None:
        if not tasks:
            raise ValueError("follow mode needs at least one task")
        self.tasks = list(tasks)
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.tasks)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._orders[epoch] = order
        return self._orders[epoch]

    def draw(self, k: int, groups: int) -> list[tuple[int, Task]]:
        """(global group index, task) for the ``groups`` groups of batch k (k >= 1)."""
        first = (k - 1) * groups
        n = len(self.tasks)
        return [(g, self.tasks[self._order(g // n)[g % n]]) for g in range(first, first + groups)]


def recover(run_dir: Path) -> int:
    """Make RUN_DIR's rollouts a clean prefix of sealed batches and return its last step (0: none). A
    ``step_k`` without its manifest was cut short (a kill, a crash): it is removed, as is anything after
    the first gap, so a trainer never sees a batch that will not be completed."""
    dirs = layout.step_dirs(run_dir)
    last = 0
    while last + 1 in dirs and layout.is_sealed(run_dir, last + 1):
        last += 1
    for k, path in dirs.items():
        if k > last:
            shutil.rmtree(path)
    return last


class FollowService:
    """Batches of rollouts into RUN_DIR/rollouts/step_k/ while weights are followed (see the module doc)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, driver: RolloutDriver, engines: Sequence[EngineHandle],
                 renderers: Sequence[RendererHandle], tasks: Sequence[Task], *, config: dict[str, Any],
                 renderer_info: dict[str, Any], log: Callable[[str], None] | None = None,
                 eval_tasks: Sequence[Task] | None = None, listener: socket.socket | None = None) -> None:
        self.cfg = cfg
        self.follow = cfg.follow
        self.run_dir = Path(run_dir)
        self.driver = driver
        # bounded, as the driver's: a stopped renderer is named (RendererHung) rather than waited on for ever
        self.renderers = [r if isinstance(r, BoundedRenderer) else BoundedRenderer(r, i, cfg.renderer.call_timeout_s)
                          for i, r in enumerate(renderers)]
        self.pool = TaskPool(tasks, cfg.tasks.seed)
        self.config = config
        self.renderer_info = renderer_info
        self.log = log or (lambda line: print(f"tito run --follow: {line}", file=sys.stderr, flush=True))
        if self.follow.weights == "wire":  # the trainer pushes tensors to the routes on follow.listen
            from .wire import WireFollower, bind_listener

            self.weights: WeightFollower = WireFollower(
                self.run_dir, engines, driver, inflight=self.follow.inflight, log=self.log,
                listener=listener if listener is not None else bind_listener(self.follow.listen),
                backend=cfg.engine.weight_transfer, timeout_s=cfg.engine.weight_transfer_timeout_s,
                load_timeout_s=self.follow.load_timeout_s)
        else:
            self.weights = WeightFollower(self.run_dir, engines, driver, inflight=self.follow.inflight,
                                          poll_interval_s=self.follow.poll_interval_s, log=self.log,
                                          keep_broadcasts=self.follow.keep_broadcasts,
                                          load_timeout_s=self.follow.load_timeout_s)
        # a lost engine is named in this log and comes back on the version the others hold
        driver.log = self.log
        driver.healer.bring_up = self.weights.bring_up
        self.first_step = recover(self.run_dir) + 1
        self.sealed = self.first_step - 1
        self._sealed_changed = asyncio.Condition()
        self.t0 = time.time()
        self.status = "starting"
        self._batches: list[asyncio.Task] = []
        # each batch's window (unix times): its admission began (waiting for weights if it must), it was
        # admitted, its last rollout ended; the weight loads in the window are its metrics line's
        self._wait_started: dict[int, float] = {}
        self._admitted_at: dict[int, float] = {}
        self._sampling: set[int] = set()  # batches whose rollouts are running
        self._waiting: tuple[int, int, float] | None = None  # (batch, version it needs, since) at admission
        self._stopping = False
        self.status_writer: StatusWriter | None = None
        self.evaluator: Evaluator | None = None
        if cfg.follow.eval is not None:  # held-out evaluation beside the batches (rollout/follow/eval.py)
            self.evaluator = Evaluator(
                cfg, self.run_dir, driver, eval_tasks if eval_tasks is not None else held_out_tasks(cfg, tasks)[0],
                version=lambda: self.weights.version, changed=self.weights.changed, sealed=lambda: self.sealed,
                close_outputs=lambda out: _close_outputs(self.renderers, out),
                log_metrics=lambda line: self.metrics.log(line), log=self.log)

    @property
    def last_step(self) -> int | None:
        return self.follow.max_steps

    def done(self) -> bool:
        return self.last_step is not None and self.sealed >= self.last_step

    async def run(self) -> int:
        """Seal batches until ``follow.max_steps`` (or until cancelled: a signal). Returns the last sealed step."""
        self._check_inflight()
        if self.done():
            self.log(f"{self.run_dir}: batches 1..{self.sealed} are already sealed (follow.max_steps "
                     f"{self.last_step}): nothing to do")
            return self.sealed
        if self.sealed:
            self.log(f"resuming {self.run_dir} after sealed batch {self.sealed}")
        self.metrics = MetricsSink(self.run_dir, self.config, log=self.log)  # metrics.jsonl (+ W&B if configured)
        self.status_writer = StatusWriter(self.run_dir, self.status_snapshot, interval_s=self.follow.status_interval_s,
                                          stall_after_s=self.follow.stall_after_s)
        self.weights.on_change = self.status_writer.poke
        self.status_writer.start()
        self._wait_started[self.first_step] = time.time()  # the start-up load below is in batch 1's window
        try:
            async with self.driver.healing():
                return await self._run()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError | KeyboardInterrupt):
                self.weights.last_error = {"message": f"{type(exc).__name__}: {exc}", "at": round(time.time(), 3)}
            raise
        finally:
            self._stopping = True
            self.status_writer.close(state="stopped")

    async def _run(self) -> int:
        # a restarted service first loads the trainer's newest weights, so admission sees the real version
        await self.weights.poll_once()
        watcher = asyncio.create_task(self.weights.watch(), name="tito-follow-weights")
        admitter = asyncio.create_task(self._admit_all(), name="tito-follow-admission")
        evaluator = asyncio.create_task(self.evaluator.run(), name="tito-follow-eval") if self.evaluator else None
        side = [t for t in (watcher, evaluator) if t is not None]
        try:
            # until every batch is sealed; the first failure (a full disk, a broken bound) stops the service
            while not (admitter.done() and all(b.done() for b in self._batches)):
                pending = {*side, admitter, *(b for b in self._batches if not b.done())}
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t.exception() is not None:
                        if isinstance(t.exception(), AllEnginesDied):  # (found by a batch, or by a weight load)
                            before = self._batches.index(t) if t in self._batches else len(self._batches)
                            await self._seal_sampled(self._batches[:before])
                        raise t.exception()
            if evaluator is not None:  # the version the last batch was sampled by is evaluated too, when due
                await self._finish_eval(evaluator)
        finally:
            self._stopping = True
            self.status_writer.poke()
            for t in (*side, admitter, *self._batches):
                t.cancel()
            await asyncio.gather(*side, admitter, *self._batches, return_exceptions=True)
            self.metrics.close()
        return self.sealed

    async def _finish_eval(self, evaluator: asyncio.Task) -> None:
        """Wait until the evaluator has no evaluation running nor due (or fails: raised)."""
        def pending() -> bool:
            return self.evaluator.busy or self.evaluator.due(self.weights.version)

        if pending():
            self.log("every batch is sealed: the evaluation of the last version finishes first")
        while pending() and not evaluator.done():
            await asyncio.sleep(0.1)
        if evaluator.done() and evaluator.exception() is not None:
            raise evaluator.exception()

    @staticmethod
    async def _seal_sampled(batches: list[asyncio.Task]) -> None:
        """Every engine died: the batches before the one that found out, whose rollouts all finished, still seal
        (that needs no engine); one still sampling fails at once, and the batches after it cannot seal."""
        for batch in batches:  # in step order: the order they seal in
            await asyncio.wait([batch])
            if batch.exception() is not None:
                return

    def _check_inflight(self) -> None:
        """``follow.inflight: keep`` needs engines that stamp each token with the version that sampled it
        (``update_weights(keep_running=True)``): refused before any work on the others (vLLM)."""
        backend = self.driver.info.backend
        if self.follow.inflight == "keep" and backend not in KEEPS_RUNNING:
            raise ValueError(f"follow.inflight keep: the {backend} engine backend cannot keep turns running across a "
                             "weight update (it does not report which tokens came after the swap); use "
                             "follow.inflight abort_resume or drain")

    async def _admit_all(self) -> None:
        k = self.first_step
        while self.last_step is None or k <= self.last_step:
            self._wait_started.setdefault(k, time.time())
            await self._admit(k)
            self._admitted_at[k] = time.time()
            self._sampling.add(k)
            self._batches.append(asyncio.create_task(self._run_batch(k), name=f"tito-follow-step-{k}"))
            self.status_writer.poke()
            k += 1

    async def _admit(self, k: int) -> None:
        """Wait until batch k may start: every engine holds a version >= k - 1 - S (and batch k - S - 1 ...
        is implied: the trainer publishes version j only after reading batch j)."""
        need = min_version(k, self.follow.max_off_policy_steps)
        if self.weights.version >= need:
            return
        self.status = (f"waiting for weights: batch {k} needs version >= {need}, the engines hold "
                       f"{self.weights.version} (follow.max_off_policy_steps {self.follow.max_off_policy_steps}); "
                       f"{self.sealed} batches sealed")
        self.log(self.status)
        self._waiting = (k, need, time.time())
        self.status_writer.poke()
        try:
            async with self.weights.changed:
                await self.weights.changed.wait_for(lambda: self.weights.version >= need)
        finally:
            self._waiting = None
        self.status = f"batch {k} admitted under version {self.weights.version}"

    async def _run_batch(self, k: int) -> None:
        started = time.time()
        out_dir = layout.step_dir(self.run_dir, k)
        need = min_version(k, self.follow.max_off_policy_steps)
        admitted_at = self.weights.version
        groups = self.pool.draw(k, self.follow.groups_per_step)
        try:
            outcomes = await gather_settling(
                self.driver.run_group(task, g, group_id=f"{task.task_id}@{k}.{j}", out_dir=str(out_dir),
                                      min_version=need)
                for j, (g, task) in enumerate(groups))
        finally:
            self._sampling.discard(k)
        info = self._batch_info(k, [o for group in outcomes for o in group], admitted_at, started)
        self.status_writer.poke()
        async with self._sealed_changed:  # batches seal in order: the sealed ones are always 1..m
            await self._sealed_changed.wait_for(lambda: self.sealed == k - 1)
        files = await _close_outputs(self.renderers, str(out_dir))
        flat = [o for group in outcomes for o in group]
        info.update(version_at_seal=self.weights.version, batch_s=round(time.time() - started, 3))
        line = seal_batch(self.run_dir, k, files=files, outcomes=flat, bound=need, info=info, config=self.config)
        self.metrics.log({**line, **self._totals()})
        async with self._sealed_changed:
            self.sealed = k
            self._sealed_changed.notify_all()
        self.status_writer.poke()
        r = line["reward"]
        self.log(f"batch {k} sealed: {line['samples']} samples ({line['withheld']} withheld), reward mean "
                 f"{r.get('mean', 0.0):.3f}, staleness {line['staleness'] or '-'}, {info['batch_s']:.1f} s")

    def _batch_info(self, k: int, outcomes: list[RolloutOutcome], admitted_version: int,
                    started: float) -> dict[str, Any]:
        """Batch k's own figures, once its rollouts ended: its window, the weight loads in it, its resumed turns.

        The window opens when batch k's admission began (right after batch k - 1 was admitted; the service's
        start for the first) and closes now. A load before k was admitted is one it waited for (``during``
        ``admission``: its version <= the one admitted under), one after is one its rollouts ran through
        (``sampling``). Batches overlap when S >= 1,
        so one load can be listed by two batches; ``total_weight_updates`` counts each once."""
        end = time.time()
        opened = self._wait_started.get(k, started)
        admitted = self._admitted_at.get(k, started)
        # by version, not time: the batch was admitted under the loads up to admitted_version
        updates = [{**r, "during": "admission" if r["version"] <= admitted_version else "sampling"}
                   for r in self.weights.loads if opened <= r["at"] <= end]
        resumed = sum(self.driver.resumed_by_rollout.pop(o.rollout_id, 0) for o in outcomes)
        events = Counter(e["event"] for e in self.driver.healer.events if opened <= e["at"] <= end)
        return {"admitted_at_version": admitted_version, "admission_wait_s": round(admitted - opened, 3),
                "sampling_s": round(end - admitted, 3), "resumed_turns": resumed, "weight_updates": updates,
                "engines_lost": events["lost"], "engines_restarted": events["restarted"]}

    def _totals(self) -> dict[str, Any]:
        """The running totals a metrics line carries beside the batch's own figures (since this service started)."""
        healer = self.driver.healer
        return {"total_elapsed_s": round(time.time() - self.t0, 3), "total_resumed_turns": self.driver.resumed_turns,
                "total_weight_updates": len(self.weights.loads), "total_engines_lost": healer.lost_total,
                "total_engines_restarted": healer.restarted_total}

    def _loss_error(self) -> dict[str, Any] | None:
        loss = self.driver.healer.last_loss
        return None if loss is None else {"message": f"engine {loss['engine']} lost: {loss['cause']}", "at": loss["at"]}

    def status_snapshot(self) -> dict[str, Any]:
        """The service's part of status.json (rollout/follow/status.py). Runs on the status writer's thread:
        it only reads attributes (a set or dict changing size meanwhile raises RuntimeError: the next write)."""
        w, now = self.weights, time.time()
        alive = set(self.driver.router.alive())
        sampling = sorted(self._sampling)
        admitted = sorted(self._admitted_at)
        unsealed = [k for k in admitted if k > self.sealed]
        waiting = self._waiting
        waiting_for = None
        if w.phase is not None and w.phase_of is not None:
            n, since = w.phase_of
            waiting_for = {"what": w.pending_what(n, w.phase), "since": round(since, 3)}
        elif sampling:
            waiting_for = {"what": f"the rollouts of batch {sampling[0]}",
                           "since": round(self._admitted_at.get(sampling[0], now), 3)}
        elif unsealed:
            waiting_for = {"what": f"batch {unsealed[0]} to be sealed", "since": round(now, 3)}
        elif waiting is not None:
            k, need, since = waiting
            waiting_for = {"what": f"weights: batch {k} needs version >= {need}, the engines hold {w.version} "
                                   f"(follow.max_off_policy_steps {self.follow.max_off_policy_steps})",
                           "since": round(since, 3)}
        if self._stopping:
            state = "stopping"
        elif w.phase is not None:
            state = w.phase
        elif unsealed:
            state = "sampling"
        elif waiting is not None:
            state = "waiting_for_weights"
        else:
            state = "starting"
        batch = unsealed[0] if unsealed else waiting[0] if waiting is not None else self.sealed + 1
        return {
            "state": state, "batch": batch, "sealed": self.sealed, "sampling": sampling,
            "next_batch_needs": None if waiting is None else {"batch": waiting[0], "version": waiting[1],
                                                              "since": round(waiting[2], 3)},
            "version": [w.engine_versions[i] if i in alive else None for i in range(len(w.engines))],
            "engines_alive": len(alive), "engines_configured": len(w.engines),
            "engine_states": list(self.driver.healer.state),
            "engines_lost": self.driver.healer.lost_total, "engines_restarted": self.driver.healer.restarted_total,
            "rollouts_done": sum(self.driver.finish_counts.values()),
            "waiting_for": waiting_for, "last_error": _latest(w.last_error, self._loss_error()),
            "run_dir": str(self.run_dir), "argv": list(sys.argv),
            "max_steps": self.last_step, "max_off_policy_steps": self.follow.max_off_policy_steps,
            "weights": self.follow.weights, "weights_url": getattr(w, "listen_url", None),
            # what counts as progress (status.py: progressed_at moves when it changes)
            "progress": (self.sealed, len(admitted), sum(self.driver.finish_counts.values()), w.version),
        }


def _latest(*errors: dict[str, Any] | None) -> dict[str, Any] | None:
    """The most recent of several ``{"message", "at"}`` records."""
    known = [e for e in errors if e is not None]
    return max(known, key=lambda e: e["at"]) if known else None


async def _close_outputs(renderers: Sequence[RendererHandle], out_dir: str) -> list[dict]:
    closed = await asyncio.gather(*(r.close_output(out_dir) for r in renderers))
    errors = [c["write_error"] for c in closed if c.get("write_error")]
    if errors:
        raise ShardWriteError(errors[0])
    return [f for c in closed for f in c["files"]]


def token_versions(out_dir: Path) -> Counter[int]:
    """Sampled tokens per version over a batch's shards (from the per-token ``weight_versions`` column)."""
    counts: Counter[int] = Counter()
    for path in output_shards(out_dir):
        t = read_table(path, columns=["weight_versions"])
        flat = pc.list_flatten(t["weight_versions"])
        flat = pc.filter(flat, pc.greater_equal(flat, 0))
        if len(flat):
            vc = pc.value_counts(flat)
            counts.update({int(v["values"]): int(v["counts"]) for v in vc.to_pylist()})
    return counts


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"min": min(values), "mean": round(statistics.fmean(values), 4), "max": max(values)}


def seal_batch(run_dir: Path, k: int, *, files: list[dict], outcomes: list[RolloutOutcome], bound: int,
               info: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Check batch k's files against the off-policy bound, then write its summary and, last, its manifest
    (which seals it). Returns the batch's metrics line. Raises RuntimeError if a sampled token on disk is
    older than ``bound`` (admission makes that impossible: the check is the safety net the bound promises)."""
    out_dir = layout.step_dir(run_dir, k)
    (out_dir / DATA_DIR).mkdir(parents=True, exist_ok=True)
    entries = shard_entries(out_dir, written_checksums(files))
    shards = [out_dir / e["file"] for e in entries]
    per_version = token_versions(out_dir)
    if per_version and min(per_version) < bound:
        raise RuntimeError(f"batch {k}: {sum(n for v, n in per_version.items() if v < bound)} sampled tokens are "
                           f"from versions older than {bound} (the off-policy bound): not sealed")
    totals = rollout_totals(out_dir)
    written = [o for o in outcomes if o.withheld is None]
    withheld = [{"rollout_id": o.rollout_id, "group_id": o.group_id, "reason": o.withheld, "reward": o.reward,
                 "finish_reason": o.finish_reason}
                for o in outcomes if o.withheld is not None]
    staleness = [k - 1 - o.version_min for o in written if o.version_min is not None]
    tokens = sum(per_version.values())
    follow = {
        "step": k, "min_version": bound, "trains_version": k - 1,
        "tokens_per_version": {str(v): n for v, n in sorted(per_version.items())},
        # (k - 1) - the oldest version of each written rollout: 0 on-policy, at most max_off_policy_steps
        "staleness": dict(sorted(Counter(staleness).items())),
        "token_staleness_mean": round(sum((k - 1 - v) * n for v, n in per_version.items()) / tokens, 4) if tokens else 0.0,
        "withheld": withheld,
        "spanning_versions": sum(o.version_min != o.version_max for o in written),
        **info,
    }
    prime_rl = PrimeRLOptions.of_run(config)
    if prime_rl is not None:  # before the manifest: a sealed batch always has its rank files
        follow["prime_rl"] = write_prime_rl_step(out_dir, shards, env_name=(config.get("env") or {}).get("name", ""),
                                                 options=prime_rl)
    rewards = [o.reward for o in outcomes if o.error is None]
    summary = {**totals, "follow": follow, "group_size": config.get("group_size"), "model": config.get("model"),
               "config": config}
    write_json_atomic(out_dir / SUMMARY, summary)
    write_manifest(out_dir, entries, {"summary": SUMMARY, "model": config.get("model"), "follow": follow,
                                      "group_size": config.get("group_size"), "sampling": config.get("sampling", {}),
                                      "config": config})  # last: its presence seals the batch
    return {"step": k, "rollouts": len(outcomes), "written": len(written), "withheld": len(withheld),
            "samples": totals["rows"], "reward": _stats(rewards), "completion_tokens": totals["completion_tokens"],
            "staleness": follow["staleness"], "token_staleness_mean": follow["token_staleness_mean"],
            "tokens_per_version": follow["tokens_per_version"], "spanning_versions": follow["spanning_versions"],
            "errors": totals["errors"], "env_errors": sum(o.finish_reason == "env_error" for o in outcomes), **info}
