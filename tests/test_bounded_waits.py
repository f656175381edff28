"""Every wait is bounded and says what it waits for (issue 40 item 6), with real processes on a real Ray:
``tito run --follow`` over a replay engine whose renderer actor is SIGSTOPped stops within
``renderer.call_timeout_s`` in one line naming the renderer (exit 4), every sealed batch intact and nothing
unsealed left; ``tito run`` the same. A stopped trainer is a stall ``tito status`` names with what the service
waits for, a stopped service is a stale status.json ``tito status`` names with the pid's state. A stopped
engine is tests/test_engine_heal.py's; a load or validation that never returns, tests/test_follow_faults.py's.

Processes are found by this test's private RAY_TMPDIR (tests/_support.py ``ray_session_pids``); a stopped one is
continued, and the session's processes are killed by pid at the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from rollout.data import layout, read_step

from ._support import REPO, AwakeClock, ray_session_pids, sigint_default, tokenizer_dir
from .test_follow_cli import _kill_session
from .test_run_failfast import ray_tmp  # noqa: F401 - the fixture

ENV = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
VOCAB = 151665
pytestmark = pytest.mark.slow


def _config(tmp_path, **extra) -> str:
    cfg = {
        "model": str(tokenizer_dir("qwen2.5-7b-instruct")),
        "engine": {"backend": "replay", "num_cpus": 0,
                   "options": {"synthetic": True, "vocab_size": VOCAB, "max_model_len": 4096, "token_delay_s": 0.01}},
        "renderer": {"num_cpus": 0, "call_timeout_s": 3},
        "env": {"name": "arithmetic", "options": {"difficulty": 1}}, "tasks": {"count": 8, "seed": 1},
        "group_size": 2, "max_turns": 1, "max_tokens_per_turn": 16, "max_tokens_per_rollout": 16,
        "follow": {"groups_per_step": 1, "max_steps": 1000, "max_off_policy_steps": 1000, "poll_interval_s": 0.1},
        "output": {"flush_interval_s": 600}, "ray": {"num_cpus": 2}, **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _stop_renderer_when(cmd: list[str], ray_dir: str, ready: str) -> tuple[int, str, float]:
    """Run ``cmd``; once a stderr line holds ``ready``, SIGSTOP its renderer actor. Returns (exit status, stderr,
    seconds from the stop to the exit)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(ENV, RAY_TMPDIR=ray_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    seen, stopped, clock = [], [], None
    try:
        for line in proc.stderr:
            seen.append(line)
            if ready in line:
                stopped = ray_session_pids(ray_dir, b"ray::PlacedRendererService")
                assert len(stopped) == 1, f"one renderer actor expected, found {stopped}"
                os.kill(stopped[0], signal.SIGSTOP)
                clock = AwakeClock()
                break
        _, err = proc.communicate(timeout=120)
        return proc.returncode, "".join(seen) + err, clock.stop() if clock else 0.0
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        _kill_session(ray_dir)


def test_a_stopped_renderer_stops_the_follow_service_in_one_line_within_its_bound(tmp_path, ray_tmp):  # noqa: F811
    run = tmp_path / "run"
    # a healthy renderer must answer within the 3 s bound on a loaded 2-core CI machine: with the default 64
    # rollouts at once (and every batch admitted, nothing gating them) its queue once passed 3 s before batch 1
    # sealed, so the run stopped before the renderer was stopped at all ("0 batches sealed")
    cfg = _config(tmp_path, max_concurrent_rollouts=4,
                  follow={"groups_per_step": 1, "max_steps": 40, "max_off_policy_steps": 1000, "poll_interval_s": 0.1})
    cmd = [sys.executable, "-m", "actors.cli", "run", cfg, "--follow", str(run)]
    rc, err, took = _stop_renderer_when(cmd, ray_tmp, "batch 2 sealed")
    assert took > 0, f"the run ended before batch 2 sealed, before its renderer was stopped:\n{err[-3000:]}"
    assert rc == 4, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.rstrip("\n").splitlines()[-1]
    m = re.fullmatch(r"tito run --follow: renderer 0 did not answer (\w+) within renderer\.call_timeout_s 3 \(stopped, "
                     rf"hung or overloaded\): stopping; (\d+) batches sealed in {re.escape(str(run))}; `(.+)` goes on "
                     r"from the next batch", last)
    assert m, last
    # the bound (3 s) plus the shutdown (the renderer's close, also bounded by 3 s) and Ray's stop, with slack
    assert took < 3 + 3 + 30, f"{took:.1f} s from SIGSTOP to exit"
    sealed = int(m[2])
    assert sealed >= 2 and sorted(layout.step_dirs(run)) == list(range(1, sealed + 1))  # nothing unsealed left
    for k in range(1, sealed + 1):
        assert len(read_step(run, k, timeout=0).samples) == 2  # sealed, checksums verified


def test_a_stopped_renderer_stops_tito_run_in_one_line_and_resume_finishes(tmp_path, ray_tmp):  # noqa: F811
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "actors.cli", "run", _config(tmp_path, tasks={"count": 200, "seed": 1}),
           "--out", str(out)]
    rc, err, _ = _stop_renderer_when(cmd, ray_tmp, "tito run: rollouts ")
    assert rc == 4, err[-3000:]
    last = err.rstrip("\n").splitlines()[-1]
    m = re.fullmatch(r"tito run: renderer 0 did not (answer \w+|close) within renderer\.call_timeout_s 3 .+: stopping; "
                     rf"what finished is in {re.escape(str(out))}: `(.+)` runs the rest", last)
    assert m and m[2].endswith("--resume"), last
    # a bound this tight also trips on a healthy renderer's queue (400 rollouts' calls wait behind each other)
    resumed = subprocess.run(cmd + ["--resume", "--set", "renderer.call_timeout_s=120"], cwd=REPO, env=dict(ENV, RAY_TMPDIR=ray_tmp), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rollouts"] == 400 and summary["this_run"]["resumed"], summary


def test_renderers_that_cannot_be_placed_stop_the_run_in_one_line_within_the_start_bound(tmp_path, ray_tmp):  # noqa: F811
    cfg = _config(tmp_path, renderer={"num_cpus": 0, "resources": {"no_such_node": 1}, "start_timeout_s": 2})
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "actors.cli", "run", cfg, "--out", str(tmp_path / "out")], cwd=REPO,
                          env=dict(ENV, RAY_TMPDIR=ray_tmp), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    assert "did not start within renderer.start_timeout_s 2 (not placed" in last, last
    assert time.monotonic() - t0 < 60


