"""The README's main job, small: `tito run configs/demo.yaml` with the embedded SmolLM2 engine on a
real local Ray, through the real command line; then `tito inspect` on what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rollout.data.shards import read_table

from ._support import REPO, smollm2_gguf


def test_demo_run_and_inspect(tmp_path):
    smollm2_gguf()  # skip (or fail under CI=true) without the default model
    out = tmp_path / "demo"
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    cmd = [sys.executable, "-m", "actors.cli", "run", "configs/demo.yaml", "--out", str(out), "--quiet",
           "--set", "tasks.count=2", "--set", "group_size=2", "--set", "max_tokens_per_turn=24",
           "--set", "max_tokens_per_rollout=72"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rollouts" in done.stdout and "break rate" in done.stdout
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rollouts"] == 4 and summary["errors"] == 0 and summary["renderer"] == "smollm2"
    rows = [r for f in sorted(out.glob("data/*.arrow")) for r in read_table(f).to_pylist()]
    assert sorted({r["rollout_id"] for r in rows}) == sorted({r["rollout_id"] for r in rows if r["segment_index"] == 0})
    assert len({r["rollout_id"] for r in rows}) == 4
    for r in rows:
        assert r["completion_tokens"] == sum(r["loss_mask"]) > 0
        assert all(lp <= 0 for lp, m in zip(r["logprobs"], r["loss_mask"]) if m)
        assert r["template_sha256"].startswith("872be49dbb638044")
    shown = subprocess.run([sys.executable, "-m", "actors.cli", "inspect", str(out), "--html", str(tmp_path / "s.html")],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "trainable_fraction" in shown.stdout
    page = (tmp_path / "s.html").read_text()  # the viewer: every sample, sampled tokens marked (tests/test_viewer.py)
    assert page.count('<section class="sample"') == len(rows) and 'class="t m1 s h' in page
