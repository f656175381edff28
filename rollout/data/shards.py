"""Arrow/Parquet training shards: one row per training sample (a rollout segment).

An output directory holds the shards in ``data/`` (``data/train-<stream>-<seq>.arrow``) and, beside
it, ``_manifest.json``, ``_summary.json`` and ``_breaks.jsonl``. The leading underscore (the
Hadoop/Spark ``_SUCCESS`` convention) makes ``pyarrow.dataset``, pandas and Spark skip them, and the
``train-`` file prefix makes ``datasets.load_dataset(out_dir)`` pick the shards as its train split, so
readers work on the directory itself (polars, which reads every file under a directory, through a glob
rooted at it: docs/shards.md). Files are written under a temporary name and
renamed when complete, so a reader never sees a partial file; the manifest records each file's
sha256, which ``tito run --resume`` and ``tito inspect`` check. A write that fails (a full disk) removes
its temporary and raises :class:`ShardWriteError` naming the file. The schema, with a description of
every column, is stored in each file's metadata and documented in docs/shards.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

# 2: sampling columns; shards in data/, metadata files named _*.json. 3: per-token ``weight_versions`` and
# ``weight_version_max`` (follow mode: one completion may hold tokens of two weight versions). Files of an
# older schema still read: every reader derives the missing columns (:func:`with_version_columns`). 4: ``lora``, the
# adapter that sampled the rollout (an older file has none: every row was sampled by the base model). 5: ``task``, the
# task record the environment was given (an older file has none: null).
SCHEMA_VERSION = "5"

DATA_DIR = "data"  # the shards' folder inside an output directory
STREAM = "train"  # file-name prefix: HF datasets maps it to the "train" split
MANIFEST = "_manifest.json"
SUMMARY = "_summary.json"
BREAKS = "_breaks.jsonl"

COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("token_ids", pa.list_(pa.int32()), "the segment's token ids: context and sampled tokens in order"),
    ("loss_mask", pa.list_(pa.bool_()), "true exactly on tokens the engine sampled"),
    ("logprobs", pa.list_(pa.float32()), "the sampler's logprob of each sampled token; 0 elsewhere"),
    ("message_index", pa.list_(pa.int32()), "index into `messages` of the message each token belongs to; -1 scaffolding"),
    ("turn_index", pa.list_(pa.int16()), "the turn whose prompt or completion brought the token in"),
    ("weight_versions", pa.list_(pa.int32()), "the weight version that sampled each sampled token; -1 where loss_mask is false"),
    ("messages", pa.string(), "JSON: the conversation, parsed assistant messages included"),
    ("reward", pa.float64(), "the rollout's reward"),
    ("reward_components", pa.string(), "JSON object of named reward components"),
    ("advantage", pa.float64(), "reward - group mean (divided by the group std if configured)"),
    ("task_id", pa.string(), ""),
    ("group_id", pa.string(), "the task's group: the G rollouts of one task"),
    ("rollout_id", pa.string(), ""),
    ("segment_index", pa.int32(), "0-based segment of the rollout (a break starts a new one)"),
    ("segment_count", pa.int32(), "segments of this rollout"),
    ("finish_reason", pa.string(), "why the rollout ended: no_tool_call, env_done, max_turns, length, context_limit, token_budget, error, env_error, timeout"),
    ("breaks", pa.string(), "JSON list of the rollout's breaks: turn, reason, detail, position"),
    ("weight_version", pa.int64(), "the lowest weight version among the segment's sampled tokens (0 if it has none)"),
    ("weight_version_max", pa.int64(), "the highest weight version among the segment's sampled tokens (0 if it has none)"),
    ("model", pa.string(), ""),
    ("lora", pa.string(), "the LoRA adapter the rollout was sampled with (its name; null: the base model alone)"),
    ("renderer", pa.string(), "renderer family"),
    ("template_sha256", pa.string(), "sha256 of the chat template"),
    ("prompt_tokens", pa.int32(), "context tokens in the segment"),
    ("completion_tokens", pa.int32(), "sampled tokens in the segment"),
    ("error", pa.string(), "the rollout's error, if it failed"),
    ("temperature", pa.float64(), "sampling temperature the rollout was sampled with (null if unknown)"),
    ("top_p", pa.float64(), "nucleus sampling p (1 = off; null if unknown)"),
    ("top_k", pa.int32(), "top-k sampling k (0 = off; null if unknown)"),
    ("seed", pa.int64(), "the run's sampling.seed (each turn's seed derives from it and the rollout id); null if unset"),
    ("task", pa.string(), "JSON: the task the environment was given (task_id, messages, answer, metadata), so a "
                          "reward can be recomputed from the row alone"),
]
SAMPLING_COLUMNS = ("temperature", "top_p", "top_k", "seed")
# schema 3's columns: a row or file without them (schema <= 2, a hand-built row) gets them derived from
# loss_mask and weight_version, since such a segment was sampled by one version (with_version_columns)
VERSION_COLUMNS = ("weight_versions", "weight_version_max")


def schema() -> pa.Schema:
    fields = [pa.field(name, dtype, metadata={"description": doc} if doc else None) for name, dtype, doc in COLUMNS]
    meta = {"tito.schema_version": SCHEMA_VERSION, "tito.doc": "docs/shards.md"}
    return pa.schema(fields, metadata=meta)


SCHEMA = schema()

CHECKSUM = "sha256"  # the manifest key of each file's checksum: hashlib's (cost: scripts/bench_checksum.py)


class ShardWriteError(OSError, ValueError):
    """A shard, manifest or summary could not be written (a full disk, a read-only directory): the
    message names the file and the cause. Nothing half-written is left: the temporary is removed.
    A ValueError too, so the CLI prints it as one line instead of a traceback."""


class ShardCorrupt(ValueError):
    """A shard file that does not match its manifest checksum, or cannot be read as a shard."""


def corrupt_advice(path: str | Path, several: bool = False) -> str:
    """What to do about a corrupt shard (or, ``several``, corrupt shards called ``path``)."""
    if several:
        return f"move {path} aside (tito run --resume then runs their rollouts again) or restore them from a copy"
    return f"move {path} aside (tito run --resume then runs its rollouts again) or restore it from a copy"


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows as a table of the schema; the sampling columns and ``lora`` may be left out (null: a caller that does
    not know them; the base model), and the version columns (derived: :func:`with_version_columns`); any other missing column
    is an error naming it. ``weight_versions`` must be as long as ``token_ids`` and -1 exactly where
    ``loss_mask`` is false (a ValueError names the first row that is not)."""
    optional = SAMPLING_COLUMNS + VERSION_COLUMNS + ("lora", "task")  # lora left out: the base model (null)
    missing = [name for name, _, _ in COLUMNS if rows and name not in rows[0] and name not in optional]
    if missing:
        raise ValueError(f"sample rows lack columns {missing}")
    table = with_version_columns(pa.Table.from_pylist(rows, schema=SCHEMA))
    _check_versions(table)
    return table


