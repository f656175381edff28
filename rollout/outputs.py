"""A ``tito run`` output directory as a whole: which groups the shards already hold (for ``--resume``),
the repair of groups an older version left split or duplicated, the run config a resume must match,
and ``_manifest.json`` / ``_summary.json`` rebuilt from the files on disk.

Resume rule (docs/rollout.md): a group is *complete* when the files hold exactly ``group_size``
distinct rollouts of it, ``<task_id>#0`` .. ``#G-1``, each with its segments 0..n-1 exactly once.
Complete groups are skipped. Any other rows of a group (a partial group, or a group written twice by
a version that split groups across files) are removed from their files — each such file is rewritten
atomically without them — and the whole group is run again, so its advantages come from one run of
the whole group and no rollout is ever in the shards twice.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .shards import (
    MANIFEST,
    SCHEMA_VERSION,
    SUMMARY,
    file_entry,
    output_shards,
    read_manifest,
    read_table,
    write_json_atomic,
    write_manifest,
    write_table_atomic,
)

# config keys that change what a rollout is: a resume that differs in any of them would mix two
# experiments in one directory. tasks.count, engine, output, ray and timeouts may change.
RESUME_KEYS = ("model", "group_size", "sampling", "renderer.name", "renderer.template_kwargs",
               "renderer.thinking_retention", "env", "tasks.path", "tasks.seed", "max_turns",
               "max_tokens_per_turn", "max_tokens_per_rollout", "advantage")


class ResumeMismatch(ValueError):
    """``--resume`` with a config that differs from the one the directory was written with."""


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaves of nested dicts (an empty dict has none, so {} and an absent key compare equal)."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def resume_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: saved -> current`` for every resume-relevant setting that differs (dotted keys)."""
    diffs = []
    for key in RESUME_KEYS:
        a, b = _pick(saved, key), _pick(current, key)
        fa, fb = _flatten(a, key + "."), _flatten(b, key + ".")
        for k in sorted(set(fa) | set(fb)):
            if fa.get(k) != fb.get(k):
                diffs.append(f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}")
    return diffs


