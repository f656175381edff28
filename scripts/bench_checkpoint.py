"""What checkpoint validation costs (rollout/engines/checkpoint.py, run by every ``update_weights`` before the
engine drains) against loading the same checkpoint: SmolLM2-135M's safetensors directory (the default model's
GGUF converted into the cache, 540 MB fp32), in the page cache; medians of interleaved rounds.

    .venv/bin/python scripts/bench_checkpoint.py [--repeats 5] [--write docs/benchmarks.md]

Rows: ``load_file`` (safetensors' plain load: it memory-maps the file, so no value is read yet); the same plus
one pass over every value (the least a load that uses the weights reads); the validation without values
(headers: names, shapes, dtypes) and with them (what update_weights runs); the per-tensor
``torch.isfinite(t).all()`` scan the fast path replaces; and ``load_causal_lm`` (the embedded engine's load that
follows a validation).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout.engines.checkpoint import expected_from_dir, validate_checkpoint  # noqa: E402
from rollout.models import load_causal_lm, model_dir  # noqa: E402
from scripts.benchdoc import markers, replace_section  # noqa: E402


def _load_file(path: Path) -> None:
    from safetensors.torch import load_file

    load_file(str(path / "model.safetensors"))


def _load_file_and_read(path: Path) -> None:
    from safetensors.torch import load_file

    for t in load_file(str(path / "model.safetensors")).values():
        t.sum()


def _isfinite_all(path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            assert bool(torch.isfinite(f.get_tensor(name)).all())


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--write", type=Path)
    args = ap.parse_args()
    path = model_dir("smollm2-135m", fetch=True)
    expected = expected_from_dir(path)
    report = validate_checkpoint(path, expected, check_values=False)
    size_mb = report.bytes / 2**20
    rows: dict[str, tuple] = {
        "`safetensors.torch.load_file` (memory-maps; reads no value)": (_load_file, path),
        "`load_file` + one pass over every value (`t.sum()`)": (_load_file_and_read, path),
        "validation, headers only (`check_values=False`)":
            (lambda p: validate_checkpoint(p, expected, check_values=False), path),
        "**validation, full** (what `update_weights` runs)": (lambda p: validate_checkpoint(p, expected), path),
        "per-tensor `torch.isfinite(t).all()` (the scan the fast path replaces)": (_isfinite_all, path),
        "`load_causal_lm` (the embedded engine's load after the validation)": (load_causal_lm, path),
    }
    for fn, arg in rows.values():  # warm-up: page cache, imports
        fn(arg)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):  # interleaved: each round times every row
        for name, (fn, arg) in rows.items():
            times[name].append(_timed(fn, arg))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    names = list(rows)
    plain, read, full, model_load = med[names[0]], med[names[1]], med[names[3]], med[names[5]]
    load = os.getloadavg()[0]
    lines = ["## Checkpoint validation before a weight update (issue 31)", "",
             f"Command: `.venv/bin/python scripts/bench_checkpoint.py --repeats {args.repeats} "
             "--write docs/benchmarks.md`  ",
             f"Machine: 2-core VM shared with other work ({platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads), Python {platform.python_version()}; "
             f"{time.strftime('%Y-%m-%d')}; 1-minute load {load:.1f}. SmolLM2-135M-Instruct as the fp32 safetensors "
             f"directory the GGUF converts into ({report.tensors} tensors, {size_mb:.0f} MB, one file), in the "
             f"page cache; median of {args.repeats} interleaved rounds.", "",
             "| what | median ms | x load_file | x load_file + read |", "|---|---:|---:|---:|"]
    for name in rows:
        lines.append(f"| {name} | {med[name] * 1000:.1f} | {med[name] / plain:.1f} | {med[name] / read:.2f} |")
    lines += ["", f"The full validation reads every value once (one `t.sum()` per tensor, finite only if every element "
              "is; NaN/inf are counted exactly only when it is not). `load_file` alone reads none: its tensors are "
              f"views of the mapped file until used, so against it the ratio is {full / plain:.0f}x, while the "
              f"headers-only check is {med[names[2]] / plain:.1f}x. Against the same bytes read once it is "
              f"{full / read:.2f}x: the check costs one pass over the checkpoint. `load_causal_lm` (transformers 5) "
              "is lazy too: its parameters stay memory-mapped (the process's file-backed RSS grows by the 512 MB "
              "only when a forward pass reads them), so the engine's first forward after the swap pays that pass "
              f"again; the validation is {full / model_load:.1f}x the load call itself. The literal "
              f"`torch.isfinite(t).all()` scan costs {med[names[4]] / full:.1f}x the fast path. The check runs on a "
              "worker thread before the engine drains (requests go on meanwhile), and an unchanged checkpoint that "
              "passed `validate_weights` is not read again by `update_weights`; in a `tito serve` fleet of several "
              "engines, the others check again inside their `update_weights`, while paused."]
    body = "\n".join(lines)
    print(body)
    if args.write:
        begin, end = markers("bench_checkpoint")
        replace_section(args.write, "bench_checkpoint", f"{begin}\n{body}\n{end}")


if __name__ == "__main__":
    main()
