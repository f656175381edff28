"""Replacing one script's section of docs/benchmarks.md, atomically.

A section is delimited by ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``; a missing one is appended.
"""

from __future__ import annotations

import os
from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_section(path: Path, name: str, body: str) -> None:
    """Write ``body`` (which starts and ends with the section's markers) in place of the old section."""
    begin, end = markers(name)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + body.strip("\n") + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + body.strip("\n") + "\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
