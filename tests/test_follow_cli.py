"""``tito run --follow`` as a real process on real Ray with the SmolLM2 embedded engine: SIGKILL mid-run, then
the same command goes on at the first unsealed batch (the cut-short one is cleaned, no rollout twice, the
sealed batches byte-identical); SIGTERM while it waits for weights ends in one line with every sealed batch
intact. Weight updates mid-run and the off-policy bound are tested in process: test_follow.py."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from rollout.data import layout, load_samples
from rollout.data.shards import read_manifest

from ._support import REPO, sigint_default, smollm2_gguf
from .test_run_failfast import _no_session_left, _session_pids, ray_tmp  # noqa: F401 - the fixture

ENV = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
GROUPS, G = 2, 2


def _config(tmp_path) -> str:
    smollm2_gguf()
    cfg = {
        "env": {"name": "arithmetic", "options": {"difficulty": 1}}, "tasks": {"count": 5, "seed": 1},
        "group_size": G, "max_turns": 1, "max_tokens_per_turn": 16, "max_tokens_per_rollout": 16,
        "sampling": {"temperature": 1.0, "seed": 5}, "engine": {"options": {"threads": 1, "max_batch": 8}},
        "follow": {"groups_per_step": GROUPS, "max_steps": 4, "max_off_policy_steps": 3, "poll_interval_s": 0.2},
        "output": {"flush_interval_s": 600}, "ray": {"num_cpus": 2},
    }
    path = tmp_path / "follow.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _start(config: str, run_dir, ray_dir: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "actors.cli", "run", config, "--follow", str(run_dir), *extra],
                            cwd=REPO, env=dict(ENV, RAY_TMPDIR=ray_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)


def _until(proc: subprocess.Popen, text: str) -> str:
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"the service ended before {text!r}: {''.join(seen)[-3000:]}")


def _kill_session(ray_dir: str) -> None:
    """This test's Ray only: the processes with its private temp dir on their command line."""
    for pid in _session_pids(ray_dir, exclude=os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_sigkill_then_restart_goes_on_at_the_first_unsealed_batch_and_sigterm_keeps_what_is_sealed(
        tmp_path, ray_tmp):  # noqa: F811
    config, run = _config(tmp_path), tmp_path / "run"
    proc = _start(config, run, ray_tmp)
    try:
        _until(proc, "batch 1 sealed")
        proc.kill()  # SIGKILL: no flush, no clean-up
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_session(ray_tmp)
    first = _digest(layout.step_dir(run, 1) / layout.SEALED)
    # what a killed run leaves: a batch cut short (files, no manifest) must never reach a trainer
    junk = layout.step_dir(run, 3) / "data"
    junk.mkdir(parents=True, exist_ok=True)
    (junk / "train-r0-00000.arrow").write_bytes(b"half a file")

    done = subprocess.run([sys.executable, "-m", "actors.cli", "run", config, "--follow", str(run)], cwd=REPO,
                          env=dict(ENV, RAY_TMPDIR=ray_tmp), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 batches sealed" in done.stdout and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert _digest(layout.step_dir(run, 1) / layout.SEALED) == first  # a sealed batch is never rewritten
    assert sorted(layout.step_dirs(run)) == [1, 2, 3, 4] and all(layout.is_sealed(run, k) for k in range(1, 5))
    ids = []
    for k in range(1, 5):
        manifest = read_manifest(layout.step_dir(run, k))
        samples = load_samples(layout.step_dir(run, k))
        assert len(samples) + len(manifest["follow"]["withheld"]) == GROUPS * G
        assert all(f"@{k}." in s.rollout_id for s in samples)  # <task>@<batch>.<group>#<member>
        ids += [s.rollout_id for s in samples]
    assert len(ids) == len(set(ids)) == 4 * GROUPS * G, Counter(ids).most_common(3)

    # six batches with no trainer: batch 5 needs version 1, so it waits; SIGTERM there keeps batches 1..4
    proc = _start(config, run, ray_tmp, "--set", "follow.max_steps=6")
    try:
        _until(proc, "batch 5 needs version >= 1")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    lines = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and "4 batches sealed" in lines[0] and "Traceback" not in err, err[-3000:]
    assert sorted(layout.step_dirs(run)) == [1, 2, 3, 4]
    assert _digest(layout.step_dir(run, 1) / layout.SEALED) == first
    assert _no_session_left(ray_tmp) == []
