"""Arrow/Parquet training shards: one row per training sample (a rollout segment).

Files are written under a temporary name and renamed when complete, so a reader never sees a
partial file; ``manifest.json`` lists the finished files with their row counts. The schema, with a
description of every column, is stored in each file's metadata and documented in docs/shards.md.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

SCHEMA_VERSION = "1"

COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("token_ids", pa.list_(pa.int32()), "the segment's token ids: context and sampled tokens in order"),
    ("loss_mask", pa.list_(pa.bool_()), "true exactly on tokens the engine sampled"),
    ("logprobs", pa.list_(pa.float32()), "the sampler's logprob of each sampled token; 0 elsewhere"),
    ("message_index", pa.list_(pa.int32()), "index into `messages` of the message each token belongs to; -1 scaffolding"),
    ("turn_index", pa.list_(pa.int16()), "the turn whose prompt or completion brought the token in"),
    ("messages", pa.string(), "JSON: the conversation, parsed assistant messages included"),
    ("reward", pa.float64(), "the rollout's reward"),
    ("reward_components", pa.string(), "JSON object of named reward components"),
    ("advantage", pa.float64(), "reward - group mean (divided by the group std if configured)"),
    ("task_id", pa.string(), ""),
    ("group_id", pa.string(), "the task's group: the G rollouts of one task"),
    ("rollout_id", pa.string(), ""),
    ("segment_index", pa.int32(), "0-based segment of the rollout (a break starts a new one)"),
    ("segment_count", pa.int32(), "segments of this rollout"),
    ("finish_reason", pa.string(), "why the rollout ended: no_tool_call, env_done, max_turns, length, context_limit, token_budget, error, timeout"),
    ("breaks", pa.string(), "JSON list of the rollout's breaks: turn, reason, detail, position"),
    ("weight_version", pa.int64(), "the policy version that sampled this segment (the lowest, if it changed)"),
    ("model", pa.string(), ""),
    ("renderer", pa.string(), "renderer family"),
    ("template_sha256", pa.string(), "sha256 of the chat template"),
    ("prompt_tokens", pa.int32(), "context tokens in the segment"),
    ("completion_tokens", pa.int32(), "sampled tokens in the segment"),
    ("error", pa.string(), "the rollout's error, if it failed"),
]


def schema() -> pa.Schema:
    fields = [pa.field(name, dtype, metadata={"description": doc} if doc else None) for name, dtype, doc in COLUMNS]
    meta = {"tito.schema_version": SCHEMA_VERSION, "tito.doc": "docs/shards.md"}
    return pa.schema(fields, metadata=meta)


SCHEMA = schema()


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    missing = [name for name, _, _ in COLUMNS if rows and name not in rows[0]]
    if missing:
        raise ValueError(f"sample rows lack columns {missing}")
    return pa.Table.from_pylist(rows, schema=SCHEMA)


class ShardWriter:
    """Buffers rows and writes them as complete files of ``rows_per_file`` rows (and the rest on close).

    ``stream`` names this writer's files (several renderer actors write side by side into one
    directory without coordinating). Thread-safe.
    """

    def __init__(self, directory: str | Path, stream: str = "shard", fmt: str = "arrow", rows_per_file: int = 1024) -> None:
        if fmt not in ("arrow", "parquet"):
            raise ValueError(f"format must be 'arrow' or 'parquet', got {fmt!r}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stream = stream
        self.fmt = fmt
        self.rows_per_file = rows_per_file
        self._pending: list[pa.Table] = []  # validated rows not yet in a file
        self._pending_rows = 0
        self._lock = threading.Lock()
        self._seq = len(list(self.dir.glob(f"{stream}-*.{self.suffix}")))  # resume after existing files
        self.files: list[dict] = []

    @property
    def suffix(self) -> str:
        return "arrow" if self.fmt == "arrow" else "parquet"

    def add(self, rows: list[dict[str, Any]]) -> None:
        """Validate rows against the schema (a bad row raises here and nothing is kept) and write
        every complete file."""
        if not rows:
            return
        table = rows_to_table(rows)
        with self._lock:
            self._pending.append(table)
            self._pending_rows += table.num_rows
            if self._pending_rows >= self.rows_per_file:
                merged = pa.concat_tables(self._pending)
                full = merged.num_rows - merged.num_rows % self.rows_per_file
                for start in range(0, full, self.rows_per_file):
                    self._write(merged.slice(start, self.rows_per_file))
                rest = merged.slice(full)
                self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> list[dict]:
        with self._lock:
            if self._pending_rows:
                self._write(pa.concat_tables(self._pending))
                self._pending, self._pending_rows = [], 0
        return self.files

    def _write(self, table: pa.Table) -> None:
        name = f"{self.stream}-{self._seq:05d}.{self.suffix}"
        self._seq += 1
        final = self.dir / name
        tmp = self.dir / f".{name}.tmp"
        if self.fmt == "arrow":
            with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, SCHEMA) as writer:
                writer.write_table(table)
        else:
            pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self.files.append({"file": name, "rows": table.num_rows, "tokens": sum(len(t) for t in table["token_ids"].to_pylist())})


def write_manifest(directory: str | Path, files: list[dict], extra: dict[str, Any] | None = None) -> Path:
    """manifest.json: every finished shard file with its row count (written atomically)."""
    directory = Path(directory)
    manifest = {"schema_version": SCHEMA_VERSION, "files": sorted(files, key=lambda f: f["file"]),
                "rows": sum(f["rows"] for f in files), **(extra or {})}
    tmp = directory / ".manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, directory / "manifest.json")
    return directory / "manifest.json"


def read_table(path: str | Path) -> pa.Table:
    """One shard file (Arrow IPC or Parquet) as a table."""
    path = Path(path)
    if path.suffix == ".parquet":
        return pq.read_table(path)
    with pa.memory_map(str(path)) as source:
        return ipc.open_file(source).read_all()