def _rebased(arr: pa.ListArray) -> tuple[pa.Array, pa.Array]:
    """(values, offsets starting at 0) of a list array, which may be a slice of a larger one."""
    offsets = arr.offsets
    return arr.flatten(), pc.subtract(offsets, offsets[0])


def with_version_columns(table: pa.Table) -> pa.Table:
    """``table`` with ``weight_versions`` and ``weight_version_max`` where it lacks them or holds nulls (a
    file of schema <= 2, a row built without them): such a segment was sampled by one version, so every
    sampled token gets the row's ``weight_version`` (-1 elsewhere) and the max is ``weight_version``. Other
    columns are left as they are; a table that has both columns without nulls is returned unchanged."""
    names = table.column_names
    have = [c for c in VERSION_COLUMNS if c in names and table[c].null_count == 0]
    if len(have) == len(VERSION_COLUMNS) or not table.num_rows or "loss_mask" not in names:
        return table
    table = table.combine_chunks()
    low = pc.fill_null(table["weight_version"], 0).combine_chunks() if "weight_version" in names \
        else pa.array([0] * table.num_rows, pa.int64())
    if "weight_versions" not in have:
        mask = table["loss_mask"].combine_chunks()
        flat, offsets = _rebased(mask)
        per_token = pc.cast(pc.take(low, pc.list_parent_indices(mask)), pa.int32())
        derived = pa.ListArray.from_arrays(offsets, pc.if_else(flat, per_token, pa.scalar(-1, pa.int32())),
                                           type=pa.list_(pa.int32()))
        if "weight_versions" in names:
            derived = pc.coalesce(table["weight_versions"].combine_chunks(), derived)
        table = _set_column(table, "weight_versions", derived)
    if "weight_version_max" not in have:
        high = pc.coalesce(table["weight_version_max"].combine_chunks(), low) if "weight_version_max" in names else low
        table = _set_column(table, "weight_version_max", high)
    return table


