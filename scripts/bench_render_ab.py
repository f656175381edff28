"""A renderer change against a git revision, in one process: cold renders and bridges, interleaved rounds.

    .venv/bin/python scripts/bench_render_ab.py --base REV [--fixtures DIR] [--rounds 9] [--bridge]

The revision's ``renderers/`` is extracted with ``git archive`` into a temporary directory and imported
under another name next to the working tree's ``tito_renderers``; both render the same never-seen
Qwen3 conversations of bench_render.py (1 / 10 / 30 tool turns, code and multilingual tool results),
alternating which goes first each round, after checking that both give the same tokens and attribution.
Prints each side's median ms per call and base / working tree.
On a shared machine, only the ratio is worth reading: both sides see the same noise.
"""

from __future__ import annotations

import argparse
import importlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import bench_render as bench  # noqa: E402

import tito_renderers  # noqa: E402


def load_base(rev: str, where: Path):
    """The revision's renderers package, imported as ``base_renderers``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "renderers"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    (where / "renderers").rename(where / "base_renderers")
    sys.path.insert(0, str(where))
    return importlib.import_module("base_renderers")


def interleaved(fns: dict, inputs: list, per_round: int, rounds: int) -> dict[str, float]:
    """Median ms per call of each function, every call on its own input, the order alternating."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    i = 0
    for k in range(rounds):
        for name in (list(fns) if k % 2 == 0 else list(reversed(fns))):
            chunk = inputs[i * per_round : (i + 1) * per_round]
            i += 1
            t0 = time.perf_counter()
            for x in chunk:
                fns[name](x)
            times[name].append((time.perf_counter() - t0) / per_round * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="git revision to compare the working tree with")
    ap.add_argument("--fixtures", default=os.environ.get("TITO_FIXTURES", REPO.parent / "shared" / "fixtures"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--bridge", action="store_true", help="time bridges instead of cold renders")
    args = ap.parse_args()
    path = Path(args.fixtures) / "tokenizers" / "qwen3-0.6b"
    with tempfile.TemporaryDirectory() as tmp:
        sides = {}
        for name, module in (("base", load_base(args.base, Path(tmp))), ("tree", tito_renderers)):
            tok = module.load_tokenizer(path)
            clear = importlib.import_module(module.__name__ + ".pieces").clear_caches
            sides[name] = (tok, module.create_renderer(tok), clear)
        tok0, r0, _ = sides["base"]
        for style in ("code", "multilingual"):
            for turns in (1, 10, 30):
                msgs = bench.conversation(turns, tok0, style)
                if args.bridge:
                    fns, inputs, n = bridges(sides, r0, tok0, msgs, style, args.rounds)
                else:
                    n = {1: 200, 10: 60, 30: 25}[turns]
                    inputs = [bench.unique(msgs, f"ab{i}") for i in range(n * (2 * args.rounds + 1))]
                    fns = {name: (lambda m, r=r, clear=clear: (clear(), r.render(m, bench.TOOLS)))
                           for name, (_, r, clear) in sides.items()}
                    for fn in fns.values():  # warm up on inputs no round uses
                        for m in inputs[-n:]:
                            fn(m)
                same_output(fns, inputs[-n:])
                med = interleaved(fns, inputs, n, args.rounds)
                print(f"{style:12s} {turns:2d} turns: base {med['base']:.4f} ms, tree {med['tree']:.4f} ms "
                      f"({med['base'] / med['tree']:.2f}x)", flush=True)


def same_output(fns: dict, inputs: list) -> None:
    """A speed-up that changes a token or its attribution is a bug: both sides must agree on every input."""
    for x in inputs:
        base, tree = (fns[name](x) for name in ("base", "tree"))
        base, tree = (out[-1] if isinstance(out, tuple) else out for out in (base, tree))  # a render: (None, tokens)
        for field in ("token_ids", "message_indices", "sampled_mask", "is_content"):
            got, want = (getattr(getattr(out, "appended", out), field) for out in (tree, base))
            if got != want:
                raise SystemExit(f"the working tree's {field} differ from the base revision's on {str(x)[:200]}")


def bridges(sides: dict, r0, tok0, msgs: list[dict], style: str, rounds: int):
    """Bridge calls appending one never-seen ~150-token tool result, as bench_render.py times them."""
    hist = msgs[:-1]
    prompt = r0.render_ids(hist[:-1], bench.TOOLS, add_generation_prompt=True)
    turn = r0.render_ids(hist, bench.TOOLS)[len(prompt):]
    completion = turn[: max(i for i, t in enumerate(turn) if t in r0.stop_token_ids) + 1]
    rng = random.Random(1)
    results = [{"role": "tool", "content": f"[{i}] " + bench.tool_result(rng, 150, tok0, style)} for i in range(64)]
    n = 1000
    inputs = [[dict(results[i % 64], content=f"<{i}> {results[i % 64]['content']}")] for i in range(n * (2 * rounds + 1))]
    fns = {name: (lambda m, r=r: r.bridge(prompt, completion, m, bench.TOOLS)) for name, (_, r, _) in sides.items()}
    for fn in fns.values():
        for m in inputs[-n:]:
            fn(m)
    return fns, inputs, n


if __name__ == "__main__":
    main()
