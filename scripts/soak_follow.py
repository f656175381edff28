"""A long ``tito run --follow``: does the service hold its memory, files, threads and disk over many steps?

    python scripts/soak_follow.py OUT_DIR [--steps 300] [--keep-broadcasts 2] [--model tiny|smollm2]
                                  [--warmup 30] [--sample-every 5]

It starts ``tito run CONFIG --follow OUT_DIR/run`` (the embedded engine, one-turn arithmetic, one group of two
per batch) in its own Ray session and acts as a stand-in trainer: for each batch k it waits for the batch
(``read_step``), then publishes version k (``publish_weights``: the served weights with one tensor nudged, so
every step is a real validate + load). Every ``--sample-every`` steps it reads, from /proc, each service
process's RSS, open files and threads — the driver (``tito run``), the engine actor and the renderer actor —
and the disk the run directory takes (``broadcasts/`` and ``rollouts/``). ``--model tiny`` (default) serves a
random 2-layer Llama with SmolLM2's tokenizer (12 MB a checkpoint: 300 steps in minutes); ``smollm2`` the
real 135M model (513 MB a checkpoint).

Flat means: each figure's value at the end is within 10 % of its median over the five samples just after
``--warmup`` steps. ``OUT_DIR/soak.jsonl`` has every sample,
``OUT_DIR/soak.json`` the verdict; the table it prints is what docs/benchmarks.md shows. Exit 1 when a figure
is not flat or the disk is not bounded (with ``--keep-broadcasts``: never more than N + 2 steps on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from rollout.data import layout, read_step
from rollout.follow.publish import publish_weights
from rollout.models import model_dir

ROLES = {"driver": None, "engine": b"ray::EngineActor", "renderer": b"ray::PlacedRendererService"}


def tiny_model(where: Path) -> Path:
    """A random 2-layer Llama with SmolLM2-135M-Instruct's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    source = model_dir("smollm2-135m")
    where.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(source / name, where / name)
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(where)
    return where


