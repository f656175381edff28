"""How many needless breaks the ids-only bridge has left: the one command that says so.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/measure_needless_breaks.py [--seed 7] [--n 12] [ID ...]

Two tables, then one line of totals; exit 1 on any needless break, wrong bridge or unequal render.

1. Every fixture template, on the tests' multi-turn conversations (tests/test_generic_bridge.py and
   tests/test_generic_full_bridge.py ALL_CONVS: plain chat and tool rounds, with and without system
   prompt and tools).
2. The gap-finding corpus of tests/bridge_gaps.py (templates no test was written for: mistral-common's
   generated templates for every TemplateConfig, spm on and off, with and without tools; its shipped
   tokenizer files; Llama-2-style ``[INST]`` templates; mechanical mutations of the fixture templates),
   on ``--n`` seeded conversations (``--seed``). scripts/measure_bridge_gaps.py runs this part alone,
   and against another checkout's renderers.

In both, the previous prompt and completion are transformers' ids and a fresh renderer bridges them with
no history: a break is needless where transformers' full render does extend the previous ids (an
``ambiguous`` one, where two conversations render to those ids and continue differently, is the
contract and is counted apart). Every bridge is checked to keep the previous ids and to equal the
reference where it is append-stable.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.bridge_gaps import table  # noqa: E402
from tests.family_checks import Family, bridge_cases  # noqa: E402
from tests.test_generic_bridge import ALL_CONVS as PLAIN_CONVS  # noqa: E402
from tests.test_generic_bridge import FAMILIES as APPEND_ONLY  # noqa: E402
from tests.test_generic_bridge import renderable  # noqa: E402
from tests.test_generic_full_bridge import ALL_CONVS as TOOL_CONVS  # noqa: E402
from tests.test_generic_full_bridge import ALL_FAMILIES as NOT_APPEND_ONLY  # noqa: E402
from tito_renderers import Break  # noqa: E402

EXTRA = [
    Family("deepseek-v3.1", "deepseek-v3", "deepseek-ai-DeepSeek-V3.1.jinja", renderer_name="generic"),
    Family("qwen3.5", "qwen3-0.6b", "Qwen-Qwen3.5-4B.jinja", renderer_name="generic"),
]


def fixture_table(only: list[str]) -> int:
    """Part 1: the needless breaks over the fixture templates (printed per template)."""
    families = list({f.id: f for f in [*NOT_APPEND_ONLY, *(f for f, _ in APPEND_ONLY), *EXTRA]}.values())
    print("| template | turns | append-stable | breaks | needless | exact | s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    needless_total = 0
    for family in families:
        if only and family.id not in only:
            continue
        start = time.perf_counter()
        c = {"turns": 0, "stable": 0, "breaks": 0, "needless": 0, "exact": 0}
        for case in bridge_cases(family, family.renderer(), renderable(family, TOOL_CONVS + PLAIN_CONVS)):
            result = family.renderer().bridge(case.prompt, case.completion, case.new, case.tools)
            c["turns"] += 1
            c["stable"] += case.stable
            if isinstance(result, Break):
                c["breaks"] += 1
                c["needless"] += case.stable
                continue
            assert result.token_ids[: result.prefix_len] == case.prompt + case.completion, family.id
            if case.stable:
                assert result.token_ids == case.expected, f"{family.id}: turn {case.k} differs from the reference"
                c["exact"] += 1
        needless_total += c["needless"]
        print(f"| {family.id} | {c['turns']} | {c['stable']} | {c['breaks']} | {c['needless']} | {c['exact']} | "
              f"{time.perf_counter() - start:.1f} |")
    return needless_total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="only templates whose id is one of these (fixtures) or contains one (corpus)")
    parser.add_argument("--n", type=int, default=12, help="corpus conversations per template (default 12)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    print("Fixture templates, the tests' conversations:\n")
    fixtures = fixture_table(args.ids)
    print(f"\nThe gap-finding corpus (tests/bridge_gaps.py), seed {args.seed}, {args.n} conversations per template:\n")
    corpus = table(args.ids, args.seed, args.n)
    print(f"\nneedless breaks left: {fixtures + corpus['needless']} ({fixtures} on the fixtures, {corpus['needless']} "
          f"of {corpus.get('turns', 0)} corpus turns); corpus: {corpus.get('ambiguous', 0)} ambiguous, "
          f"{corpus.get('wrong', 0)} wrong, {corpus.get('unequal', 0)} unequal")
    return 1 if fixtures or corpus["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
