"""``tito run`` as a real process on a real Ray with the SmolLM2 embedded engine, whose only engine actor is
killed mid-run (issue 31): the run ends in one line with exit status 3, naming what happened and the exact
``--resume`` command, after writing every finished group (sealed shards, readable, counted in the summary);
that command then completes the run with no rollout twice. ``tito run --follow`` the same: one line, exit 3,
every sealed batch intact and nothing unsealed left.

Slow (whole runs, Ray start-ups): in ``make test-e2e``."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from rollout.data import layout, load_samples, open_shards, read_step
from rollout.data.shards import MANIFEST, SUMMARY, read_manifest

from ._support import REPO, ray_session_pids, smollm2_gguf
from .test_run_failfast import _no_session_left

ENV = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
TASKS, G = 4, 2
TITO = [sys.executable, "-m", "actors.cli"]
pytestmark = pytest.mark.slow


def _kill_engine_when(cmd: list[str], ray_dir: str, ready: re.Pattern,
                      then: Callable[[], object] = lambda: None) -> tuple[int, str]:
    """Run ``cmd``; once a stderr line matches ``ready``, SIGKILL its engine actor (only that one), call
    ``then`` and return (exit status, stderr)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(ENV, RAY_TMPDIR=ray_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if ready.search(line):
                pids = ray_session_pids(ray_dir, b"ray::EngineActor")
                assert len(pids) == 1, f"one engine actor expected, found {pids}"
                os.kill(pids[0], signal.SIGKILL)
                then()
                break
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(seen) + err


def test_a_killed_engine_is_restarted_and_the_run_completes(tmp_path, ray_dirs):
    """The default (engine.max_restarts 3): the killed engine actor is named, Ray restarts it, it rejoins, and
    the run ends with exit 0 and every rollout exactly once."""
    smollm2_gguf()
    out = tmp_path / "out"
    cmd = [*TITO, "run", "configs/demo.yaml", "--out", str(out), "--set", f"tasks.count={TASKS}",
           "--set", f"group_size={G}", "--set", "max_concurrent_rollouts=1", "--set", "ray.num_cpus=2"]
    rc, err = _kill_engine_when(cmd, ray_dirs[0], re.compile(rf"rollouts [2-4]/{TASKS * G}"))
    assert rc == 0, err[-3000:]
    assert re.search(r"engine 0 lost: .+; 0 of 1 engines serving; restarting it \(1 of engine\.max_restarts 3\)",
                     err), err[-3000:]
    assert re.search(r"engine 0 restarted and rejoined with version 0 in [\d.]+ s; 1 of 1 engines serving", err), \
        err[-3000:]
    ids = [r["rollout_id"] for r in open_shards(out).to_table(columns=["rollout_id", "segment_index"]).to_pylist()
           if r["segment_index"] == 0]
    assert len(ids) == len(set(ids)) == TASKS * G, Counter(ids).most_common(3)
    summary = json.loads((out / SUMMARY).read_text())["this_run"]
    assert (summary["engines_lost"], summary["engines_restarted"], summary["engines_died"]) == (1, 1, None)
    assert _no_session_left(ray_dirs[0]) == [], "the run's Ray processes must be gone"


def _last_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    return stderr.rstrip("\n").splitlines()[-1]


def _batch_run(tmp: Path, ray_dir: str) -> None:
    out = tmp / "out"
    # one rollout at a time, in group order: once 4 are done, groups 1 and 2 are whole and the others still to
    # run; no timed flush, so the finished groups reach disk because of the death
    cmd = [*TITO, "run", "configs/demo.yaml", "--out", str(out), "--set", f"tasks.count={TASKS}",
           "--set", f"group_size={G}", "--set", "max_concurrent_rollouts=1", "--set", "output.flush_interval_s=600",
           "--set", "ray.num_cpus=2", "--set", "engine.max_restarts=0"]
    rc, err = _kill_engine_when(cmd, ray_dir, re.compile(rf"rollouts [4-7]/{TASKS * G}"))
    line = _last_line(err)
    assert rc == 3, err[-3000:]
    m = re.fullmatch(rf"tito run: the engine died: (\d+) finished groups \((\d+) rollouts\) written this run, \2 "
                     rf"rollouts in all in {re.escape(str(out))}; (\d+) groups not run: `(.+)` runs them", line)
    assert m, err[-3000:]
    written, rollouts, not_run = int(m[1]), int(m[2]), int(m[3])
    assert written >= 2 and written + not_run == TASKS and rollouts == written * G, line

    rows = open_shards(out).to_table(columns=["rollout_id", "group_id", "segment_index"]).to_pylist()
    per_group = Counter(r["group_id"] for r in rows if r["segment_index"] == 0)
    assert len(per_group) == written and set(per_group.values()) == {G}, per_group  # whole groups only
    assert read_manifest(out)["rows"] == len(rows)  # sealed: every file listed, with its checksum
    assert len(load_samples(out)) == len(rows)
    summary = json.loads((out / SUMMARY).read_text())["this_run"]
    assert (summary["groups_written"], summary["groups_not_run"], summary["engines_died"]) == (
        written, not_run, "the engine died")

    resume = shlex.split(m[4])
    assert resume[:2] == ["tito", "run"] and resume[-1] == "--resume", resume
    done = subprocess.run([*TITO, *resume[1:]], cwd=REPO, env=dict(ENV, RAY_TMPDIR=ray_dir), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = [r["rollout_id"] for r in open_shards(out).to_table(columns=["rollout_id", "segment_index"]).to_pylist()
           if r["segment_index"] == 0]
    assert len(ids) == len(set(ids)) == TASKS * G, Counter(ids).most_common(3)
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["rollouts"] == TASKS * G and summary["this_run"]["rollouts"] == TASKS * G - rollouts
    assert (out / MANIFEST).exists()


def _follow_run(tmp: Path, ray_dir: str) -> None:
    tmp.mkdir()
    config, run = tmp / "follow.yaml", tmp / "run"
    # batches of one group, many admitted at once (no trainer publishes weights): batches are still running
    # when the second one seals
    config.write_text(yaml.safe_dump({
        "env": {"name": "arithmetic", "options": {"difficulty": 1}}, "tasks": {"count": 5, "seed": 1},
        "group_size": G, "max_turns": 1, "max_tokens_per_turn": 32, "max_tokens_per_rollout": 32,
        "max_concurrent_rollouts": 2, "engine": {"options": {"threads": 1}, "max_restarts": 0},
        "follow": {"groups_per_step": 1, "max_steps": 12, "max_off_policy_steps": 11},
        "output": {"flush_interval_s": 600}, "ray": {"num_cpus": 2},
    }))
    cmd = [*TITO, "run", str(config), "--follow", str(run)]
    rc, err = _kill_engine_when(cmd, ray_dir, re.compile(r"batch 2 sealed"))
    line = _last_line(err)
    assert rc == 3, err[-3000:]
    m = re.fullmatch(rf"tito run --follow: the engine died: (\d+) batches sealed in {re.escape(str(run))}; once "
                     rf"engines can run, `(.+)` goes on from the next batch", line)
    assert m and shlex.split(m[2]) == ["tito", "run", str(config), "--follow", str(run)], err[-3000:]
    sealed = int(m[1])
    assert 2 <= sealed < 12
    assert sorted(layout.step_dirs(run)) == list(range(1, sealed + 1))  # nothing unsealed left
    for k in range(1, sealed + 1):
        assert len(read_step(run, k, timeout=0).samples) == G  # sealed, checksums verified


def _follow_idle_run(tmp: Path, ray_dir: str) -> None:
    """The engine dies while the service idles at the bound, waiting for a trainer: the trainer's next
    checkpoint finds no engine to load it into, and the service ends as above instead of waiting for ever."""
    from rollout.follow.publish import publish_weights
    from rollout.models import load_causal_lm, resolve_model

    tmp.mkdir()
    config, run = tmp / "follow.yaml", tmp / "run"
    config.write_text(yaml.safe_dump({
        "env": {"name": "arithmetic", "options": {"difficulty": 1}}, "tasks": {"count": 2, "seed": 1},
        "group_size": G, "max_turns": 1, "max_tokens_per_turn": 8, "max_tokens_per_rollout": 8,
        "engine": {"options": {"threads": 1}, "max_restarts": 0}, "ray": {"num_cpus": 2},
        "follow": {"groups_per_step": 1, "max_steps": 3, "max_off_policy_steps": 0, "poll_interval_s": 0.2},
    }))
    model = load_causal_lm(str(resolve_model("smollm2-135m")))  # the trainer's next weights: a valid checkpoint (version 1)
    cmd = [*TITO, "run", str(config), "--follow", str(run)]
    rc, err = _kill_engine_when(cmd, ray_dir, re.compile(r"batch 1 sealed"),
                                then=lambda: publish_weights(run, 1, model))
    line = _last_line(err)
    assert rc == 3, err[-3000:]
    assert re.fullmatch(rf"tito run --follow: the engine died: 1 batches sealed in {re.escape(str(run))}; .+",
                        line), err[-3000:]
    assert sorted(layout.step_dirs(run)) == [1] and len(read_step(run, 1, timeout=0).samples) == G


@pytest.fixture
def ray_dirs():
    """Private Ray temp dirs (RAY_TMPDIR, short: Ray's socket paths must fit 107 bytes), one per run: a run's
    processes are found by it and by nothing else."""
    dirs = [tempfile.mkdtemp(prefix="ted", dir="/tmp") for _ in range(3)]
    yield dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def test_every_engine_dead_writes_finished_work_ends_in_one_line_and_resume_completes(tmp_path, ray_dirs):
    smollm2_gguf()
    # side by side: Ray and model start-ups dominate
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(_batch_run, tmp_path / "batch", ray_dirs[0]),
                pool.submit(_follow_run, tmp_path / "follow", ray_dirs[1]),
                pool.submit(_follow_idle_run, tmp_path / "idle", ray_dirs[2])]
        for r in runs:
            r.result()
    for d in ray_dirs:
        assert _no_session_left(d) == [], "the runs' Ray processes must be gone"
