"""``tito run`` as a real subprocess (issue 23): inputs that could never work stop it with exit status 2 and
one line before Ray starts; more engines than CPUs share them instead of waiting forever; SIGTERM while Ray
starts and repeated Ctrl-C end like any interrupted run, leaving none of its Ray processes behind.

Slow (whole runs, Ray start-ups): in ``make test-e2e``."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from ._support import REPO, sigint_default, tokenizer_dir

ENV = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
pytestmark = pytest.mark.slow


def _tito_run(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actors.cli", "run", *args], cwd=REPO, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def _replay_config(tmp: Path) -> str:
    """Fast rollouts (the replay engine, no model) that are still running a few seconds in."""
    cfg = {
        "model": str(tokenizer_dir("qwen2.5-7b-instruct")),
        "engine": {"backend": "replay",
                   "options": {"synthetic": True, "vocab_size": 151665, "max_model_len": 4096, "token_delay_s": 0.1}},
        "env": {"name": "try_again"}, "tasks": {"count": 6}, "group_size": 2, "max_turns": 2,
        "max_tokens_per_turn": 12, "max_tokens_per_rollout": 24, "max_concurrent_rollouts": 2,
        "output": {"dir": str(tmp / "out")}, "ray": {"num_cpus": 2},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture
def ray_tmp():
    """A private Ray temp dir (RAY_TMPDIR, short: Ray's socket paths must fit 107 bytes): every process of the
    Ray session a run starts has it on its command line, so they can be found without looking at others'."""
    path = tempfile.mkdtemp(prefix="tff", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _session_pids(ray_tmp: str, exclude: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != exclude:
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if ray_tmp.encode() in cmdline:
                pids.append(int(entry))
    return pids


def _no_session_left(ray_tmp: str, grace_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + grace_s
    while (left := _session_pids(ray_tmp, exclude=os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def test_inputs_that_cannot_work_stop_before_ray(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"prompt": "1+1?", "task_id": "dup"}\n{"prompt": "2+2?", "task_id": "dup"}\n')
    out = tmp_path / "out"
    cases = [
        (["--out", str(a_file)], f"output.dir {a_file}: is a file, not a directory"),
        (["--out", str(a_file / "sub")], f"output.dir {a_file}/sub: is under {a_file}, a file"),
        (["--out", str(out), "--set", f"tasks.path={dup}"],
         f"{dup}, row 1 (line 2), column 'task_id': 'dup' already used by row 0 (line 1)"),
        (["--out", str(out), "--set", "engine.count=2", "--set", "engine.num_cpus=1", "--set", "ray.num_cpus=2"],
         "= 2.25 CPUs but the local Ray has 2 CPUs"),
    ]
    for args, message in cases:
        done = _tito_run("configs/demo.yaml", "--quiet", *args)
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.startswith("tito run: error: ") and message in done.stderr, done.stderr[-2000:]
        assert done.stderr.count("\n") == 1, done.stderr[-2000:]  # one line: no Ray start-up, no traceback
        assert not out.exists(), "nothing is written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dup.jsonl"]


def test_an_immutable_output_dir_stops_before_ray(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a file system with the immutable flag)")
    try:
        done = _tito_run("configs/demo.yaml", "--quiet", "--out", str(locked))
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == f"tito run: error: output.dir {locked}: cannot write in {locked}: Operation not " \
                          "permitted; choose another output.dir (--out)\n"
    assert not any(locked.iterdir())


def test_more_engines_than_cpus_share_them(tmp_path):
    """Two 1-CPU embedded engines and a 0.25-CPU renderer on 2 Ray CPUs: before, Ray never placed the
    renderer and the run sat at 0 rollouts; now each engine takes 0.875 CPU and the run completes."""
    out = tmp_path / "out"
    done = _tito_run("configs/demo.yaml", "--quiet", "--out", str(out), "--set", "engine.count=2",
                     "--set", "ray.num_cpus=2", "--set", "tasks.count=1", "--set", "group_size=2",
                     "--set", "max_turns=1", "--set", "max_tokens_per_turn=8", timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"rollouts +2 \(1 tasks x 2\)", done.stdout), done.stdout


@pytest.mark.parametrize("when", ["ray.init", "engine start"])
def test_sigterm_while_ray_starts_ends_like_any_interrupted_run(tmp_path, ray_tmp, when):
    """SIGTERM once Ray began starting its processes, or once it is up and the engines start. Before: exit
    status 15 (Ray's own handler, installed by ray.init), no "interrupted" line, Ray's processes left behind."""
    config = _replay_config(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", config, "--quiet"], cwd=REPO,
                            env=dict(ENV, RAY_TMPDIR=ray_tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    seen = []
    try:
        if when == "ray.init":
            deadline = time.monotonic() + 120
            while not _session_pids(ray_tmp, exclude=proc.pid):  # Ray has begun starting its processes
                assert proc.poll() is None and time.monotonic() < deadline, "Ray never started"
                time.sleep(0.05)
        else:
            for line in proc.stderr:
                seen.append(line)
                if "Started a local Ray instance" in line:
                    break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + err
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and lines[0].startswith("tito run: interrupted by SIGTERM:"), err[-3000:]
    assert _no_session_left(ray_tmp) == [], "the run's Ray processes outlived it"


def test_repeated_ctrl_c_is_ignored_after_the_first(tmp_path, ray_tmp):
    """Ctrl-C, then Ctrl-C again every 0.3 s until the process is gone (to the whole process group, as a
    terminal sends it): before, one landed in Ray's exit hook ("Exception ignored in atexit callback ...
    KeyboardInterrupt")."""
    config = _replay_config(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", config], cwd=REPO,
                            env=dict(ENV, RAY_TMPDIR=ray_tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=sigint_default)  # Ctrl-C as in a terminal
    seen, sent = [], 0
    try:
        for line in proc.stderr:
            seen.append(line)
            m = re.search(r"rollouts (\d+)/", line)
            if m and int(m.group(1)) >= 2:
                break
        while proc.poll() is None and sent < 200:
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:  # it exited meanwhile
                break
            sent += 1
            time.sleep(0.3)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + err
    assert sent >= 2, "the run ended before a second Ctrl-C"
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Exception ignored" not in err and "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and lines[0].startswith("tito run: interrupted by SIGINT:"), err[-3000:]
    assert _no_session_left(ray_tmp) == []


def test_a_cluster_without_the_cpus_stops_after_a_bounded_wait(tmp_path, ray_tmp):
    """Joining a 1-CPU cluster with a 1-CPU engine and a 0.25-CPU renderer: nodes may still join, so the run
    waits CLUSTER_CPU_WAIT_S, then stops with the numbers (before: it waited forever at 0 rollouts)."""
    import socket

    from rollout.startup import CLUSTER_CPU_WAIT_S

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(ENV, RAY_TMPDIR=ray_tmp)
    ray_cli = str(Path(sys.executable).with_name("ray"))
    try:
        subprocess.run([ray_cli, "start", "--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                        "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=180)
        t0 = time.monotonic()
        done = _tito_run("configs/demo.yaml", "--quiet", "--out", str(tmp_path / "out"),
                         "--address", f"127.0.0.1:{port}", env=env, timeout=300)
        waited = time.monotonic() - t0
    finally:  # this test's cluster only: the processes with its private temp dir on their command line
        for pid in _session_pids(ray_tmp, exclude=os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert done.returncode == 2, done.stderr[-3000:]
    assert ("tito run: error: the actors need 1 engine actor(s) x 1 + 1 renderer actor(s) x 0.25 = 1.25 CPUs but "
            f"the Ray cluster has 1 CPUs after waiting {CLUSTER_CPU_WAIT_S:g} s for nodes") in done.stderr, \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr and waited >= CLUSTER_CPU_WAIT_S
