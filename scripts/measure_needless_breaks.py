"""Needless breaks of the generic renderer's bridge called with ids alone, on every fixture template.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/measure_needless_breaks.py [FAMILY ...]

For every assistant turn of the tests' multi-turn conversations (tests/test_generic_bridge.py and
tests/test_generic_full_bridge.py ALL_CONVS: plain chat and tool rounds, with and without system prompt
and tools), the previous prompt and completion are transformers' ids and a fresh renderer bridges them
with no history: a break is needless where transformers' full render does extend the previous ids.
Every bridge is checked to keep the previous ids and to equal the reference where it is append-stable.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def main(only: list[str]) -> int:
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
    return 1 if needless_total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
