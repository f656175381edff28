"""Trainer-side reading of training shards: open, filter, and stream samples as numpy arrays or tensors.

A shard source (one file, a directory of shards, a glob, or a list of those) opens as a
``pyarrow.dataset.Dataset``: nothing is loaded until it is iterated, and iteration streams record
batches, so a directory larger than memory is fine. Arrow IPC shards (``.arrow``, the *file* format
``rollout.shards.ShardWriter`` writes) open with dataset format ``"ipc"``, Parquet with ``"parquet"``;
a directory holding both opens as a union of the two.

Filters are pyarrow compute expressions (:func:`sample_filter`) so the dataset scanner applies them per
batch (and, for Parquet, can skip row groups by statistics) instead of Python testing rows one by one.

Samples come out as :class:`Sample` objects whose list columns are numpy views of the Arrow buffers
(``ListArray.values`` sliced by the offsets: no copy for int32/int16/float32 columns; ``loss_mask`` is
bit-packed in Arrow, so it is the one column that is unpacked into a new ``bool`` array).
"""

from __future__ import annotations

import glob as _glob
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

# per-token list columns and scalar columns a Sample carries
TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs", "turn_index")
SCALAR_COLUMNS = ("rollout_id", "group_id", "task_id", "segment_index", "segment_count", "advantage", "reward",
                  "finish_reason", "weight_version")
SUFFIX_FORMAT = {".arrow": "ipc", ".ipc": "ipc", ".feather": "ipc", ".parquet": "parquet"}