TRAINER = """
import sys, torch
from rollout.data import read_step
from rollout.follow.publish import publish_weights
run = sys.argv[1]
for k in range(1, 10_000):
    read_step(run, k, timeout=600)
    publish_weights(run, k, {"w": torch.full((4,), float(k))}, config={"model_type": "none"})
"""


def _status(run, capsys) -> tuple[int, str]:
    from rollout.cli.main import main as tito

    capsys.readouterr()
    rc = tito(["status", str(run)])
    return rc, capsys.readouterr().out


def _within(seconds: float, check) -> tuple[int, str]:
    deadline, got = time.monotonic() + seconds, None
    while time.monotonic() < deadline:
        got = check()
        if got[0] is not None:
            return got
        time.sleep(0.25)
    raise AssertionError(f"not within {seconds} s: {got}")


def test_a_stopped_trainer_is_a_stall_and_a_stopped_service_is_stale_each_named_by_tito_status(
        tmp_path, ray_tmp, capsys):  # noqa: F811
    run = tmp_path / "run"
    cfg = _config(tmp_path, follow={"groups_per_step": 1, "max_steps": 1000, "max_off_policy_steps": 0,
                                    "poll_interval_s": 0.1, "status_interval_s": 1.0, "stall_after_s": 3.0})
    env = dict(ENV, RAY_TMPDIR=ray_tmp)
    service = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", cfg, "--follow", str(run)], cwd=REPO,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=sigint_default)
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(run)], cwd=REPO, env=env)
    try:
        def batch() -> int:
            status = json.loads((run / "status.json").read_text()) if (run / "status.json").exists() else {}
            return int(status.get("batch") or 0)

        _within(120, lambda: (True, "") if batch() >= 3 else (None, ""))
        os.kill(trainer.pid, signal.SIGSTOP)
        stopped_at = batch()
        rc, out = _within(3 + 3 + 10, lambda: (lambda r: r if r[0] == 3 else (None, r[1]))(_status(run, capsys)))
        # the trainer stopped somewhere in reading batch j or publishing version j: the service waits for it
        m = re.search(r"stalled: nothing progressed for \d+ s \(follow\.stall_after_s 3\); waiting for weights: "
                      r"batch (\d+) needs version >= (\d+)", out)
        assert m and int(m[1]) >= stopped_at and int(m[2]) == int(m[1]) - 1, out
        os.kill(trainer.pid, signal.SIGCONT)  # the trainer goes on: so does the service
        _within(30, lambda: (True, "") if batch() >= stopped_at + 2 else (None, ""))
        assert _status(run, capsys)[0] == 0

        os.kill(service.pid, signal.SIGSTOP)  # the service itself: status.json stops being rewritten
        rc, out = _within(3 * 1.0 + 10, lambda: (lambda r: r if r[0] == 1 else (None, r[1]))(_status(run, capsys)))
        assert f"the service is stopped: pid {service.pid} is in state T" in out, out
        os.kill(service.pid, signal.SIGCONT)
        _within(30, lambda: (lambda r: r if r[0] == 0 else (None, r[1]))(_status(run, capsys)))
        service.send_signal(signal.SIGTERM)
        _, err = service.communicate(timeout=60)
        assert service.returncode == 143, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    finally:
        for proc in (trainer, service):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        _kill_session(ray_tmp)
