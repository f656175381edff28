"""Every name README.md and docs/ tell a reader to import is importable, and so is every name they told a
reader to import before rollout/ was regrouped into rooms (cli/, data/): code written against those
docs keeps working. Every source path the docs name exists."""

from __future__ import annotations

import importlib
import re

import pytest

from ._support import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# What README.md and docs/ imported at 0b22bf8, before the move into rooms (grep of `from rollout...` and
# dotted `rollout.x.y` in them then). These paths must keep working even where the docs now name new ones.
BEFORE_ROOMS = [
    "rollout.data.read_step", "rollout.data.open_shards", "rollout.data.sample_filter",
    "rollout.data.iter_samples", "rollout.data.shard_files",
    "rollout.packing.pack", "rollout.packing.pad", "rollout.packing.packed_logprobs",
    "rollout.packing.sampling_log_softmax",
    "rollout.export.export", "rollout.shards.ShardCorrupt",
    "rollout.follow.publish.publish_weights",
    "rollout.models.load_causal_lm",
    "rollout.engines.replay.ReplayEngine",
    "rollout.engines.protocol.GenerateRequest", "rollout.engines.protocol.SamplingParams",
    "rollout.envs.make_env", "rollout.envs.run_python", "rollout.envs.call_ids", "rollout.envs.evaluate",
    "rollout.cli.main",
]

_FROM_IMPORT = re.compile(r"from\s+((?:rollout|actors|tito_renderers)(?:\.\w+)*)\s+import\s+\(?([\w\s,]+)\)?")
_DOTTED = re.compile(r"`((?:rollout|actors)(?:\.\w+)+)")
_PATH = re.compile(r"`((?:rollout|actors|renderers|scripts|configs)/[\w/]+\.(?:py|yaml|sh))")


def _doc_names() -> list[str]:
    names: set[str] = set()
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for module, imported in _FROM_IMPORT.findall(text):
            names.update(f"{module}.{n.strip()}" for n in imported.split(",") if n.strip().isidentifier())
        names.update(_DOTTED.findall(text))
    return sorted(names)


def _resolve(dotted: str):
    """Import the longest module prefix of ``dotted``, then read the rest as attributes."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError as exc:
            if exc.name and not ".".join(parts[:k]).startswith(exc.name):
                raise  # the module exists but something it imports does not
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_docs_name_some_imports():
    # a guard for the regexes: if the docs' style changed so that nothing matched, every test below would pass
    names = _doc_names()
    assert "rollout.data.read_step" in names and "rollout.follow.publish.publish_weights" in names
    assert len(names) > 10


@pytest.mark.parametrize("name", _doc_names())
def test_every_name_the_docs_use_imports(name):
    _resolve(name)


@pytest.mark.parametrize("name", BEFORE_ROOMS)
def test_names_from_before_the_rooms_still_import(name):
    _resolve(name)


def test_moved_faces_are_the_same_objects():
    import rollout.data.export
    import rollout.data.packing
    import rollout.data.shards
    import rollout.export
    import rollout.packing
    import rollout.shards

    assert rollout.packing.pack is rollout.data.packing.pack
    assert rollout.export.export is rollout.data.export.export
    assert rollout.shards.ShardCorrupt is rollout.data.shards.ShardCorrupt


def test_every_source_path_the_docs_name_exists():
    missing = [f"{doc.name}: {path}" for doc in DOCS for path in _PATH.findall(doc.read_text(encoding="utf-8"))
               if not (REPO / path).exists()]
    assert not missing, missing