def _pick(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_resume(out_dir: Path, config: dict[str, Any], template_sha256: str) -> None:
    """Raise :class:`ResumeMismatch` naming every differing field when ``out_dir`` was written with
    another model, sampling, renderer/template, environment or group size. A directory of schema 1
    (no saved config) is checked against its rows' model and template hash."""
    manifest = read_manifest(out_dir) or {}
    saved = manifest.get("config")
    diffs = resume_differences(saved, config) if saved else []
    saved_sha = manifest.get("template_sha256")
    if not saved:
        files = output_shards(out_dir)
        if files:
            first = read_table(files[0], columns=["model", "template_sha256"]).slice(0, 1).to_pylist()
            if first:
                if first[0]["model"] != config["model"]:
                    diffs.append(f"model: {first[0]['model']!r} -> {config['model']!r}")
                saved_sha = first[0]["template_sha256"]
    if saved_sha and template_sha256 and saved_sha != template_sha256:
        diffs.append(f"template_sha256: {saved_sha[:16]} -> {template_sha256[:16]}")
    if diffs:
        raise ResumeMismatch(f"--resume: {out_dir} was written with a different configuration; differing fields:\n  "
                             + "\n  ".join(diffs) + "\nrun with the original settings or choose another output.dir")


def _index(out_dir: Path) -> pa.Table:
    """group_id, rollout_id, segment_index, segment_count and the file of every row on disk."""
    parts = []
    for path in output_shards(out_dir):
        t = read_table(path, columns=["group_id", "rollout_id", "segment_index", "segment_count"])
        parts.append(t.append_column("file", pa.array([str(path)] * t.num_rows, pa.string())))
    if not parts:
        return pa.table({"group_id": pa.array([], pa.string()), "rollout_id": pa.array([], pa.string()),
                         "segment_index": pa.array([], pa.int32()), "segment_count": pa.array([], pa.int32()),
                         "file": pa.array([], pa.string())})
    return pa.concat_tables(parts)


def complete_groups(out_dir: Path, group_size: int) -> tuple[set[str], set[str]]:
    """(groups complete on disk, groups with rows on disk that are not complete)."""
    rows: dict[str, list[tuple[str, int, int]]] = {}
    for g, r, si, sc in zip(*(_index(out_dir)[c].to_pylist() for c in
                              ("group_id", "rollout_id", "segment_index", "segment_count"))):
        rows.setdefault(g, []).append((r, si, sc))
    complete, broken = set(), set()
    for g, items in rows.items():
        expected_ids = {f"{g}#{k}" for k in range(group_size)}
        segs: dict[str, list[int]] = {}
        counts: dict[str, set[int]] = {}
        for r, si, sc in items:
            segs.setdefault(r, []).append(si)
            counts.setdefault(r, set()).add(sc)
        ok = set(segs) == expected_ids and all(
            len(counts[r]) == 1 and sorted(s) == list(range(next(iter(counts[r])))) for r, s in segs.items())
        (complete if ok else broken).add(g)
    return complete, broken


def drop_groups(out_dir: Path, groups: set[str]) -> list[str]:
    """Remove every row of ``groups`` from the shard files (each affected file rewritten atomically
    under its own name; a file left empty is deleted). Returns the files changed."""
    if not groups:
        return []
    index = _index(out_dir)
    hit = index.filter(pc.is_in(index["group_id"], pa.array(sorted(groups), pa.string())))
    changed = sorted(set(hit["file"].to_pylist()))
    for name in changed:
        path = Path(name)
        table = read_table(path)
        keep = table.filter(pc.invert(pc.is_in(table["group_id"], pa.array(sorted(groups), pa.string()))))
        if keep.num_rows:
            write_table_atomic(path, _to_current_schema(keep))
        else:
            os.remove(path)
    return changed


def _to_current_schema(table: pa.Table) -> pa.Table:
    """Rows of an older file in the current schema (new columns null), for a rewrite."""
    from .shards import SCHEMA

    cols = [table[f.name] if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in SCHEMA]
    return pa.Table.from_arrays(cols, schema=SCHEMA)


def rollout_totals(out_dir: Path) -> dict[str, Any]:
    """Totals over every shard on disk: rows, rollouts, tasks, turns, tokens, rewards, finish reasons,
    errors and breaks (the manifest and summary after any run or resume match the files)."""
    files = output_shards(out_dir)
    empty = {"files": 0, "rows": 0, "rollouts": 0, "tasks": 0, "turns": 0, "completion_tokens": 0,
             "mean_reward": 0.0, "errors": 0, "finish_reasons": {}, "breaks": {}, "break_rate": 0.0}
    if not files:
        return empty
    cols = ["rollout_id", "task_id", "segment_index", "reward", "finish_reason", "error", "completion_tokens",
            "breaks", "turn_index", "loss_mask"]
    t = pa.concat_tables([read_table(p, columns=cols) for p in files])
    # turns sampled: distinct (rollout, turn) among trainable tokens, computed in Arrow
    rid = pc.dictionary_encode(t["rollout_id"]).combine_chunks().indices
    parents = pc.list_parent_indices(t["turn_index"])
    key = pc.add(pc.multiply(pc.cast(pc.take(rid, parents), pa.int64()), 1 << 16),
                 pc.cast(pc.list_flatten(t["turn_index"]), pa.int64()))
    turns = pc.count_distinct(pc.filter(key, pc.list_flatten(t["loss_mask"]))).as_py()
    firsts = t.filter(pc.equal(t["segment_index"], 0)).select(
        ["reward", "finish_reason", "error", "breaks"]).to_pylist()
    breaks: Counter[str] = Counter(b["reason"] for f in firsts for b in json.loads(f["breaks"] or "[]"))
    rewards = [f["reward"] for f in firsts]
    return {
        "files": len(files), "rows": t.num_rows, "rollouts": len(firsts),
        "tasks": pc.count_distinct(t["task_id"]).as_py(), "turns": turns,
        "completion_tokens": pc.sum(t["completion_tokens"]).as_py() or 0,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "errors": sum(f["error"] is not None for f in firsts),
        "finish_reasons": dict(Counter(f["finish_reason"] for f in firsts)), "breaks": dict(breaks),
        "break_rate": sum(breaks.values()) / turns if turns else 0.0,
    }


def write_outputs(out_dir: Path, config: dict[str, Any], run_info: dict[str, Any]) -> dict[str, Any]:
    """Rebuild ``_manifest.json`` and ``_summary.json`` from the shard files on disk (all of them, not
    only this run's) and return the summary: the totals, the run config and sampling params, and
    ``run_info`` (this run's own figures, under ``this_run``)."""
    entries = [file_entry(out_dir, p) for p in output_shards(out_dir)]
    sampling = config.get("sampling", {})
    meta = {"summary": SUMMARY, "model": config.get("model"), "renderer": run_info.get("renderer"),
            "template_sha256": run_info.get("template_sha256"), "group_size": config.get("group_size"),
            "sampling": sampling, "config": config}
    write_manifest(out_dir, entries, meta)
    totals = rollout_totals(out_dir)
    summary = {
        "schema_version": SCHEMA_VERSION, **totals, "group_size": config.get("group_size"),
        "renderer": run_info.get("renderer"), "template_sha256": run_info.get("template_sha256"),
        "model": config.get("model"), "engine": config.get("engine", {}).get("backend"), "sampling": sampling,
        "this_run": {k: v for k, v in run_info.items() if k not in ("renderer", "template_sha256")},
        "manifest": MANIFEST, "config": config,
    }
    write_json_atomic(out_dir / SUMMARY, summary)
    return summary
