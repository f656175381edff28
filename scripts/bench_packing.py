"""Trainer-side read benchmarks (a script, not a timed test).

    .venv/bin/python scripts/bench_packing.py [--size-gb 1.0] [--write docs/benchmarks.md]

1. Streaming: synthetic shards of about ``--size-gb`` on disk (one file of ~``--file-mb`` rows written
   with ``rollout.data.shards.ShardWriter``, then copied to reach the size), read back through
   ``rollout.data.readers.iter_samples`` (every sample's token arrays sliced out), and through the bare
   ``pyarrow.dataset`` scan for reference. The files were just written, so the OS page cache is warm:
   this measures decode + iteration, not the disk. The directory is deleted at the end.
2. Packing: ``rollout.data.packing.pack`` (seeded shuffle + first fit, building numpy rows) over the samples
   of one file, at two budgets; tokens/s.

Sample lengths are uniform in [64, 4096) tokens with a 30% prompt; medians of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from benchdoc import markers, replace_section  # noqa: E402

from rollout.data import iter_samples, open_shards  # noqa: E402
from rollout.data.packing import pack  # noqa: E402
from rollout.data.shards import ShardWriter  # noqa: E402


def synthetic_rows(n: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for i in range(n):
        length = int(rng.integers(64, 4096))
        prompt = max(1, int(length * 0.3))
        mask = [False] * prompt + [True] * (length - prompt)
        rows.append({
            "token_ids": rng.integers(0, 50000, length, dtype=np.int32).tolist(), "loss_mask": mask,
            "logprobs": np.where(mask, -rng.random(length, dtype=np.float32), 0).astype(np.float32).tolist(),
            "message_index": [0] * prompt + [1] * (length - prompt), "turn_index": [0] * length,
            "messages": "[]", "reward": float(i % 2), "reward_components": "{}", "advantage": float(i % 2) - 0.5,
            "task_id": f"t{i}", "group_id": f"g{i}", "rollout_id": f"r{i}", "segment_index": 0,
            "segment_count": 1, "finish_reason": "env_done", "breaks": "[]", "weight_version": 0, "model": "m",
            "renderer": "r", "template_sha256": "0", "prompt_tokens": prompt, "completion_tokens": length - prompt,
            "error": None,
        })
    return rows


def make_shards(directory: Path, size_gb: float, file_mb: int, rng: np.random.Generator) -> tuple[int, int]:
    """Write one ShardWriter file of about ``file_mb`` and copy it until the directory holds ``size_gb``.
    Returns (bytes, files)."""
    rows_per_file = max(1, int(file_mb * 2**20 / (2070 * 14.2)))  # ~14.2 bytes/token on disk, 2070 tokens mean
    w = ShardWriter(directory, stream="shard", fmt="arrow", rows_per_file=rows_per_file)
    w.add(synthetic_rows(rows_per_file, rng))
    w.close()
    first = next(directory.glob("shard-*.arrow"))
    size = first.stat().st_size
    files = 1
    while files * size < size_gb * 1e9:
        shutil.copyfile(first, directory / f"shard-{files:05d}.arrow")
        files += 1
    return files * size, files


def stream(directory: Path) -> tuple[float, int, int]:
    t = time.perf_counter()
    n = tokens = 0
    for s in iter_samples(directory, batch_size=1024):
        n += 1
        tokens += len(s.token_ids)
    return time.perf_counter() - t, n, tokens


def scan(directory: Path) -> float:
    t = time.perf_counter()
    for _ in open_shards(directory).to_batches(columns=["token_ids", "loss_mask", "logprobs", "advantage"]):
        pass
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--file-mb", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", help="where to create the temporary shard directory (default: system temp)")
    ap.add_argument("--write")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    res: dict = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-packing-") as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        res["bytes"], res["files"] = make_shards(d, args.size_gb, args.file_mb, rng)
        res["make_s"] = time.perf_counter() - t
        runs = [stream(d) for _ in range(args.repeat)]
        res["stream_s"] = statistics.median(r[0] for r in runs)
        res["samples"], res["tokens"] = runs[0][1], runs[0][2]
        res["scan_s"] = statistics.median(scan(d) for _ in range(args.repeat))
        one = list(iter_samples(next(d.glob("shard-*.arrow"))))
        res["pack"] = {}
        for budget in (8192, 32768):
            times = []
            for k in range(args.repeat):
                t = time.perf_counter()
                rows = pack(one, budget, seed=k)
                times.append(time.perf_counter() - t)
            toks = sum(len(s) for s in one)
            res["pack"][budget] = {"samples": len(one), "tokens": toks, "rows": len(rows),
                                   "fill": toks / (len(rows) * budget), "tok_s": toks / statistics.median(times)}
    gb = res["bytes"] / 1e9
    print(f"shards: {gb:.2f} GB in {res['files']} files, {res['samples']:,} samples, {res['tokens']:,} tokens "
          f"(made in {res['make_s']:.0f} s)")
    print(f"stream via iter_samples: {res['stream_s']:.2f} s ({gb / res['stream_s']:.2f} GB/s, "
          f"{res['tokens'] / res['stream_s'] / 1e6:.0f} M tok/s); bare pyarrow scan {res['scan_s']:.2f} s")
    for budget, p in res["pack"].items():
        print(f"pack budget {budget}: {p['tok_s'] / 1e6:.1f} M tok/s, {p['rows']} rows, fill {p['fill']:.1%}")
    if args.write:
        write(Path(args.write), res, args)
    return 0


def write(path: Path, res: dict, args: argparse.Namespace) -> None:
    begin, end = markers("bench_packing")
    gb = res["bytes"] / 1e9
    lines = [begin, "## Trainer-side reading and packing", "",
             f"Command: `.venv/bin/python scripts/bench_packing.py --size-gb {args.size_gb:g} --write docs/benchmarks.md`  ",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
             f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}; median of {args.repeat} runs.  ",
             "Synthetic shards written with `ShardWriter` (sample lengths uniform in [64, 4096), 30% prompt), "
             "read back right after writing, so the page cache is warm: decode and iteration, not disk speed.", "",
             "| measure | value |", "|---|---:|",
             f"| shard directory | {gb:.2f} GB, {res['files']} files, {res['samples']:,} samples, {res['tokens']:,} tokens |",
             f"| stream it through `iter_samples` (all token arrays sliced) | {res['stream_s']:.2f} s "
             f"({gb / res['stream_s']:.2f} GB/s, {res['tokens'] / res['stream_s'] / 1e6:.0f} M tokens/s) |",
             f"| bare `pyarrow.dataset` scan of the 4 training columns, for reference | {res['scan_s']:.2f} s |"]
    for budget, p in res["pack"].items():
        lines.append(f"| `pack` at budget {budget:,} ({p['samples']:,} samples) | {p['tok_s'] / 1e6:.1f} M tokens/s, "
                     f"{p['rows']} rows, {p['fill']:.1%} filled |")
    lines += ["", end]
    replace_section(path, "bench_packing", "\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
