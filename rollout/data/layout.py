"""The run directory that a trainer and ``tito run --follow`` share, and nothing else.

::

    RUN_DIR/
      broadcasts/step_N/      the trainer's weights for version N: *.safetensors (config.json optional), then
                              an empty STABLE file written last (a directory without STABLE is never read)
      rollouts/step_k/        batch k (k = 1, 2, ...): a complete ``tito run`` output directory
                              (data/ shards, _summary.json, then _manifest.json written last: its
                              presence means the batch is sealed and will never change)
      metrics.jsonl           one JSON object per sealed batch

Version N is the policy after N trainer steps (0 = the model the service started with). Batch k is
what the trainer's step k trains on, so the on-policy version for batch k is k - 1.
"""

from __future__ import annotations

import re
from pathlib import Path

BROADCASTS = "broadcasts"
ROLLOUTS = "rollouts"
STABLE = "STABLE"
METRICS = "metrics.jsonl"
SEALED = "_manifest.json"  # rollout.data.shards.MANIFEST: written last, so it marks a sealed batch

# canonical decimals only: ``step_01`` would parse as 1 while broadcast_dir(1) names ``step_1``; versions are int32
# in the shards (weight_versions), so ``step_`` + 30 digits would otherwise outrank every real step
_STEP = re.compile(r"step_(0|[1-9][0-9]{0,9})")
MAX_VERSION = 2**31 - 1


def broadcast_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / BROADCASTS / f"step_{version}"


def step_dir(run_dir: str | Path, k: int) -> Path:
    return Path(run_dir) / ROLLOUTS / f"step_{k}"


def step_number(path: Path) -> int | None:
    """N of a ``step_N`` directory name; None for any other name (temporaries, stray files)."""
    m = _STEP.fullmatch(path.name)
    return int(m.group(1)) if m and int(m.group(1)) <= MAX_VERSION else None


def stable_versions(run_dir: str | Path) -> list[int]:
    """The versions whose broadcast is complete (``STABLE`` present), ascending. A symlinked step is not one: a
    trainer writes real directories, and a link could point the engines at weights outside the run directory."""
    root = Path(run_dir) / BROADCASTS
    if not root.is_dir():
        return []
    found = (step_number(p) for p in root.iterdir()
             if not p.is_symlink() and p.is_dir() and (p / STABLE).is_file())
    return sorted(n for n in found if n is not None)


def step_numbers(run_dir: str | Path) -> list[int]:
    """The N of every real ``broadcasts/step_N`` directory, stable or not, ascending."""
    root = Path(run_dir) / BROADCASTS
    if not root.is_dir():
        return []
    found = (step_number(p) for p in root.iterdir() if not p.is_symlink() and p.is_dir())
    return sorted(n for n in found if n is not None)


def not_broadcasts(run_dir: str | Path) -> dict[str, str]:
    """Entries of ``broadcasts/`` named like a step that are not one (name -> why): a name that is not a canonical
    ``step_N`` (``step_01``, ``step_abc``, ``step_-1``, ``step_`` + 30 digits), or a symlink. Hidden temporaries
    and ``step_0`` (the service's starting model) are not listed."""
    root = Path(run_dir) / BROADCASTS
    if not root.is_dir():
        return {}
    out = {}
    for p in root.iterdir():
        if not p.name.startswith("step_"):
            continue
        if step_number(p) is None:
            out[p.name] = f"not a canonical step_N name (N a decimal from 1 to {MAX_VERSION}, no leading zeros)"
        elif p.is_symlink():
            out[p.name] = "a symlink (a trainer writes real directories; a link could point outside the run)"
    return out


def is_sealed(run_dir: str | Path, k: int) -> bool:
    return (step_dir(run_dir, k) / SEALED).is_file()


def step_dirs(run_dir: str | Path) -> dict[int, Path]:
    """Every ``rollouts/step_k`` directory, sealed or not, by k."""
    root = Path(run_dir) / ROLLOUTS
    if not root.is_dir():
        return {}
    found = {step_number(p): p for p in root.iterdir() if p.is_dir()}
    return {k: p for k, p in found.items() if k is not None}
