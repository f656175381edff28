"""Load test of `tito serve`: N concurrent clients on loopback, a fixed count of /inference/v1/generate requests.

    .venv/bin/python scripts/load_test.py [--url http://127.0.0.1:8000] [--concurrency 1,32,256] [--requests 4000]
                                          [--modes actors,in_process] [--prompt-tokens 128] [--max-tokens 16]
                                          [--repeats 3]
                                          [--write docs/benchmarks.md]

Without ``--url`` it starts ``tito serve`` itself in a subprocess (so client and server do not share a GIL),
once per ``--modes`` entry (engines as Ray actors, the default, and inside the server process): replay engines
in synthetic mode (``--engines``, no token pacing: the engine's own time is tiny, so what is measured is the
server) behind the SmolLM2 tokenizer. Each client sends its next request as soon as the
previous one is answered (closed loop), over a keep-alive connection.

Reported per concurrency level (median over ``--repeats`` rounds): requests/s, sampled tokens/s, client
latency p50/p99, errors (non-200 or transport failures), the engine's own time p50 (from each response's
``metrics.engine_s``: queue + prefill + decode as the engine reports it) and the server overhead p50/p99 =
the per-request difference latency - engine time, i.e. HTTP, JSON, validation, routing, the Ray actor
call and, at high concurrency, the wait for the server's event loop. ``--write`` replaces the section
between ``<!-- load_test:begin -->`` and ``<!-- load_test:end -->``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from benchdoc import markers, replace_section  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, in_process: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    options = "{synthetic: true, vocab_size: 49152, max_model_len: 8192, token_delay_s: 0}"
    cmd = [sys.executable, "-m", "actors.cli", "serve", "--port", str(port), "--set", f"model={args.model}",
           "--set", "engine.backend=replay", "--set", f"engine.count={args.engines}",
           "--set", f"engine.options={options}", "--set", "engine.max_concurrency=1024",
           "--set", "served_model_name=load-test"]
    if in_process:
        cmd += ["--set", "engine_in_process=true"]
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import urllib.request

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tito serve exited: {proc.stderr.read().decode()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError("tito serve did not become healthy in 180 s")


async def run_round(url: str, concurrency: int, total: int, prompt_tokens: int, max_tokens: int,
                    seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    bodies = [json.dumps({"model": "load-test", "token_ids": [rng.randrange(3, 49000) for _ in range(prompt_tokens)],
                          "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0,
                                              "seed": i, "logprobs": 1}}).encode()
              for i in range(min(total, 512))]
    latencies: list[float] = []
    overheads: list[float] = []
    engine: list[float] = []
    transport: list[float] = []  # the engine call as the server saw it, minus the engine's own time (Ray)
    tokens = 0
    errors = 0
    next_index = 0
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:

        async def client() -> None:
            nonlocal next_index, tokens, errors
            while next_index < total:
                i = next_index
                next_index += 1
                t0 = time.perf_counter()
                try:
                    async with http.post(url + "/inference/v1/generate", data=bodies[i % len(bodies)],
                                         headers={"Content-Type": "application/json"}) as resp:
                        payload = await resp.read()
                        status = resp.status
                except Exception:
                    errors += 1
                    continue
                elapsed = time.perf_counter() - t0
                if status != 200:
                    errors += 1
                    continue
                r = json.loads(payload)
                latencies.append(elapsed)
                engine_s = r["metrics"]["engine_s"]
                engine.append(engine_s)
                overheads.append(elapsed - engine_s)
                transport.append(r["metrics"]["engine_call_s"] - engine_s)
                tokens += r["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0

    def pct(values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        s = sorted(values)
        return s[min(len(s) - 1, int(q * len(s)))]

    return {"concurrency": concurrency, "requests": total, "ok": len(latencies), "errors": errors, "wall_s": wall,
            "requests_per_s": len(latencies) / wall, "tokens_per_s": tokens / wall,
            "latency_p50_ms": pct(latencies, 0.5) * 1e3, "latency_p99_ms": pct(latencies, 0.99) * 1e3,
            "engine_p50_ms": pct(engine, 0.5) * 1e3, "overhead_p50_ms": pct(overheads, 0.5) * 1e3,
            "overhead_p99_ms": pct(overheads, 0.99) * 1e3, "ray_call_p50_ms": pct(transport, 0.5) * 1e3}


def median_rounds(rounds: list[dict]) -> dict:
    out = dict(rounds[0])
    for key in rounds[0]:
        if key not in ("concurrency", "requests"):
            out[key] = statistics.median(r[key] for r in rounds)
    out["errors_total"] = sum(r["errors"] for r in rounds)
    return out


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}, {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def markdown(args, results: list[dict], note: str) -> str:
    begin, end = markers("load_test")
    lines = [begin, "## HTTP serving (`tito serve`, /inference/v1/generate)", "",
             f"Command: `.venv/bin/python scripts/load_test.py --modes {args.modes} --concurrency {args.concurrency} --requests "
             f"{args.requests} --prompt-tokens {args.prompt_tokens} --max-tokens {args.max_tokens} --repeats "
             f"{args.repeats} --write docs/benchmarks.md`  ",
             f"Machine: {machine()}; {time.strftime('%Y-%m-%d')}; no GPU. {note}", "",
             f"`tito serve` in its own process with {args.engines} replay engines (synthetic, no pacing: the "
             "engine's own time is tiny, so this measures the server), local Ray; clients are aiohttp on loopback "
             "in another process, closed loop over keep-alive connections. Medians of "
             f"{args.repeats} rounds; errors are summed over all rounds.", "",
             "| engines | clients | requests | errors | requests/s | sampled tokens/s | latency p50 ms | latency p99 ms "
             "| engine p50 ms | server overhead p50 ms | overhead p99 ms | engine call p50 ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        mode = {"actors": "Ray actors", "in_process": "in the server process"}.get(r["mode"], r["mode"])
        lines.append(f"| {mode} | {r['concurrency']} | {r['requests']} | {r['errors_total']} | {r['requests_per_s']:,.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['latency_p50_ms']:.2f} | {r['latency_p99_ms']:.2f} | "
                     f"{r['engine_p50_ms']:.3f} | {r['overhead_p50_ms']:.2f} | {r['overhead_p99_ms']:.2f} | "
                     f"{r['ray_call_p50_ms']:.2f} |")
    lines += ["", "Server overhead = client latency − the engine's own time, per request (HTTP parsing, msgspec "
              "decoding and validation, routing, the engine call, encoding); engine call = the call as the server "
              "saw it minus the engine's own time (with actors: the Ray round trip; `engine_in_process: true` "
              "removes it, for one-node serving). With one client it is the "
              "per-request cost; with many it also holds the wait for the server's single event loop (on 2 shared "
              "cores the client process, the server, the engine actors and Ray compete for the same CPUs), so at "
              "high concurrency it is queueing, not per-request work.", end]
    return "\n".join(lines) + "\n"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an already running `tito serve` (default: start one)")
    ap.add_argument("--model", default="smollm2-135m", help="tokenizer for the server started here")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--concurrency", default="1,32,256")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="actors,in_process",
                    help="engine placements to measure: actors (Ray actors, the default of tito serve), in_process")
    ap.add_argument("--note", default="", help="a note for the doc (e.g. that the machine was busy)")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    results = []
    for mode in ([None] if args.url else args.modes.split(",")):
        proc, url = (None, args.url) if args.url else start_server(args, mode == "in_process")
        try:
            await run_round(url, 16, 400, args.prompt_tokens, args.max_tokens, 0)  # warm-up
            for c in [int(x) for x in args.concurrency.split(",")]:
                total = args.requests if c > 1 else min(args.requests, 1000)
                rounds = [await run_round(url, c, total, args.prompt_tokens, args.max_tokens, k)
                          for k in range(args.repeats)]
                r = median_rounds(rounds)
                r["mode"] = mode or "given server"
                results.append(r)
                print(json.dumps(r), flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    section = markdown(args, results, args.note)
    if args.write:
        replace_section(args.write, "load_test", section)
        print(f"wrote {args.write}")
    else:
        print(section)


if __name__ == "__main__":
    asyncio.run(main())