def _set_column(table: pa.Table, name: str, values: pa.Array) -> pa.Table:
    """``table`` with column ``name`` replaced (its field, description included, kept) or appended with
    the schema's field."""
    i = table.schema.get_field_index(name)
    if i >= 0:
        return table.set_column(i, table.schema.field(i), values)
    return table.append_column(SCHEMA.field(name), values)


def _check_versions(table: pa.Table) -> None:
    """Raise ValueError naming the first row whose ``weight_versions`` is not aligned with ``token_ids``
    or is not -1 exactly where ``loss_mask`` is false."""
    if not table.num_rows:
        return
    versions, mask = table["weight_versions"], table["loss_mask"]
    bad_len = pc.not_equal(pc.list_value_length(versions), pc.list_value_length(table["token_ids"]))
    if pc.any(bad_len).as_py():
        i = pc.index(bad_len, True).as_py()
        raise ValueError(f"row {i} (rollout {table['rollout_id'][i]}): weight_versions has "
                         f"{len(versions[i])} entries for {len(table['token_ids'][i])} tokens")
    flat_v, flat_m = pc.list_flatten(versions), pc.list_flatten(mask)
    # a sampled token has a version >= 0, a context token -1
    wrong = pc.not_equal(pc.greater_equal(flat_v, 0), flat_m)
    if pc.any(wrong).as_py():
        i = pc.list_parent_indices(versions).combine_chunks()[pc.index(wrong, True).as_py()].as_py()
        raise ValueError(f"row {i} (rollout {table['rollout_id'][i]}): weight_versions must be >= 0 on sampled "
                         "tokens and -1 where loss_mask is false")


