"""The ids-only bridge on content mutants (tests/mutants.py): counts per tokenizer x template.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/measure_mutants.py [--n 2] [--seed 7] [--per 0] [--renderers DIR] [ID ...]

For every corpus template (tests/bridge_gaps.py) whose id contains one of ``ID`` (all where none), the
mutants of ``--n`` seeded conversations (every slot x every change; ``--per K``: K drawn per
conversation) are rendered and bridged turn by turn from transformers' ids on a fresh renderer. Prints a
markdown table (the counts of tests/bridge_gaps.py's ``measure``), then up to 20 examples of anything
bad; exit 1 on a needless break, a wrong bridge, a drift (but the keep-reasoning splice's) or a render unequal to transformers'.
``--renderers DIR`` measures another checkout's renderers/ (the "before" figures, as in
scripts/measure_bridge_gaps.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# the keep-reasoning splice of these templates drifts by design (docs/renderers.md): not counted as bad
KEEPS_REASONING = ("qwen3", "qwen3.5", "gpt-oss")
KEYS = ("turns", "stable", "breaks", "needless", "ambiguous", "wrong", "drift", "exact", "unequal", "skipped")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="only templates whose id contains one of these")
    parser.add_argument("--n", type=int, default=2, help="base conversations per template (default 2)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--per", type=int, default=0, help="mutants drawn per conversation (0: every one)")
    parser.add_argument("--mutated-templates", action="store_true", help="also the corpus's template mutations")
    parser.add_argument("--renderers", help="measure this renderers/ directory instead of the installed one")
    args = parser.parse_args()
    if args.renderers:
        from scripts.measure_bridge_gaps import _use_renderers

        _use_renderers(args.renderers)
    from tests.bridge_gaps import NotApplicable, corpus, measure_conversations
    from tests.mutants import MarkersAsText, mutants

    print(f"| tokenizer | template | mutants | {' | '.join(KEYS)} | s |")
    print("|---|---|---:|" + "---:|" * len(KEYS) + "---:|")
    totals = dict.fromkeys(KEYS, 0)
    examples: list = []
    for entry in corpus(mutate=args.mutated_templates):
        if args.ids and not any(i in entry.id for i in args.ids):
            continue
        start = time.perf_counter()
        counts = dict.fromkeys(KEYS, 0)
        n_mutants = 0
        try:
            reference = MarkersAsText(entry)
            for label, messages, tools in mutants(entry, args.seed, args.n, args.per or None):
                n_mutants += 1
                found: list = []
                c = measure_conversations(reference, [(messages, tools)], found)
                examples += [(label, *e) for e in found]
                for key in KEYS:
                    counts[key] += c[key]
        except NotApplicable:
            continue
        for key in KEYS:
            totals[key] += counts[key]
        if entry.id.split("@")[0] not in KEEPS_REASONING:
            totals["bad drift"] = totals.get("bad drift", 0) + counts["drift"]
        print(f"| {entry.tokenizer} | {entry.id.split('@')[0]} | {n_mutants} | "
              f"{' | '.join(str(counts[k]) for k in KEYS)} | {time.perf_counter() - start:.0f} |", flush=True)
    print("totals:", totals)
    for example in examples[:20]:
        print("bad:", example, file=sys.stderr)
    return 1 if totals["needless"] or totals["wrong"] or totals.get("bad drift") or totals["unequal"] else 0


if __name__ == "__main__":
    sys.exit(main())
