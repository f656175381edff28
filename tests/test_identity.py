"""Token identity end to end, with the real embedded SmolLM2 engine: a small real run sampled at
temperature 1 / top-p 1 (so the stored sampler logprob is the model's raw softmax), then every trainable
token's logprob recomputed by a plain fp32 forward pass over *packed* rows matches within 1e-4; a
corrupted logprob is caught and named; one GRPO step moves the ratios away from exactly 1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pyarrow as pa
import pytest

from rollout.data import load_samples, shard_files
from rollout.data.packing import pack
from rollout.data.shards import ShardWriter, read_table

from ._support import REPO, smollm2_gguf

TOL = 1e-4


def script(name: str):
    """Import scripts/NAME.py (not a package) as a module, once."""
    key = f"tito_scripts_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / "scripts" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # dataclasses look their module up while the class is created
        spec.loader.exec_module(mod)
    return sys.modules[key]


def real_run(out, *settings: str):
    """A small real run of the demo configuration (embedded SmolLM2) through the command line."""
    smollm2_gguf()  # skip (or fail under CI=true) without the default model
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    cmd = [sys.executable, "-m", "actors.cli", "run", "configs/demo.yaml", "--out", str(out), "--quiet",
           "--set", "tasks.count=2", "--set", "group_size=2", "--set", "max_tokens_per_turn=16",
           "--set", "max_tokens_per_rollout=64"]
    for s in settings:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Sampled at temperature 1 / top-p 1: the stored logprobs are the model's raw softmax."""
    return real_run(tmp_path_factory.mktemp("identity") / "run", "sampling.temperature=1.0", "sampling.top_p=1.0")


@pytest.fixture(scope="module")
def model():
    from rollout.models import load_causal_lm

    return load_causal_lm("smollm2-135m")


def test_script_recomputes_every_trainable_logprob(shards):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "scripts/verify_identity.py", str(shards)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "OK" in done.stdout and "trainable tokens" in done.stdout


@pytest.mark.parametrize("budget", [4096, 160])  # one row holding every sample; several rows
def test_packed_rows_match_the_sampler(shards, model, budget):
    verify = script("verify_identity")
    samples = load_samples(shards)
    rows = pack(samples, budget, seed=0)
    assert len(rows) == 1 or budget < 4096
    rep = verify.check_rows(model, rows, TOL)
    assert rep.samples == len(samples) == 4
    assert rep.trainable_tokens == sum(int(s.loss_mask.sum()) for s in samples) > 0
    assert rep.ok, rep.failures
    assert rep.max_abs_diff <= TOL and rep.max_abs_ratio_minus_1 <= TOL
    print(f"budget {budget}: max |new-old| {rep.max_abs_diff:.3g}, max |ratio-1| {rep.max_abs_ratio_minus_1:.3g}")


def test_a_corrupted_logprob_is_named(shards, model, tmp_path):
    """Shift one sampled token's stored logprob by 1e-3: the check fails naming the rollout, the turn
    and the token position, and the script exits non-zero."""
    verify = script("verify_identity")
    table = pa.concat_tables([read_table(f) for f in shard_files(shards)])  # the run keeps them in data/
    rows = table.to_pylist()
    # Sampled at temperature 1, a completion may stop after a token or two: take the rollout with the
    # most trainable tokens and the middle one of them, so the victim never depends on the draw.
    victim = max(rows, key=lambda r: sum(r["loss_mask"]))
    trainable = [i for i, m in enumerate(victim["loss_mask"]) if m]
    assert trainable, "the run sampled no trainable token"
    pos = trainable[len(trainable) // 2]
    victim["logprobs"][pos] -= 1e-3
    w = ShardWriter(tmp_path)
    w.add(rows)
    w.close()
    rep = verify.check_rows(model, pack(load_samples(tmp_path), 4096), TOL)
    assert not rep.ok and len(rep.failures) == 1
    f = rep.failures[0]
    assert f["rollout_id"] == victim["rollout_id"] and f["failing_tokens"] == 1
    assert f["tokens"][0]["position"] == pos and f["tokens"][0]["turn"] == victim["turn_index"][pos]
    assert rep.max_abs_diff > 9e-4


def test_one_grpo_step_moves_the_ratios(shards):
    demo = script("train_step_demo")
    out = demo.run(str(shards), lr=1e-5)
    before, after = out["before"], out["after"]
    assert out["trainable_tokens"] > 0 and out["samples"] == 4
    assert before["max_abs_minus_1"] <= TOL
    assert after["max_abs_minus_1"] > 1e-2  # the step changed the policy on the trained tokens
    assert after["min"] < 1 < after["max"] or after["mean"] != pytest.approx(1, abs=1e-3)
    print(f"ratios before {before}, after {after} ({out['advantages']})")


def test_processed_distribution_at_the_demo_settings(model, tmp_path):
    """At the demo's temperature 0.8 / top-p 0.95 the stored logprobs are of the processed distribution:
    recomputed with the same processing they match; the raw softmax does not (which is why the raw
    comparison needs a temperature-1 / top-p-1 run)."""
    verify = script("verify_identity")
    out = real_run(tmp_path / "run", "tasks.count=1")
    rows = pack(load_samples(out), 4096)
    rep = verify.check_rows(model, rows, TOL, temperature=0.8, top_p=0.95)
    assert rep.ok and rep.trainable_tokens > 0, rep.failures
    raw = verify.check_rows(model, rows, TOL)
    assert not raw.ok and raw.max_abs_diff > 1e-2
    print(f"t=0.8/top-p 0.95: max |new-old| {rep.max_abs_diff:.3g} processed, {raw.max_abs_diff:.3g} raw")
