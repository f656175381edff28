"""``tito run`` as a real subprocess: Ctrl-C (SIGINT to the whole process group, as a terminal sends
it) and SIGTERM flush every finished group, write the manifest and summary, print one line and exit
128 + signal; ``--resume`` then completes the run with exactly G rollouts per task and none twice.
And ``engine.backend: vllm`` where vLLM is not installed fails in seconds instead of waiting forever."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections import Counter

import pyarrow.dataset as ds
import pytest
import yaml

from rollout.data.shards import MANIFEST, SUMMARY

from ._support import REPO, sigint_default, tokenizer_dir

TASKS, G = 6, 2
ENV = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")


def _config(tmp_path) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model": str(tokenizer_dir("qwen2.5-7b-instruct")),
        "engine": {"backend": "replay", "count": 1,
                   # slow tokens: rollouts are still running when the signal comes
                   "options": {"synthetic": True, "vocab_size": 151665, "max_model_len": 4096, "token_delay_s": 0.1}},
        "env": {"name": "try_again"}, "tasks": {"count": TASKS}, "group_size": G, "max_turns": 2,
        "max_tokens_per_turn": 12, "max_tokens_per_rollout": 24, "max_concurrent_rollouts": 2,
        "sampling": {"seed": 3},
        # no timed flush: whatever is on disk after the signal was flushed because of the signal
        "output": {"dir": str(tmp_path / "out"), "flush_interval_s": 600}, "ray": {"num_cpus": 2},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run_until(config: str, sig: int, *, after: int, group: bool, resume: bool) -> tuple[int, str]:
    """Start ``tito run``, send ``sig`` once ``after`` rollouts are done (read off the progress lines)."""
    cmd = [sys.executable, "-m", "actors.cli", "run", config] + (["--resume"] if resume else [])
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=sigint_default)  # Ctrl-C as in a terminal
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            m = re.search(r"rollouts (\d+)/(\d+)", line)
            if m and int(m.group(1)) >= after:
                os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(seen) + err


def _on_disk(out) -> list[dict]:
    return ds.dataset(out, format="ipc").to_table(columns=["rollout_id", "group_id", "segment_index"]).to_pylist()


def _check_consistent(out, stderr: str, name: str) -> list[dict]:
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [ln for ln in stderr.splitlines() if "interrupted" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"tito run: interrupted by {name}:") and "--resume" in lines[0], stderr
    rows = _on_disk(out)
    assert rows, "finished groups must be flushed on the signal"
    per_group = Counter(r["group_id"] for r in rows if r["segment_index"] == 0)
    assert set(per_group.values()) == {G}, f"a group on disk is incomplete: {per_group}"
    manifest = json.loads((out / MANIFEST).read_text())
    summary = json.loads((out / SUMMARY).read_text())
    assert manifest["rows"] == len(rows) and summary["rollouts"] == len(per_group) * G
    assert summary["this_run"]["interrupted"] == name
    return rows


def _resume_to_the_end(config: str, out) -> None:
    done = subprocess.run([sys.executable, "-m", "actors.cli", "run", config, "--resume", "--quiet"], cwd=REPO,
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _on_disk(out)
    ids = [r["rollout_id"] for r in rows if r["segment_index"] == 0]
    assert len(ids) == len(set(ids)) == TASKS * G, Counter(ids).most_common(3)
    assert set(Counter(r["group_id"] for r in rows if r["segment_index"] == 0).values()) == {G}
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["rollouts"] == TASKS * G and summary["this_run"]["interrupted"] is None
    assert summary["this_run"]["rollouts"] < TASKS * G  # the interrupted run's groups were not rerun


@pytest.mark.slow
def test_sigint_and_sigterm_flush_and_resume_completes(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    # two runs side by side (start-up dominates): Ctrl-C in a terminal (SIGINT to the process group)
    # and SIGTERM to the process alone
    cases = {"SIGINT": (signal.SIGINT, True, 130), "SIGTERM": (signal.SIGTERM, False, 143)}
    configs = {name: _config(tmp_path / name) for name in cases}
    with ThreadPoolExecutor(2) as pool:
        started = {name: pool.submit(_run_until, configs[name], sig, after=3, group=group, resume=False)
                   for name, (sig, group, _) in cases.items()}
        for name, (_, _, code) in cases.items():
            rc, err = started[name].result()
            assert rc == code, err[-3000:]
            assert len(_check_consistent(tmp_path / name / "out", err, name)) < TASKS * G
        finished = [pool.submit(_resume_to_the_end, configs[name], tmp_path / name / "out") for name in cases]
        for f in finished:
            f.result()


def test_vllm_where_it_is_not_installed_fails_fast(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "actors.cli", "run", "configs/demo.yaml", "--out", str(out), "--quiet",
           "--set", "engine.backend=vllm"]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "vllm is not installed in this environment: `make test-vllm` builds .venv-vllm" in done.stderr
    assert "Traceback" not in done.stderr and "Started a local Ray" not in done.stderr  # before Ray starts
    assert not out.exists(), "nothing is written"
