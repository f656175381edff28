"""Engines heal (issue 40 item 3), on a real local Ray with replay engines in synthetic mode: an engine actor
SIGKILLed mid-run, one SIGSTOPped (hung: no heartbeat), and one whose generate never returns (no progress with
requests in flight) are each named in one line, their turns go on token-in on the live engine, Ray restarts
the actor, it is brought up and rejoins (and serves again), and every rollout appears exactly once.

The victim's process is found through its own health report (``pid``), never by name; a stopped process is
continued (or was killed) before the test ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from actors.engine import start_engine_actors  # noqa: E402
from rollout.config import load_config  # noqa: E402
from rollout.data.shards import read_table  # noqa: E402
from rollout.envs import make_env  # noqa: E402
from rollout.handles import LocalRenderer  # noqa: E402
from rollout.loop import RolloutDriver  # noqa: E402
from rollout.renderer_service import RendererService  # noqa: E402

from ._support import init_local_ray, tokenizer_dir  # noqa: E402

VOCAB = 151665  # the Qwen2.5 fixture's vocabulary
FAST = {"synthetic": True, "vocab_size": VOCAB, "max_model_len": 4096, "token_delay_s": 0.01}


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
    init_local_ray(tmp_path_factory, "tito-test-heal")
    yield
    ray.shutdown()


def _config(tmp_path, **over):
    sets = [
        f"model={tokenizer_dir('qwen2.5-7b-instruct')}", "engine.backend=replay", "engine.count=2",
        "env.name=try_again", "group_size=2", "max_turns=3", "max_tokens_per_turn=24",
        "max_tokens_per_rollout=72", f"output.dir={tmp_path / 'out'}", "sampling.seed=7",
        "max_concurrent_rollouts=8", "engine.max_restarts=1", "engine.heartbeat_interval_s=0.25",
        "engine.heartbeat_timeout_s=2", "engine.restart_timeout_s=60",
    ]
    return load_config(None, sets + [f"{k}={v}" for k, v in over.items()])


def _firsts(out_dir) -> list[str]:
    rows = []
    for path in sorted(out_dir.glob("data/train-*")):
        rows += read_table(path).select(["rollout_id", "segment_index"]).to_pylist()
    return [r["rollout_id"] for r in rows if r["segment_index"] == 0]


class Run:
    """A driver over two engine actors (``victim_options`` for engine 0) and one renderer, its log kept."""

    def __init__(self, tmp_path, tasks: int, victim_options: dict | None = None, **over) -> None:
        self.cfg = _config(tmp_path, **{"tasks.count": tasks, **over})
        specs = [{"kind": "replay", "kwargs": dict(victim_options or FAST), "num_cpus": 0, "max_restarts": 1},
                 {"kind": "replay", "kwargs": dict(FAST), "num_cpus": 0, "max_restarts": 1}]
        self.engines = start_engine_actors(specs)
        info = ray.get(self.engines[1].actor.info.remote())
        self.svc = RendererService(self.cfg.model, out_dir=str(tmp_path / "out"), rows_per_file=4)
        env = make_env("try_again")
        self.tasks = env.generate_tasks(tasks, 0)
        self.driver = RolloutDriver(self.cfg, env, self.engines, [LocalRenderer(self.svc)], info, self.svc.renderer)
        self.lines: list[tuple[float, str]] = []
        self.driver.log = lambda line: self.lines.append((time.monotonic(), line))
        self.out = tmp_path / "out"

    def pid(self, i: int) -> int:
        return int(ray.get(self.engines[i].actor.health.remote(), timeout=30)["pid"])

    def run(self, fault):
        async def main():
            job = asyncio.create_task(self.driver.run(self.tasks))
            await fault()
            return await job

        try:
            outcomes = asyncio.run(main())
        finally:
            self.svc.close()
        return outcomes

    def close(self) -> None:
        for e in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(e.actor)

    def line(self, pattern: str) -> tuple[float, str]:
        found = [(t, line) for t, line in self.lines if re.search(pattern, line)]
        assert found, f"no line matches {pattern!r}; lines: {[line for _, line in self.lines]}"
        return found[0]

    def check_exactly_once(self, outcomes) -> None:
        assert len(outcomes) == len(self.tasks) * self.cfg.group_size
        assert all(o.error is None for o in outcomes), [o.error for o in outcomes if o.error]
        firsts = _firsts(self.out)
        assert sorted(firsts) == sorted(o.rollout_id for o in outcomes) and len(set(firsts)) == len(firsts)


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _serves_again(run: Run, i: int) -> None:
    """Wait (while the run goes on) until the restarted engine ``i`` has been sent requests."""
    deadline = time.monotonic() + 60
    while int((await run.engines[i].health())["requests"]) == 0:
        assert time.monotonic() < deadline, f"engine {i} rejoined but was sent nothing"
        await asyncio.sleep(0.1)


def _served_since_restart(run: Run, i: int) -> int:
    """Requests the restarted engine ``i`` (its new incarnation) has served."""
    return int(ray.get(run.engines[i].actor.health.remote(), timeout=30)["requests"])


def test_killed_engine_is_named_its_turns_go_on_and_it_rejoins(tmp_path):
    run = Run(tmp_path, tasks=200)
    victim = run.pid(0)
    try:
        async def kill():
            await _until(lambda: sum(run.driver.finish_counts.values()) >= 4, 60, "rollouts to finish")
            os.kill(victim, signal.SIGKILL)
            await _until(lambda: run.driver.healer.restarted_total == 1, 60, "the engine to rejoin")
            await _serves_again(run, 0)

        outcomes = run.run(kill)
        run.check_exactly_once(outcomes)
        healer = run.driver.healer
        assert (healer.lost_total, healer.restarted_total, healer.state) == (1, 1, ["serving", "serving"])
        _, lost = run.line(r"^engine 0 lost: ")
        assert re.fullmatch(r"engine 0 lost: a call saw its actor die \(\w+\); 1 of 2 engines serving; restarting "
                            r"it \(1 of engine\.max_restarts 1\)", lost) or "its actor died" in lost, lost
        run.line(r"^engine 0 restarted and rejoined with version 0 in [\d.]+ s; 2 of 2 engines serving$")
        assert run.driver.reruns >= 1  # the killed engine's turns went to the live one
        assert run.pid(0) != victim  # a new process
        assert _served_since_restart(run, 0) > 0, "the restarted engine never served again"
    finally:
        run.close()


def test_sigstopped_engine_is_hung_within_the_heartbeat_timeout_killed_and_restarted(tmp_path):
    run = Run(tmp_path, tasks=200)
    victim = run.pid(0)
    stopped_at: list[float] = []
    try:
        async def stop():
            await _until(lambda: sum(run.driver.finish_counts.values()) >= 4, 60, "rollouts to finish")
            os.kill(victim, signal.SIGSTOP)
            stopped_at.append(time.monotonic())
            await _until(lambda: run.driver.healer.restarted_total == 1, 60, "the engine to rejoin")
            await _serves_again(run, 0)

        outcomes = run.run(stop)
        run.check_exactly_once(outcomes)
        at, lost = run.line(r"^engine 0 lost: hung \(no heartbeat within engine\.heartbeat_timeout_s 2\); 1 of 2 "
                            r"engines serving; restarting it")
        # timeout 2 s + one probe interval (0.25 s), with slack for a loaded machine
        assert at - stopped_at[0] < 2 + 0.25 + 3, f"detected {at - stopped_at[0]:.1f} s after SIGSTOP"
        run.line(r"^engine 0 restarted and rejoined with version 0")
        assert run.pid(0) != victim
        assert _served_since_restart(run, 0) > 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
        run.close()


def test_generate_that_never_returns_is_hung_and_an_engine_out_of_restarts_stays_lost(tmp_path):
    """Engine 0 answers its heartbeat but never finishes a token (a 1000 s token delay): no progress with requests
    in flight for heartbeat_timeout_s is a hang. Restarted with the same options it hangs again, and with its one
    restart used it stays lost: one line says so, and the run completes on engine 1."""
    stuck = {**FAST, "token_delay_s": 1000.0}
    run = Run(tmp_path, tasks=80, victim_options=stuck)
    try:
        async def nothing():
            await _until(lambda: run.driver.healer.state[0] == "lost", 60, "the second hang")

        t0 = time.monotonic()
        outcomes = run.run(nothing)
        run.check_exactly_once(outcomes)
        at, first = run.line(r"^engine 0 lost: hung \(\d+ requests in flight and no progress for \d+ s "
                             r"\(engine\.heartbeat_timeout_s 2\)\); 1 of 2 engines serving; restarting it")
        assert at - t0 < 30
        run.line(r"^engine 0 restarted and rejoined")
        run.line(r"^engine 0 lost: hung .*; not restarted \(its engine\.max_restarts 1 used\)$")
        healer = run.driver.healer
        assert (healer.lost_total, healer.restarted_total, healer.state) == (2, 1, ["lost", "serving"])
    finally:
        run.close()


def test_follow_mode_restarted_engine_rejoins_on_the_version_the_others_hold(tmp_path):
    """``tito run --follow``'s service on two replay actors, the trainer's version 1 published at start: engine 0
    SIGKILLed after batch 1 is restarted, loads version 1 (its fresh incarnation holds version 0) before it takes
    a request, and status.json and metrics.jsonl count the loss and the restart (the batch's own and in total)."""
    import json

    import torch

    from rollout.data import layout
    from rollout.follow.publish import publish_weights
    from rollout.follow.service import FollowService
    from rollout.follow.status import read_status

    run_dir = tmp_path / "run"
    run = Run(tmp_path, tasks=16, **{"follow.groups_per_step": 4, "follow.max_steps": 6, "follow.max_off_policy_steps": 8,
                                     "follow.poll_interval_s": 0.05, "follow.status_interval_s": 0.2})
    publish_weights(run_dir, 1, {"w": torch.ones(4)}, config={"model_type": "none"})
    service = FollowService(run.cfg, run_dir, run.driver, run.engines, run.driver.renderers, run.tasks,
                            config=run.cfg.model_dump(mode="json"), renderer_info=run.svc.info(),
                            log=lambda line: run.lines.append((time.monotonic(), line)))
    victim = run.pid(0)
    statuses: list[dict] = []

    async def main():
        job = asyncio.create_task(service.run())
        await _until(lambda: service.sealed >= 1, 60, "batch 1 to seal")
        os.kill(victim, signal.SIGKILL)
        await _until(lambda: run.driver.healer.restarted_total == 1 or job.done(), 60, "the engine to rejoin")
        await asyncio.sleep(0.5)  # a status write after the rejoin
        statuses.append(read_status(run_dir))
        return await job

    try:
        assert asyncio.run(main()) == 6
        run.svc.close()
        run.line(r"^engine 0 lost: .*; 1 of 2 engines serving; restarting it")
        run.line(r"^engine 0 restarted and rejoined with version 1 in [\d.]+ s; 2 of 2 engines serving$")
        health = ray.get(run.engines[0].actor.health.remote())
        assert health["pid"] != victim and health["weight_version"] == 1 and not health["fenced"]
        status = statuses[0]
        assert (status["engines_lost"], status["engines_restarted"], status["engines_alive"],
                status["engine_states"], status["version"]) == (1, 1, 2, ["serving", "serving"], [1, 1]), status
        assert status["last_error"]["message"].startswith("engine 0 lost: ")
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
        assert sum(m["engines_lost"] for m in lines) >= 1 and sum(m["engines_restarted"] for m in lines) >= 1
        assert lines[0]["engines_lost"] == 0  # batch 1 sealed before the kill
        assert (lines[-1]["total_engines_lost"], lines[-1]["total_engines_restarted"]) == (1, 1)
        assert all(layout.is_sealed(run_dir, k) for k in range(1, 7))
    finally:
        run.close()
