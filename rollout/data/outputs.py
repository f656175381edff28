"""A ``tito run`` output directory as a whole: which groups the shards already hold (for ``--resume``),
the repair of groups an older version left split or duplicated, the run config a resume must match,
and ``_manifest.json`` / ``_summary.json`` rebuilt from the files on disk.

Resume rule (docs/rollout.md): a group is *complete* when the files hold exactly ``group_size``
distinct rollouts of it, ``<task_id>#0`` .. ``#G-1``, each with its segments 0..n-1 exactly once.
Complete groups are skipped. Any other rows of a group (a partial group, or a group written twice by
a version that split groups across files) are removed from their files — each such file is rewritten
atomically without them — and the whole group is run again, so its advantages come from one run of
the whole group and no rollout is ever in the shards twice.

Integrity: ``_manifest.json`` records each file's sha256. A resume first removes the hidden
temporaries a failed or killed run left (``.<name>.tmp``), then checks every listed file against its
checksum and stops, naming the file, on a mismatch; a file that is not a readable shard stops it too.
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
    CHECKSUM,
    DATA_DIR,
    MANIFEST,
    SCHEMA_VERSION,
    SUMMARY,
    ShardCorrupt,
    ShardWriteError,
    corrupt_advice,
    output_shards,
    read_manifest,
    read_table,
    shard_entries,
    verify_checksums,
    write_json_atomic,
    write_manifest,
    write_table_atomic,
    written_checksums,
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


def remove_temporaries(out_dir: Path) -> list[Path]:
    """Delete the hidden temporaries (``.<name>.tmp``, in ``out_dir`` and its ``data/``) that a run
    which failed or was killed mid-write left: never complete files, and no reader lists them."""
    removed = []
    for folder in (out_dir, out_dir / DATA_DIR):
        if folder.is_dir():
            for p in folder.glob(".*.tmp"):
                if p.is_file():
                    p.unlink(missing_ok=True)
                    removed.append(p)
    return removed


def check_integrity(out_dir: Path, manifest: dict | None = None) -> int:
    """Raise :class:`ShardCorrupt` naming every shard whose bytes differ from the manifest's sha256,
    with what to do; returns the number of files checked (0 for a manifest without checksums)."""
    checked, problems = verify_checksums(out_dir, manifest)
    if len(problems) == 1:  # one line, as every other error of tito run
        raise ShardCorrupt(f"{problems[0]}; {corrupt_advice('it')}")
    if problems:
        raise ShardCorrupt(f"{len(problems)} corrupt shard files in {out_dir}:\n  " + "\n  ".join(problems)
                           + f"\n{corrupt_advice('them', several=True)}")
    return checked


def check_resume(out_dir: Path, config: dict[str, Any], template_sha256: str) -> None:
    """Raise :class:`ShardCorrupt` for a shard that fails its checksum, and :class:`ResumeMismatch`
    naming every differing field when ``out_dir`` was written with another model, sampling,
    renderer/template, environment or group size. A directory of schema 1 (no saved config) is
    checked against its rows' model and template hash."""
    manifest = read_manifest(out_dir) or {}
    check_integrity(out_dir, manifest)
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
    rewritten: dict[str, dict | None] = {}  # file relative to out_dir -> its new manifest entry (None: deleted)
    for name in changed:
        path = Path(name)
        table = read_table(path)
        keep = table.filter(pc.invert(pc.is_in(table["group_id"], pa.array(sorted(groups), pa.string()))))
        rel = path.relative_to(out_dir).as_posix()
        if keep.num_rows:
            entry = write_table_atomic(path, _to_current_schema(keep))
            rewritten[rel] = {**entry, "file": rel}
        else:
            os.remove(path)
            rewritten[rel] = None
        # the manifest follows at once: a run killed after this must not find a stale checksum
        _update_manifest_entries(out_dir, rewritten)
    return changed


def _update_manifest_entries(out_dir: Path, entries: dict[str, dict | None]) -> None:
    manifest = read_manifest(out_dir)
    if manifest is None or not (out_dir / MANIFEST).exists():  # none (or the flat layout's): rebuilt at the end
        return
    files = [entries.get(f["file"], f) for f in manifest.get("files", [])]
    files = [f for f in files if f is not None]
    extra = {k: v for k, v in manifest.items() if k not in ("schema_version", "files", "rows", "tokens")}
    write_manifest(out_dir, files, extra)


def _to_current_schema(table: pa.Table) -> pa.Table:
    """Rows of an older file in the current schema, for a rewrite: the sampling columns it lacks are null,
    the version columns of schema 3 derived (one version per row: ``weight_version``)."""
    from .shards import SCHEMA, with_version_columns

    cols = [table[f.name] if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in SCHEMA]
    return with_version_columns(pa.Table.from_arrays(cols, schema=SCHEMA))


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


def write_outputs(out_dir: Path, config: dict[str, Any], run_info: dict[str, Any],
                  written: list[dict] | None = None) -> dict[str, Any]:
    """Rebuild ``_manifest.json`` and ``_summary.json`` from the shard files on disk (all of them, not
    only this run's) and return the summary: the totals, the run config and sampling params, and
    ``run_info`` (this run's own figures, under ``this_run``).

    Checksums: ``written`` (the writers' entries for this run's files, names relative to ``data/``)
    and the previous manifest (checked when the resume started) are kept; any other file on disk (a
    run killed before its manifest, an older version's) is hashed as found."""
    previous = read_manifest(out_dir) if (out_dir / MANIFEST).exists() else None
    known = {f["file"]: f.get(CHECKSUM) for f in (previous or {}).get("files", [])}
    known.update(written_checksums(written or []))
    entries = shard_entries(out_dir, known)
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


def write_failure(error: Exception, out_dir: Path, *, summary: dict[str, Any] | None = None,
                  manifest_error: Exception | None = None) -> ShardWriteError:
    """The one line ``tito run`` ends with when a write failed: the file and cause, what is on disk,
    and how to finish (free space, then --resume runs exactly the rollouts not on disk)."""
    if summary is not None:
        state = f"{summary['rollouts']} rollouts are on disk in {out_dir} (manifest updated)"
    else:
        state = f"the manifest could not be updated either ({manifest_error}); what is on disk in {out_dir} is kept"
    return ShardWriteError(f"{error}. The run stopped: {state}; free space, then rerun with --resume to run the rest")
