"""The ``tito`` command: rollout/cli.py's commands, with ``run`` and ``serve`` placing their actors on Ray.

This is the composition root: the one place that joins rollout/ (the commands) with actors/ (Ray), so
that imports run one way, rollout -> actors never. ``python -m actors.cli`` is the same command.
"""

from __future__ import annotations

import sys

from rollout.cli.main import main as rollout_main

from .placement import RayPlacement


def main(argv: list[str] | None = None) -> int:
    return rollout_main(argv, placement=RayPlacement())


if __name__ == "__main__":
    sys.exit(main())
