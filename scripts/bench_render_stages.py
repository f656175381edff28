"""Where a cold render's time goes, stage by stage, timed in place on bench_render.py's Qwen3 conversations.

    .venv/bin/python scripts/bench_render_stages.py [--fixtures DIR] [--renders 1500]

For 1 and 10 tool turns (code and multilingual tool results), every render on never-seen content with
the encoding caches of message text emptied first, it prints the mean us of: message normalisation,
a render run by run (``Pieces``: the renderer's Python with each run encoded and attributed as it
ends), the same render collected (``LongPieces``: building the pieces, then one fastokens call, numpy
attribution and the four lists), fastokens alone on the same runs right after (a lower bound: its
word cache is warm), and the run-by-run render without the tool definitions. It also times the two ways of calling fastokens on
one render's runs, in place, alternating their order: one batch call (``encode_batch_flat``, a thread
pool) and one call in this thread (``encode_segments``). Means of in-place timings are what this
answers; ratios between rows of one run are the figures to read on a noisy machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import bench_render as bench  # noqa: E402

import tito_renderers as renderers  # noqa: E402
from tito_renderers.long_pieces import LongPieces  # noqa: E402
from tito_renderers.messages import normalize_messages, normalize_tools  # noqa: E402
from tito_renderers.pieces import Pieces, clear_caches  # noqa: E402


def stages(r, tok, msgs: list[dict], renders: int) -> dict[str, float]:
    fast = tok.fast_encoder
    names = ("normalise", "run by run", "long: pieces", "long: encode", "fastokens alone", "run by run, no tools",
             "batch call", "this thread")
    total = dict.fromkeys(names, 0.0)
    clock = time.perf_counter
    tools = normalize_tools(bench.TOOLS)
    for i in range(renders):
        clear_caches()
        m = bench.unique(msgs, f"stages{i}")
        t0 = clock()
        normalized = normalize_messages(m)
        t1 = clock()
        p = Pieces(tok)  # pieces and their encoding interleaved: each run encoded as a special token ends it
        r._render(p, normalized, tools, False)
        p.encode()
        t2 = clock()
        clear_caches()
        long = LongPieces(tok)
        r._render(long, normalized, tools, False)
        long.finish()
        t3 = clock()
        long.encode()
        t4 = clock()
        clear_caches()
        fast.joined(long.runs)  # the same runs once more: what the encoder alone costs (its word cache warm)
        t5 = clock()
        clear_caches()
        p = Pieces(tok)  # the same render without tool definitions: what they cost
        r._render(p, normalized, None, False)
        p.encode()
        t6 = clock()
        for name, dt in zip(names, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5), strict=False):
            total[name] += dt
        r.render(bench.unique(msgs, f"between{i}"), bench.TOOLS)  # other work between the two calls, as in use
        calls = (("batch call", fast.flat), ("this thread", fast.joined))
        for name, call in calls if i % 2 else calls[::-1]:
            t0 = clock()
            call(long.runs)
            total[name] += clock() - t0
    return {k: v / renders * 1e6 for k, v in total.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.environ.get("TITO_FIXTURES", REPO.parent / "shared" / "fixtures"))
    ap.add_argument("--renders", type=int, default=1500)
    args = ap.parse_args()
    tok = renderers.load_tokenizer(Path(args.fixtures) / "tokenizers" / "qwen3-0.6b")
    r = renderers.create_renderer(tok)
    for style in ("code", "multilingual"):
        for turns in (1, 10):
            msgs = bench.conversation(turns, tok, style)
            for i in range(50):  # warm up
                r.render(bench.unique(msgs, f"warm{i}"), bench.TOOLS)
            row = stages(r, tok, msgs, args.renders)
            print(f"{style:12s} {turns:2d} turns: " + ", ".join(f"{k} {v:.0f} us" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