class ShardWriter:
    """Writes rows in files that each hold whole units (a unit is one ``add`` call: the driver adds a
    finished group, ``tito serve`` a finished session), so a group never straddles two files.

    A file is written once the pending units hold ``rows_per_file`` rows, once the oldest pending unit
    has waited ``flush_interval_s`` seconds (a timer thread, so a slow run still reaches disk), and on
    :meth:`flush` / :meth:`close`. A crash therefore loses only groups still running plus at most
    ``flush_interval_s`` of finished ones; a signal or a clean end loses nothing finished. Files go to
    a temporary name, are fsynced and renamed, so a reader never sees a partial file.

    ``stream`` names this writer's files (several renderer actors write side by side into one
    directory without coordinating). Thread-safe.
    """

    def __init__(self, directory: str | Path, stream: str = STREAM, fmt: str = "arrow", rows_per_file: int = 1024,
                 flush_interval_s: float | None = None) -> None:
        if fmt not in ("arrow", "parquet"):
            raise ValueError(f"format must be 'arrow' or 'parquet', got {fmt!r}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stream = stream
        self.fmt = fmt
        self.rows_per_file = rows_per_file
        self.flush_interval_s = flush_interval_s
        self._pending: list[pa.Table] = []  # validated units not yet in a file
        self._pending_rows = 0
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._seq = _next_seq(self.dir, stream, self.suffix)  # resume after existing files, never reuse a name
        self.files: list[dict] = []
        # the first failed write: from then on the writer writes nothing and every call raises it, so
        # the caller stops at the next group (a timer-thread failure has no caller to raise to)
        self.error: ShardWriteError | None = None

    @property
    def suffix(self) -> str:
        return "arrow" if self.fmt == "arrow" else "parquet"

    @property
    def pending_rows(self) -> int:
        return self._pending_rows

    def add(self, rows: list[dict[str, Any]]) -> list[dict]:
        """Validate one unit of rows against the schema (a bad row raises here and nothing is kept);
        returns the files this call wrote (none while the unit waits for more)."""
        self._raise_if_failed()
        if not rows:
            return []
        table = rows_to_table(rows)
        with self._lock:
            self._raise_if_failed()
            self._pending.append(table)
            self._pending_rows += table.num_rows
            if self._pending_rows >= self.rows_per_file or self.flush_interval_s == 0:
                return self._flush_locked()
            if self.flush_interval_s is not None and self._timer is None:
                self._timer = threading.Timer(self.flush_interval_s, self._timed_flush)
                self._timer.daemon = True
                self._timer.start()
        return []

    def flush(self) -> list[dict]:
        """Write every pending unit to one file now; returns the new file's entry ([] if none pending)."""
        with self._lock:
            return self._flush_locked()

    def close(self) -> list[dict]:
        """Flush and stop the timer; returns every file this writer wrote. Raises
        :class:`ShardWriteError` if any write failed (``files`` still lists the files that were written)."""
        self.flush()
        return self.files

    def _timed_flush(self) -> None:
        with contextlib.suppress(ShardWriteError):  # kept in self.error: the next add/flush/close raises it
            self.flush()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise ShardWriteError(str(self.error))

    def _flush_locked(self) -> list[dict]:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._raise_if_failed()
        if not self._pending_rows:
            return []
        # one record batch per file (readers stream batches; many one-group batches would be slow)
        table = pa.concat_tables(self._pending).combine_chunks()
        # pending rows leave memory either way: written, or (a failed write) rerun by --resume
        self._pending, self._pending_rows = [], 0
        try:
            entry = self._write(table)
        except ShardWriteError as exc:
            self.error = exc
            raise
        return [entry]

    def _write(self, table: pa.Table) -> dict:
        name = f"{self.stream}-{self._seq:05d}.{self.suffix}"
        self._seq += 1
        entry = write_table_atomic(self.dir / name, table)
        self.files.append(entry)
        return entry


def _next_seq(directory: Path, stream: str, suffix: str) -> int:
    seqs = []
    for p in directory.glob(f"{stream}-*.{suffix}"):
        tail = p.stem[len(stream) + 1:]
        if tail.isdigit():
            seqs.append(int(tail))
    return max(seqs) + 1 if seqs else 0


def temporary_name(path: Path) -> Path:
    """The hidden name a file is written under before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp")


def _write_bytes_atomic(path: Path, data: bytes | memoryview | pa.Buffer) -> None:
    """``data`` to a hidden temporary, fsync, rename to ``path``. A failure removes the temporary and
    raises :class:`ShardWriteError` naming ``path`` and the cause (ENOSPC: no space left on device)."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ShardWriteError(f"cannot write {path}: {exc.strerror or exc}") from exc


def write_table_atomic(path: Path, table: pa.Table) -> dict:
    """Write ``table`` to ``path`` (format by suffix) via a hidden temporary, fsync, rename; returns the
    manifest entry (file name relative to the data directory, rows, tokens, sha256 of the bytes).
    The file is built in memory first, so its checksum is that of the exact bytes written."""
    sink = pa.BufferOutputStream()
    if path.suffix == ".arrow":
        with ipc.new_file(sink, SCHEMA) as writer:
            writer.write_table(table)
    else:
        pq.write_table(table, sink)
    data = sink.getvalue()
    _write_bytes_atomic(path, data)
    return {"file": path.name, "rows": table.num_rows, "tokens": _tokens(table),
            CHECKSUM: hashlib.sha256(data).hexdigest()}


def file_checksum(path: str | Path) -> str:
    """sha256 of a file's bytes (streamed: a file larger than memory is fine)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, CHECKSUM).hexdigest()


def _tokens(table: pa.Table) -> int:
    return int(pc.sum(pc.list_value_length(table["token_ids"])).as_py() or 0) if table.num_rows else 0


def write_json_atomic(path: Path, data: Any) -> Path:
    _write_bytes_atomic(path, json.dumps(data, indent=2, ensure_ascii=False).encode())
    return path


def write_manifest(directory: str | Path, files: list[dict], extra: dict[str, Any] | None = None) -> Path:
    """``_manifest.json``: every finished shard file (path relative to ``directory``) with its row and
    token counts and sha256 (written atomically)."""
    directory = Path(directory)
    manifest = {"schema_version": SCHEMA_VERSION, "files": sorted(files, key=lambda f: f["file"]),
                "rows": sum(f["rows"] for f in files), "tokens": sum(f.get("tokens", 0) for f in files),
                **(extra or {})}
    return write_json_atomic(directory / MANIFEST, manifest)


def read_manifest(directory: str | Path) -> dict | None:
    """The output directory's manifest (``_manifest.json``, or the flat layout's ``manifest.json``)."""
    for name in (MANIFEST, "manifest.json"):
        path = Path(directory) / name
        if path.exists():
            try:
                return json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ShardCorrupt(f"{path}: not a readable manifest ({exc}); move it aside: tito run --resume "
                                   "rebuilds it from the shard files (which are then not checked)") from exc
    return None


def output_shards(directory: str | Path) -> list[Path]:
    """The finished shard files of an output directory: ``data/*`` and, from the flat layout of schema
    1, ``shard-*`` files at the top (hidden temporaries are never included)."""
    directory = Path(directory)
    found = []
    for folder in (directory / DATA_DIR, directory):
        if folder.is_dir():
            found += [p for p in folder.iterdir() if p.is_file() and p.suffix in (".arrow", ".parquet")
                      and not p.name.startswith((".", "_"))]
    return sorted(found)


def file_entry(directory: str | Path, path: Path, checksum: str | None = None) -> dict:
    """A manifest entry for an existing shard file, from the file itself (rows, tokens; the sha256 of
    its bytes unless the caller already has it)."""
    table = read_table(path, columns=["token_ids"])
    return {"file": path.relative_to(directory).as_posix(), "rows": table.num_rows, "tokens": _tokens(table),
            CHECKSUM: checksum or file_checksum(path)}


def written_checksums(files: list[dict]) -> dict[str, str | None]:
    """Checksums a shard writer reported (its entries name files relative to ``data/``), by path in the output
    directory: what :func:`shard_entries` reuses instead of hashing those files again."""
    return {f"{DATA_DIR}/{f['file']}": f.get(CHECKSUM) for f in files}


def shard_entries(directory: str | Path, checksums: dict[str, str | None]) -> list[dict]:
    """A manifest entry per finished shard of ``directory`` (:func:`output_shards`), reusing the checksums
    known by path (others are hashed)."""
    directory = Path(directory)
    return [file_entry(directory, p, checksums.get(p.relative_to(directory).as_posix()))
            for p in output_shards(directory)]


def verify_checksums(directory: str | Path, manifest: dict | None = None) -> tuple[int, list[str]]:
    """Check every shard on disk that the manifest has a checksum for: (files checked, one problem line
    per mismatch naming the file). Files the manifest does not list (a manifest of an older version
    without checksums, or files of a run killed before it wrote its manifest) are not checked."""
    directory = Path(directory)
    manifest = read_manifest(directory) if manifest is None else manifest
    known = {f["file"]: f[CHECKSUM] for f in (manifest or {}).get("files", []) if f.get(CHECKSUM)}
    checked, problems = 0, []
    for path in output_shards(directory):
        want = known.get(path.relative_to(directory).as_posix())
        if want is None:
            continue
        checked += 1
        got = file_checksum(path)
        if got != want:
            problems.append(f"{path}: sha256 {got[:16]} differs from the manifest's {want[:16]} (the file changed "
                            f"after it was written)")
    return checked, problems


def read_table(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """One shard file (Arrow IPC or Parquet) as a table (optionally only ``columns``). A file that is
    not a readable shard (truncated, overwritten) raises :class:`ShardCorrupt` naming it."""
    path = Path(path)
    try:
        if path.suffix == ".parquet":
            return pq.read_table(path, columns=columns)
        with pa.memory_map(str(path)) as source:
            table = ipc.open_file(source).read_all()
        return table.select(columns) if columns else table
    except (pa.ArrowInvalid, pa.ArrowKeyError, pa.ArrowNotImplementedError) as exc:
        raise ShardCorrupt(f"{path}: not a readable shard file ({exc}); {corrupt_advice(path)}") from exc


def write_error_of(exc: BaseException) -> ShardWriteError | None:
    """The :class:`ShardWriteError` behind ``exc``: itself, or the cause of a Ray task error (a renderer
    actor's failed write reaches the driver wrapped, its message a remote traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ShardWriteError):
        return cause
    return exc if isinstance(exc, ShardWriteError) and cause is None else None
