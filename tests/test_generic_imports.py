"""The generic renderer's modules import one way: generic -> generic_bridge -> full_bridge, recover,
conversations, and none of those back up to generic or generic_bridge, not even for a type hint."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RENDERERS = Path(__file__).resolve().parent.parent / "renderers"
BELOW = {
    "conversations": {"generic", "generic_bridge", "full_bridge", "recover"},
    "full_bridge": {"generic", "generic_bridge", "recover"},
    "recover": {"generic", "generic_bridge"},
    "generic_bridge": {"generic"},
}


def _imported(module: str) -> set[str]:
    """The sibling modules ``renderers/<module>.py`` imports anywhere (under TYPE_CHECKING too)."""
    tree = ast.parse((RENDERERS / f"{module}.py").read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is not None:
                out.add(node.module.split(".")[0])
            else:
                out.update(alias.name for alias in node.names)
    return out


@pytest.mark.parametrize("module", sorted(BELOW))
def test_no_import_runs_back_up(module: str) -> None:
    back = _imported(module) & BELOW[module]
    assert not back, f"renderers/{module}.py imports {sorted(back)}, which import it: a circle"
