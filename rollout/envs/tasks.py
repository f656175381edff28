"""Tasks from files (JSONL, Parquet) and from the built-in generators.

A task file has one task per row, in one of two schemas:

- ``messages``: a list of OpenAI chat messages (or a JSON string of one), validated like everything the
  renderer renders (:func:`renderers.messages.normalize_messages`);
- ``prompt``: a non-empty string, which becomes one user message.

Optional columns: ``answer`` (a string or a number; numbers are turned into their decimal string),
``task_id`` (a string or an integer; otherwise ``sha256`` of the messages and answer, so the id of a task
does not change when the file is reordered or filtered; ids must be unique in a file, since a task's rollouts
are named by it), ``metadata`` (an object merged into the task's
metadata). Every other column is copied into ``metadata``. Keys whose value is null are dropped from
messages first, because Parquet stores a list of messages as structs with every field of any message.

A bad row raises :class:`TaskFileError` naming the file, the row (and the JSONL line) and the column; with
``skip_bad_rows=True`` bad rows are skipped, counted and their errors kept in the result.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tito_renderers.messages import MessageError, normalize_messages

from .base import EnvError, Task

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
_RESERVED = ("messages", "prompt", "answer", "task_id", "metadata")
_KEPT_ERRORS = 20  # errors kept when skipping bad rows; the count covers all of them


class TaskFileError(ValueError):
    """A task file (or one of its rows) that cannot be loaded; the text names file, row and column."""


@dataclass
class LoadedTasks:
    """The tasks of a file, and the rows that were skipped (only with ``skip_bad_rows=True``)."""

    tasks: list[Task]
    skipped: int = 0
    errors: list[str] = field(default_factory=list)  # the first few skipped rows' errors

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)


class _RowError(Exception):
    def __init__(self, column: str | None, message: str) -> None:
        super().__init__(message)
        self.column = column


def load_tasks(path: str | Path, *, skip_bad_rows: bool = False, file_format: str | None = None) -> LoadedTasks:
    """Tasks from a JSONL or Parquet file (chosen by suffix unless ``file_format`` is "jsonl"/"parquet").

    Raises :class:`TaskFileError` for an unreadable file, an unknown format, a file with neither a
    ``messages`` nor a ``prompt`` column or with both, and (unless ``skip_bad_rows``) for the first bad row.
    """
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"{path}: no such task file")
    kind = file_format or _format_of(path)
    rows: Iterator[tuple[str, Any]]
    if kind == "jsonl":
        rows = _jsonl_rows(path)
    elif kind == "parquet":
        rows = _parquet_rows(path)
    else:
        raise TaskFileError(f"{path}: unknown task file format {kind!r} (use jsonl or parquet)")
    loaded = LoadedTasks(tasks=[])
    first_row_of: dict[str, str] = {}  # task id -> where it first appeared
    for where, row in rows:
        try:
            task = _task_from_row(row, path)
            _check_new_id(task.task_id, row, where, first_row_of)
            loaded.tasks.append(task)
        except _RowError as e:
            column = f", column {e.column!r}" if e.column else ""
            message = f"{path}, {where}{column}: {e}"
            if not skip_bad_rows:
                raise TaskFileError(message) from None
            loaded.skipped += 1
            if len(loaded.errors) < _KEPT_ERRORS:
                loaded.errors.append(message)
    return loaded


def _check_new_id(task_id: str, row: Mapping[str, Any], where: str, first_row_of: dict[str, str]) -> None:
    """A task id seen before is refused: the two tasks' rollouts would share ids (``<task_id>#0``...),
    collide in the engines and the shards, and a resume would take one task's group for the other's."""
    first = first_row_of.setdefault(task_id, where)
    if first == where:
        return
    if row.get("task_id") is None:  # derived from the content: the same messages and answer twice
        raise _RowError(None, f"the same messages and answer as {first} (task id {task_id} is derived from them): "
                              "remove one, or give each a distinct 'task_id'")
    raise _RowError("task_id", f"{task_id!r} already used by {first}: task ids must be unique")


def _format_of(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise TaskFileError(
        f"{path}: cannot tell the format from the name (expected {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)})"
    )


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """``("row R (line L)", parsed object)`` per non-blank line; invalid JSON or a line that is not UTF-8
    becomes a bad row (a UTF-8 byte order mark before the first line is skipped)."""
    row = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                where = f"row {row} (line {line_no})"
                row += 1
                yield where, _RowError(None, f"not UTF-8 text: byte 0x{raw[e.start]:02x} at column {e.start + 1} "
                                             f"({e.reason})")
                continue
            if not line.strip():
                continue
            where = f"row {row} (line {line_no})"
            row += 1
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                yield where, _RowError(None, f"invalid JSON: {e}")


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq  # imported here: JSONL users do not pay for pyarrow's import

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types (ArrowInvalid, OSError) for a broken file
        raise TaskFileError(f"{path}: not a readable Parquet file: {e}") from None
    columns = set(parquet.schema_arrow.names)
    _check_schema(path, columns)
    row = 0
    for batch in parquet.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield f"row {row}", record
            row += 1


def _check_schema(path: Path, columns: set[str]) -> None:
    if "messages" in columns and "prompt" in columns:
        raise TaskFileError(f"{path}: has both a 'messages' and a 'prompt' column; keep one")
    if "messages" not in columns and "prompt" not in columns:
        raise TaskFileError(f"{path}: needs a 'messages' or a 'prompt' column (columns: {', '.join(sorted(columns))})")


def _drop_nulls(value: Any) -> Any:
    """Messages with null-valued keys removed, recursively (Parquet struct columns fill absent fields)."""
    if isinstance(value, Mapping):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    if "messages" in row and "prompt" in row:
        raise _RowError(None, "has both 'messages' and 'prompt'; keep one")
    if "messages" in row:
        messages = row["messages"]
        if isinstance(messages, str):
            try:
                messages = json.loads(messages)
            except json.JSONDecodeError as e:
                raise _RowError("messages", f"a string that is not JSON: {e}") from None
        if not isinstance(messages, list) or not messages:
            raise _RowError("messages", f"must be a non-empty list of messages, got {_describe(messages)}")
        messages = _drop_nulls(messages)
        try:
            normalize_messages(messages)
        except MessageError as e:
            raise _RowError("messages", str(e)) from None
        return messages
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise _RowError("prompt", f"must be a non-empty string, got {_describe(prompt)}")
        return [{"role": "user", "content": prompt}]
    raise _RowError(None, f"needs 'messages' or 'prompt' (keys: {', '.join(sorted(map(str, row))) or 'none'})")


def _answer(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):  # before int: bool is an int subclass, and True is not an answer
        raise _RowError("answer", "must be a string or a number, got a boolean")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _RowError("answer", f"must be a finite number, got {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    raise _RowError("answer", f"must be a string or a number, got {_describe(value)}")


def _task_from_row(row: Any, path: Path) -> Task:
    if isinstance(row, _RowError):
        raise row
    if not isinstance(row, Mapping):
        raise _RowError(None, f"must be a JSON object, got {_describe(row)}")
    messages = _messages(row)
    answer = _answer(row.get("answer"))
    task_id = row.get("task_id")
    if task_id is None:
        digest = hashlib.sha256(json.dumps([messages, answer], sort_keys=True, ensure_ascii=False).encode())
        task_id = digest.hexdigest()[:16]
    elif isinstance(task_id, bool) or not isinstance(task_id, str | int) or task_id == "":
        raise _RowError("task_id", f"must be a non-empty string or an integer, got {_describe(task_id)}")
    metadata: dict[str, Any] = {}
    extra = row.get("metadata")
    if isinstance(extra, Mapping):
        metadata.update(extra)
    elif extra is not None:
        raise _RowError("metadata", f"must be an object, got {_describe(extra)}")
    metadata.update({k: v for k, v in row.items() if k not in _RESERVED})
    metadata.setdefault("source", str(path))
    return Task(task_id=str(task_id), messages=messages, answer=answer, metadata=metadata)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def generate_tasks(env_name: str, n: int, seed: int = 0, **options: Any) -> list[Task]:
    """``n`` tasks from environment ``env_name``'s built-in generator (options as for :func:`make_env`,
    e.g. ``difficulty``). Deterministic: the same arguments give the same tasks on every machine."""
    from .registry import make_env  # registry imports every environment; keep this module light

    if n < 0:
        raise EnvError(f"n must be >= 0, got {n}")
    return make_env(env_name, **options).generate_tasks(n, seed)