def session_pids(ray_dir: str) -> dict[str, int]:
    """This soak's Ray actors by role: processes whose environ carries our private RAY_TMPDIR."""
    mine = f"RAY_TMPDIR={ray_dir}".encode()
    found: dict[str, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mine not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        for role, marker in ROLES.items():
            if marker and cmd.startswith(marker):
                found[role] = int(pid)
    return found


def proc_figures(pid: int) -> dict[str, float]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mb": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}


def disk_mb(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass  # removed while we walked: the service prunes as it goes
    return total / 2**20


def config(model: str, steps: int, keep: int | None) -> dict:
    follow = {"groups_per_step": 1, "max_steps": steps, "max_off_policy_steps": 1, "poll_interval_s": 0.05,
              "inflight": "abort_resume"}
    if keep:
        follow["keep_broadcasts"] = keep
    return {"model": model, "engine": {"backend": "embedded", "options": {"max_model_len": 256},
                                       "backend_options": {"embedded": {"threads": 1}}},
            "env": {"name": "arithmetic", "options": {"difficulty": 1}}, "tasks": {"count": 64, "seed": 0},
            "group_size": 2, "max_turns": 1, "max_tokens_per_turn": 8, "max_tokens_per_rollout": 8,
            "sampling": {"temperature": 1.0, "seed": 0}, "follow": follow, "ray": {"num_cpus": 2}}


def verdict(samples: list[dict], warmup: int) -> dict[str, dict]:
    """For each process figure: its median over the first samples after the warm-up, its last value, flat?"""
    after = [s for s in samples if s["step"] >= warmup]
    base, last = after[:5], after[-1]
    out: dict[str, dict] = {}
    for role in ROLES:
        for key in ("rss_mb", "fds", "threads"):
            ref = statistics.median(s["procs"][role][key] for s in base)
            end = last["procs"][role][key]
            ok = end <= ref * 1.10
            out[f"{role}.{key}"] = {"after_warmup": round(ref, 1), "end": round(end, 1),
                                    "ratio": round(end / ref, 3) if ref else None, "flat": ok}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keep-broadcasts", type=int, default=2, help="0: off (the trainer owns old steps)")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--sample-every", type=int, default=5)
    args = ap.parse_args()
    if args.steps < args.warmup + 5 * args.sample_every:
        ap.error("--steps must leave five samples after --warmup")
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    run = out / "run"
    model = str(tiny_model(out / "model") if args.model == "tiny" else model_dir("smollm2-135m"))
    (out / "config.yaml").write_text(yaml.safe_dump(config(model, args.steps + 2, args.keep_broadcasts)))
    base = load_file(str(Path(model) / "model.safetensors"))
    nudged = "model.norm.weight"

    # a SIGTERM to this script unwinds it (the finally below stops the service's session) instead of orphaning it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ray_dir = tempfile.mkdtemp(prefix="tito-soak-ray-")
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_dir)
    log = open(out / "service.log", "w")
    service = subprocess.Popen([sys.executable, "-m", "actors.cli", "run", str(out / "config.yaml"), "--follow",
                                str(run)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples: list[dict] = []
    t0 = time.monotonic()
    try:
        with open(out / "soak.jsonl", "w") as jl:
            for k in range(1, args.steps + 1):
                read_step(run, k, timeout=600)
                if service.poll() is not None:
                    raise SystemExit(f"the service exited ({service.returncode}) at step {k}: see {out}/service.log")
                state = dict(base)
                state[nudged] = base[nudged] * (1 + 1e-3 * k)
                publish_weights(run, k, state, config=Path(model) / "config.json")
                if k % args.sample_every and k not in (1, args.steps):
                    continue
                pids = dict(session_pids(ray_dir), driver=service.pid)
                sample = {"step": k, "t_s": round(time.monotonic() - t0, 1),
                          "procs": {role: proc_figures(pid) for role, pid in pids.items()},
                          "broadcasts_mb": round(disk_mb(run / layout.BROADCASTS), 1),
                          "broadcast_steps": len(layout.step_numbers(run)),
                          "rollouts_mb": round(disk_mb(run / "rollouts"), 1)}
                samples.append(sample)
                jl.write(json.dumps(sample) + "\n")
                jl.flush()
                print(f"step {k}: " + "  ".join(f"{r} {p['rss_mb']:.0f} MB/{p['fds']} fds/{p['threads']} thr"
                                                 for r, p in sample["procs"].items())
                      + f"  broadcasts {sample['broadcast_steps']} steps {sample['broadcasts_mb']:.0f} MB", flush=True)
        # the service runs two batches past the last step (so that it is whole at the last sample): a trainer
        # that is done stops it as an operator would, with SIGTERM (exit 143, every sealed batch kept)
        os.killpg(service.pid, signal.SIGTERM)
        rc = service.wait(timeout=300)
    finally:
        if service.poll() is None:
            os.killpg(service.pid, signal.SIGTERM)
            service.wait(timeout=60)
        log.close()
        shutil.rmtree(ray_dir, ignore_errors=True)

    figures = verdict(samples, args.warmup)
    max_steps_on_disk = max(s["broadcast_steps"] for s in samples)
    disk_ok = not args.keep_broadcasts or max_steps_on_disk <= args.keep_broadcasts + 2
    result = {"steps": args.steps, "model": args.model, "keep_broadcasts": args.keep_broadcasts, "service_exit": rc,
              "wall_s": round(time.monotonic() - t0, 1), "figures": figures,
              "broadcast_steps_on_disk_max": max_steps_on_disk,
              "broadcasts_mb_max": max(s["broadcasts_mb"] for s in samples),
              "rollouts_mb_end": samples[-1]["rollouts_mb"], "disk_bounded": disk_ok}
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.steps} steps in {result['wall_s']:.0f} s, service exit {rc}; warm-up {args.warmup} steps")
    print("| process.figure | after warm-up | end | ratio | flat |\n| --- | --- | --- | --- | --- |")
    for name, f in figures.items():
        print(f"| {name} | {f['after_warmup']} | {f['end']} | {f['ratio']} | {'yes' if f['flat'] else 'NO'} |")
    print(f"broadcasts on disk: at most {max_steps_on_disk} steps, {result['broadcasts_mb_max']:.0f} MB "
          f"(keep_broadcasts {args.keep_broadcasts or 'off'}); rollouts {result['rollouts_mb_end']:.1f} MB")
    return 0 if rc == 128 + signal.SIGTERM and disk_ok and all(f["flat"] for f in figures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
