"""Is the bridge flat in history? One never-seen ~150-token tool result bridged after 1, 10, 30 and 100
tool turns of history (bench_render.py's Qwen3 conversations), the lengths' rounds interleaved.

    .venv/bin/python scripts/bench_bridge_flat.py [--fixtures DIR] [--rounds 11] [--calls 2000] [--style multilingual]

Prints, for each history length, the prompt's tokens and the median us per bridge over the rounds; with
``--token-ids``, each bridge's ``token_ids`` (the whole next prompt, a copy of the history) is read too.
The machine is shared and noisy: the figures of one run, not of two, are comparable.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import bench_render as bench  # noqa: E402

import tito_renderers as renderers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.environ.get("TITO_FIXTURES", REPO.parent / "shared" / "fixtures"))
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--calls", type=int, default=2000, help="bridges per length per round")
    ap.add_argument("--style", default="multilingual", choices=("code", "multilingual"))
    ap.add_argument("--token-ids", action="store_true", help="read each bridge's token_ids too")
    args = ap.parse_args()

    tok = renderers.load_tokenizer(Path(args.fixtures) / "tokenizers" / "qwen3-0.6b")
    r = renderers.create_renderer(tok)
    setups = {}
    for turns in (1, 10, 30, 100):
        history = bench.conversation(turns, tok, args.style)[:-1]  # through the last assistant turn
        prompt = r.render_ids(history[:-1], bench.TOOLS, add_generation_prompt=True)
        turn = r.render_ids(history, bench.TOOLS)[len(prompt):]
        setups[turns] = (prompt, turn[: max(i for i, t in enumerate(turn) if t in r.stop_token_ids) + 1])
    rng = random.Random(1)
    results = [bench.tool_result(rng, 150, tok, args.style) for _ in range(64)]
    times: dict[int, list[float]] = {turns: [] for turns in setups}
    seen = 0
    for k in range(args.rounds):
        for turns in list(setups) if k % 2 else list(reversed(setups)):
            prompt, completion = setups[turns]
            fresh = [[{"role": "tool", "content": f"<{seen + j}> {results[(seen + j) % 64]}"}] for j in range(args.calls)]
            seen += args.calls
            t0 = time.perf_counter()
            for new in fresh:
                out = r.bridge(prompt, completion, new, bench.TOOLS)
                if args.token_ids:
                    out.token_ids  # noqa: B018  (built on first read)
            times[turns].append((time.perf_counter() - t0) / args.calls)
    for turns, t in times.items():
        print(f"{turns:4d} tool turns, {len(setups[turns][0]):6d} prompt tokens: {statistics.median(t) * 1e6:6.1f} us per bridge")


if __name__ == "__main__":
    main()
