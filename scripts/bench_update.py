"""How long a weight update keeps the embedded engine from generating: from the ``update_weights`` (or
``load_lora_adapter``) call until it returns, the engine then sampling under the new weights, while requests
run. SmolLM2-135M (fp32, 540 MB) on CPU, checkpoints in the page cache; medians of interleaved rounds.

    .venv/bin/python scripts/bench_update.py [--repeats 5] [--write docs/benchmarks.md]

Rows, each with 4 long requests (``max_tokens`` 400) running when the call is made:

* full checkpoint, ``keep_running=True`` (what ``/update_weights`` does: the running requests are kept and go on
  under the new weights at the next step boundary);
* full checkpoint, drained (``keep_running=False``: the update waits for the running requests to finish);
* the served weights republished (prime-rl's ``step_0``): compared, nothing loaded;
* a LoRA adapter (rank 8 on every projection, prime-rl's per-step ``/load_lora_adapter``), swapped in place.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from rollout.follow.publish import publish_weights  # noqa: E402
from rollout.models import load_causal_lm, model_dir  # noqa: E402
from scripts.benchdoc import markers, replace_section  # noqa: E402

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]


def checkpoints(root: Path, engine: EmbeddedEngine) -> dict[str, Path]:
    import peft

    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    other = dict(state, **{"model.norm.weight": state["model.norm.weight"] * 1.01})
    out = {"full": publish_weights(root, 1, other, config=engine.model.config.to_dict()),
           "same": publish_weights(root, 2, state, config=engine.model.config.to_dict())}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = peft.get_peft_model(load_causal_lm(engine.model_name), peft.LoraConfig(r=8, lora_alpha=16,
                                                                                  target_modules=targets))
    lora.save_pretrained(str(root / "adapter"))
    out["adapter"] = root / "adapter"
    return out


async def one_round(engine: EmbeddedEngine, paths: dict[str, Path], version: int, tag: str) -> dict[str, float]:
    times = {}
    await engine.load_lora_adapter("bench", str(paths["adapter"]))  # first load: the rows time reloads
    cases = {
        "full checkpoint, kept in flight (`/update_weights`)":
            lambda v: engine.update_weights(str(paths["full"]), v, keep_running=True),
        "full checkpoint, drained (waits for the running requests)":
            lambda v: engine.update_weights(str(paths["full"]), v),
        "served weights republished (prime-rl's `step_0`)":
            lambda v: engine.update_weights(str(paths["same"]), v, keep_running=True),
        "LoRA adapter, swapped in place (`/load_lora_adapter`)":
            lambda v: engine.load_lora_adapter("bench", str(paths["adapter"]), v),
    }
    for i, (name, call) in enumerate(cases.items()):
        running = [asyncio.create_task(engine.generate(GenerateRequest(
            f"{tag}-{i}-{j}", list(PROMPT), SamplingParams(max_tokens=400, ignore_eos=True, seed=j),
            lora="bench" if j % 2 else None))) for j in range(4)]
        while engine.stats["decode_tokens"] < 1 or not engine._running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        version += 1
        t0 = time.perf_counter()
        await call(version)
        times[name] = time.perf_counter() - t0
        for j in range(4):
            await engine.abort(f"{tag}-{i}-{j}")
        await asyncio.gather(*running)
    return times


async def run(repeats: int) -> tuple[dict[str, list[float]], int]:
    engine = EmbeddedEngine(str(model_dir("smollm2-135m", fetch=True)), threads=1, max_batch=8, max_model_len=1024)
    with tempfile.TemporaryDirectory() as tmp:
        paths = checkpoints(Path(tmp), engine)
        await engine.validate_weights(str(paths["full"]))  # page cache
        times: dict[str, list[float]] = {}
        version = 10
        for r in range(repeats + 1):
            got = await one_round(engine, paths, version, f"r{r}")
            version += 10
            if r:  # round 0 warms up
                for name, t in got.items():
                    times.setdefault(name, []).append(t)
        await engine.close()
    return times, torch.get_num_threads()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    times, threads = asyncio.run(run(args.repeats))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ref = next(iter(med.values()))
    lines = ["## Weight updates: from the call to generating again (issue 39)", "",
             f"Command: `.venv/bin/python scripts/bench_update.py --repeats {args.repeats} --write docs/benchmarks.md`  ",
             f"Machine: 2-core VM shared with other work ({platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, {threads} threads), Python {platform.python_version()}; {time.strftime('%Y-%m-%d')}; "
             f"1-minute load {os.getloadavg()[0]:.1f}. The embedded engine (SmolLM2-135M fp32, 8 rows), 4 requests of "
             f"400 tokens running at each call (half with the adapter); median of {args.repeats} interleaved rounds.",
             "", "| update | median s | x kept full checkpoint |", "|---|---:|---:|"]
    lines += [f"| {name} | {med[name]:.3f} | {med[name] / ref:.2f} |" for name in med]
    lines += ["", "The kept update validates the checkpoint on a worker thread while the requests run, then swaps it "
              "at the next step boundary; the drained one also waits for the longest running request (here ~400 "
              "tokens), which is what prime-rl's `pause(mode=keep)` avoids. The republished served weights are compared "
              "tensor by tensor (one pass over the file, after the same validation) and nothing is rebuilt: it costs "
              "about what a load does here, and its gain is the session KV kept; the adapter is read, checked and "
              "swapped between two steps. `/metrics` reports each `/update_weights` call as "
              "`tito_weight_update_seconds`."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        begin, end = markers("bench_update")
        replace_section(args.write, "bench_update", f"{begin}\n{body}\n{end}")


if __name__ == "__main__":
    main()
