"""scripts/launch_rollouts.py submits a run to a real Ray cluster (a head started here on loopback)
with `ray job submit`, and the run's shards appear where the config says."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ._support import REPO, tokenizer_dir

VENV_BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    dash = _free_port()
    start = [str(VENV_BIN / "ray"), "start", "--head", f"--port={_free_port()}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dash}", "--num-cpus=2", "--include-dashboard=true", "--disable-usage-stats"]
    done = subprocess.run(start, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"ray start failed: {done.stderr[-2000:]}")
    yield f"http://127.0.0.1:{dash}"
    subprocess.run([str(VENV_BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def test_submit_to_a_cluster(ray_head, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "scripts/launch_rollouts.py", "--address", ray_head, "--python", sys.executable,
           "configs/demo.yaml", "--set", f"model={tokenizer_dir('qwen2.5-7b-instruct')}",
           "--set", "engine.backend=replay",
           "--set", "engine.options={synthetic: true, vocab_size: 151665, max_model_len: 4096}",
           "--set", "tasks.count=2", "--set", "group_size=2", "--set", f"output.dir={out}"]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert json.loads((out / "_summary.json").read_text())["rollouts"] == 4
    assert list(out.glob("data/*.arrow"))


def test_a_bad_config_is_refused_before_submitting():
    done = subprocess.run([sys.executable, "scripts/launch_rollouts.py", "--address", "http://127.0.0.1:1",
                           "configs/demo.yaml", "--set", "group_sise=2"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and "group_sise: unknown key" in done.stderr
