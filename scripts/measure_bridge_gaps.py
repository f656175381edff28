"""Needless breaks and wrong bridges of the ids-only bridge over the gap-finding corpus (tests/bridge_gaps.py).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/measure_bridge_gaps.py [--n 12] [--seed 7] [--renderers DIR] [ID ...]
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/measure_bridge_gaps.py --verify 500

For every template of the corpus (fixtures, mistral-common's generated templates for every TemplateConfig,
Llama-2-style ``[INST]`` templates and mechanical mutations), ``--n`` seeded conversations are bridged turn
by turn from transformers' ids on a fresh renderer with no history. ``--renderers DIR`` measures another
checkout's renderers/ (the "before" figures: ``git worktree add /tmp/base <commit>``, then
``--renderers /tmp/base/renderers``). Prints a markdown table; exit 1 on any needless break, wrong bridge
or render unequal to transformers' (``unequal``: parity of the renderer's own render). ``ambiguous``
breaks (ids that fit two conversations continuing differently, checked with transformers) are the
contract and counted apart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _use_renderers(path: str) -> None:
    """Import ``tito_renderers`` from ``path`` (a renderers/ directory) instead of the installed one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tito_renderers", Path(path) / "__init__.py",
                                                  submodule_search_locations=[path])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tito_renderers"] = module
    spec.loader.exec_module(module)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="only templates whose id contains one of these")
    parser.add_argument("--n", type=int, default=12, help="conversations per template (default 12)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--renderers", help="measure this renderers/ directory instead of the installed one")
    parser.add_argument("--verify", type=int, metavar="N", help="only check that every converted shipped "
                        "tokenizer file encodes N seeded texts as mistral-common does, and exit")
    args = parser.parse_args()
    if args.verify:
        from tests.shipped_mistral import FILES, mismatches, texts

        sample = texts(args.verify, seed=args.seed)
        bad = {name: mismatches(name, sample) for name in FILES}
        for name, wrong in bad.items():
            print(f"{name}: {len(wrong)} mismatches of {len(sample)} texts", *wrong[:5], sep="\n  ")
        return 1 if any(bad.values()) else 0
    if args.renderers:
        _use_renderers(args.renderers)
    from tests.bridge_gaps import table

    examples: list = []
    totals = table(args.ids, args.seed, args.n, examples)
    for example in examples[:20]:
        print("needless/wrong:", example, file=sys.stderr)
    return 1 if totals["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())