def shard_files(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """The shard files a source names, sorted: a file, a directory (its ``*.arrow``/``*.parquet`` and
    those of its ``data/`` folder, not hidden temporaries), a glob pattern, or a list of any of those. Raises FileNotFoundError when a
    source names nothing and ValueError for a file with an unknown suffix."""
    if isinstance(source, (list, tuple)):
        return sorted({f for s in source for f in shard_files(s)})
    path = Path(source).expanduser()
    if path.is_dir():
        # an output directory keeps its shards in data/ (older flat ones at the top: both are read);
        # hidden names are ShardWriter's in-progress temporaries (".name.tmp") and never complete shards
        folders = [path, path / "data"] if (path / "data").is_dir() else [path]
        files = [p for d in folders for p in d.iterdir()
                 if p.is_file() and p.suffix in SUFFIX_FORMAT and not p.name.startswith((".", "_"))]
    elif path.is_file():
        files = [path]
    else:
        files = [Path(p) for p in _glob.glob(str(path)) if Path(p).is_file()]
    if not files:
        raise FileNotFoundError(f"no shard files at {source}")
    unknown = [str(f) for f in files if f.suffix not in SUFFIX_FORMAT]
    if unknown:
        raise ValueError(f"not a shard file (expected .arrow or .parquet): {unknown}")
    return sorted(files)


def open_shards(source: str | Path | Sequence[str | Path]) -> ds.Dataset:
    """A lazy ``pyarrow.dataset.Dataset`` over the shard files of ``source`` (see :func:`shard_files`).

    Files are grouped by format; two formats give a union dataset. Nothing is read here but file footers.
    """
    by_format: dict[str, list[str]] = {}
    for f in shard_files(source):
        by_format.setdefault(SUFFIX_FORMAT[f.suffix], []).append(str(f))
    parts = [ds.dataset(files, format=fmt) for fmt, files in sorted(by_format.items())]
    return parts[0] if len(parts) == 1 else ds.dataset(parts)


def sample_filter(*, min_weight_version: int | None = None, max_weight_version: int | None = None,
                  min_reward: float | None = None, max_reward: float | None = None,
                  finish_reasons: Iterable[str] | None = None, max_breaks: int | None = None,
                  ) -> ds.Expression | None:
    """A compute expression keeping the samples that pass every given bound (bounds are inclusive);
    None when no bound is given.

    ``max_breaks`` bounds the rollout's number of breaks. Every break starts a new segment, so it is
    ``segment_count - 1`` (the length of the ``breaks`` JSON list): testing the int column keeps the
    filter a pushdown-able expression instead of JSON parsing in Python.
    """
    terms: list[ds.Expression] = []
    if min_weight_version is not None:
        terms.append(pc.field("weight_version") >= min_weight_version)
    if max_weight_version is not None:
        terms.append(pc.field("weight_version") <= max_weight_version)
    if min_reward is not None:
        terms.append(pc.field("reward") >= min_reward)
    if max_reward is not None:
        terms.append(pc.field("reward") <= max_reward)
    if finish_reasons is not None:
        terms.append(pc.field("finish_reason").isin(pa.array(sorted(set(finish_reasons)), pa.string())))
    if max_breaks is not None:
        terms.append(pc.field("segment_count") - 1 <= max_breaks)
    if not terms:
        return None
    expr = terms[0]
    for t in terms[1:]:
        expr = expr & t
    return expr


@dataclass
class Sample:
    """One training sample (a rollout segment). Token arrays are equally long; ``token_ids`` int32,
    ``loss_mask`` bool (true exactly on sampled tokens), ``logprobs`` float32 (the sampler's logprob on
    sampled tokens, 0 elsewhere), ``turn_index`` int16. Arrays may be read-only views of Arrow memory."""

    token_ids: Any
    loss_mask: Any
    logprobs: Any
    turn_index: Any
    advantage: float
    rollout_id: str
    segment_index: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # the other scalar columns that were read

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def name(self) -> str:
        """``rollout_id`` with the segment when the rollout has several (how failures name a sample)."""
        count = self.meta.get("segment_count", 1) or 1
        return self.rollout_id if count <= 1 else f"{self.rollout_id}#seg{self.segment_index}"


def _list_column(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column: values as a numpy view of the child buffer where the type
    allows it (bool is bit-packed and is unpacked), offsets as absolute indices into those values."""
    arr = batch.column(name)
    if arr.null_count:
        raise ValueError(f"column {name!r} has null rows; shards never do")
    values = arr.values
    np_values = values.to_numpy(zero_copy_only=not pa.types.is_boolean(values.type))
    return np_values, arr.offsets.to_numpy()


def iter_samples(data: ds.Dataset | str | Path | Sequence[str | Path], *, filter: ds.Expression | None = None,
                 batch_size: int = 1024, torch: bool = False) -> Iterator[Sample]:
    """Stream samples from a dataset (or any source :func:`open_shards` takes), in file order, reading
    ``batch_size`` rows at a time. With ``torch=True`` the token arrays are ``torch.Tensor`` sharing the
    numpy memory (``torch.from_numpy``; read-only Arrow views are copied first, since torch requires
    writable memory)."""
    dataset = data if isinstance(data, ds.Dataset) else open_shards(data)
    names = set(dataset.schema.names)
    scalars = [c for c in SCALAR_COLUMNS if c in names]
    if torch:
        import torch as _torch
    for batch in dataset.to_batches(columns=list(TOKEN_COLUMNS) + scalars, filter=filter, batch_size=batch_size):
        if batch.num_rows == 0:
            continue
        lists = {c: _list_column(batch, c) for c in TOKEN_COLUMNS}
        meta_cols = {c: batch.column(c).to_pylist() for c in scalars}
        for i in range(batch.num_rows):
            arrays = {}
            for c, (values, offsets) in lists.items():
                a = values[offsets[i]:offsets[i + 1]]
                if torch:
                    a = _torch.from_numpy(a if a.flags.writeable else a.copy())
                arrays[c] = a
            meta = {c: meta_cols[c][i] for c in scalars}
            yield Sample(advantage=float(meta.get("advantage") or 0.0), rollout_id=str(meta.get("rollout_id")),
                         segment_index=int(meta.get("segment_index") or 0), meta=meta, **arrays)


def load_samples(source: ds.Dataset | str | Path | Sequence[str | Path], **filters: Any) -> list[Sample]:
    """All samples of a source that pass :func:`sample_filter` ``(**filters)``, as a list (small sets)."""
    return list(iter_samples(source, filter=sample_filter(**filters)))
