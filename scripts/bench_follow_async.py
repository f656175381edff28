"""Does sampling beside the trainer pay? The same N steps with max_off_policy_steps 0 and 1, in one run.

    python scripts/bench_follow_async.py [--steps 6] [--train-s auto] [--repeats 2] [--config configs/demo.yaml]

Starts ``tito run CONFIG --follow RUN_DIR`` (the real embedded engine on Ray) and, in this process, a simulated
trainer whose step takes a fixed time: it waits for batch k (``read_step``), sleeps ``--train-s``, and publishes
version k. Publishing is a hard-linked copy of one checkpoint written before the clock starts (the engines
still validate and load every version: that cost is in the figures, as it would be with a real trainer), so
the trainer's step is exactly the sleep. No CPU goes to the simulated trainer, so the engine has the machine
to itself, as it would beside a trainer on other GPUs.

Measured per run: the wall time from batch 1 handed to the trainer to batch N handed to it (N - 1 trainer
steps; start-up is excluded), the generation time of a batch (the median of ``batch_s`` in metrics.jsonl
under S = 0, where batches never overlap) and the weight-update time (``stable_to_resumed_s``). The ideal
speed-up of S = 1 over S = 0 is (T_gen + T_train) / max(T_gen, T_train). ``--train-s auto`` sets T_train to
T_gen measured in a first S = 0 run (where the ideal is 2x). Figures go to stdout as JSON and a Markdown
table; docs/benchmarks.md keeps a copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rollout.data import layout, read_step  # noqa: E402


def checkpoint(model: str, into: Path) -> Path:
    """The model's weights as a broadcast-style checkpoint directory (written once, outside the clock)."""
    from rollout.follow.publish import publish_weights
    from rollout.models import load_causal_lm

    m = load_causal_lm(model)
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    return publish_weights(into, 1, m.state_dict(), config=cfg)


def publish_linked(run_dir: Path, version: int, source: Path) -> None:
    """broadcasts/step_<version>/ as hard links to ``source``'s files, renamed into place, STABLE last."""
    target = layout.broadcast_dir(run_dir, version)
    tmp = target.parent / f".step_{version}.tmp"
    tmp.mkdir(parents=True)
    for f in source.iterdir():
        if f.name != layout.STABLE:
            os.link(f, tmp / f.name)
    tmp.rename(target)
    (target / layout.STABLE).touch()


def one_run(config: str, s: int, steps: int, train_s: float, source: Path, groups: int) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"tito-async-s{s}-"))
    cmd = [sys.executable, "-m", "actors.cli", "run", config, "--follow", str(run_dir), "--quiet",
           "--set", f"follow.max_steps={steps}", "--set", f"follow.max_off_policy_steps={s}",
           "--set", f"follow.groups_per_step={groups}", "--set", "follow.poll_interval_s=0.1"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        read_step(run_dir, 1, timeout=600, verify=False)
        t0 = time.perf_counter()
        for k in range(1, steps):
            time.sleep(train_s)  # the trainer's step on batch k
            publish_linked(run_dir, k, source)
            read_step(run_dir, k + 1, timeout=600, verify=False)
        wall = time.perf_counter() - t0
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"tito run --follow exited {proc.returncode}: {err[-2000:]}")
        metrics = [json.loads(line) for line in (run_dir / layout.METRICS).read_text().splitlines()]
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(run_dir, ignore_errors=True)
    # overlapping batches may both list one load: each counted once
    updates = [u["stable_to_resumed_s"] for u in {u["version"]: u for m in metrics for u in m["weight_updates"]}.values()]
    return {"s": s, "wall_s": round(wall, 2), "batch_s": [m["batch_s"] for m in metrics],
            "update_s": round(statistics.median(updates), 3) if updates else None,
            "staleness": [m["staleness"] for m in metrics]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--groups", type=int, default=4, help="follow.groups_per_step")
    ap.add_argument("--train-s", default="auto", help="seconds per simulated trainer step, or auto (= T_gen)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tito-async-ckpt-") as tmp:
        source = checkpoint("smollm2-135m", Path(tmp))
        runs = []
        train_s = None if args.train_s == "auto" else float(args.train_s)
        for r in range(args.repeats):
            for s in (0, 1):
                if train_s is None:  # calibrate T_train = T_gen on a first S=0 run
                    probe = one_run(args.config, 0, 3, 1.0, source, args.groups)
                    train_s = round(statistics.median(probe["batch_s"]), 2)
                res = one_run(args.config, s, args.steps, train_s, source, args.groups)
                res["repeat"] = r
                runs.append(res)
                print(json.dumps(res), flush=True)
    sync = [x for x in runs if x["s"] == 0]
    t_gen = statistics.median(b for x in sync for b in x["batch_s"])
    t_upd = statistics.median(x["update_s"] for x in runs if x["update_s"] is not None)
    walls = {s: statistics.median(x["wall_s"] for x in runs if x["s"] == s) for s in (0, 1)}
    ideal = (t_gen + train_s) / max(t_gen, train_s)
    out = {"steps": args.steps, "train_s": train_s, "t_gen_s": round(t_gen, 2), "t_update_s": t_upd,
           "wall_s0": walls[0], "wall_s1": walls[1], "speedup": round(walls[0] / walls[1], 3),
           "ideal": round(ideal, 3), "repeats": args.repeats}
    print(json.dumps(out))
    print(f"\n| steps | T_train | T_gen | update | wall S=0 | wall S=1 | speed-up | ideal |\n|---|---|---|---|---|---|---|---|\n"
          f"| {args.steps - 1} | {train_s:.1f} s | {t_gen:.1f} s | {t_upd:.2f} s | {walls[0]:.1f} s | {walls[1]:.1f} s "
          f"| {out['speedup']:.2f}x | {ideal:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
