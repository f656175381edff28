"""Trainer-side reading of training shards: open, filter, and stream samples as numpy arrays or tensors.

A shard source (one file, a directory of shards, a glob, or a list of those) opens as a
``pyarrow.dataset.Dataset``: nothing is loaded until it is iterated, and iteration streams record
batches, so a directory larger than memory is fine. Arrow IPC shards (``.arrow``, the *file* format
``rollout.data.shards.ShardWriter`` writes) open with dataset format ``"ipc"``, Parquet with ``"parquet"``;
a directory holding both opens as a union of the two.

Filters are pyarrow compute expressions (:func:`sample_filter`) so the dataset scanner applies them per
batch (and, for Parquet, can skip row groups by statistics) instead of Python testing rows one by one.

Samples come out as :class:`Sample` objects whose list columns are numpy views of the Arrow buffers
(``ListArray.values`` sliced by the offsets: no copy for int32/int16/float32 columns; ``loss_mask`` is
bit-packed in Arrow, so it is the one column that is unpacked into a new ``bool`` array).

Weight versions: ``Sample.weight_versions`` is the version that sampled each token (-1 on context).
Shards of schema <= 2 have no such column; their rows were sampled by one version, so it is derived from
``loss_mask`` and ``weight_version`` (``weight_version_max`` likewise falls back to ``weight_version``).
A directory mixing old and new files (``tito run --resume`` of an old run) reads with the union of
their schemas, so no file's columns are dropped.

:func:`read_step` is follow mode's trainer side: it waits for batch k of a run directory to be sealed,
checks it, and returns its samples.
"""

from __future__ import annotations

import glob as _glob
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

# per-token list columns and scalar columns a Sample carries (weight_versions besides: derived for old shards)
TOKEN_COLUMNS = ("token_ids", "loss_mask", "logprobs", "turn_index")
SCALAR_COLUMNS = ("rollout_id", "group_id", "task_id", "segment_index", "segment_count", "advantage", "reward",
                  "finish_reason", "weight_version", "weight_version_max", "lora")
# schema 3's columns, which shards of schema <= 2 lack (every reader derives them)
VERSION_FIELDS = (pa.field("weight_versions", pa.list_(pa.int32())), pa.field("weight_version_max", pa.int64()))
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
    The dataset's schema is the union of the files' (a column missing from a file reads as null there), and
    a tito shard set always has the schema 3 version columns, null in older files: so a filter on them
    (:func:`sample_filter`) works on any directory, and :func:`iter_samples` derives their values.
    """
    by_format: dict[str, list[str]] = {}
    for f in shard_files(source):
        by_format.setdefault(SUFFIX_FORMAT[f.suffix], []).append(str(f))
    parts = [_dataset(files, fmt) for fmt, files in sorted(by_format.items())]
    if len(parts) == 1:
        return parts[0]
    schema = _union_schema([p.schema for p in parts])
    return ds.dataset([p.replace_schema(schema) if p.schema != schema else p for p in parts])


def _dataset(files: list[str], fmt: str) -> ds.FileSystemDataset:
    """The files as one dataset with the union of their schemas (pyarrow takes the first file's alone)."""
    first = ds.dataset(files, format=fmt)
    schemas = [first.schema] if len(files) == 1 else [f.physical_schema for f in first.get_fragments()]
    schema = _union_schema(schemas)
    return first if schema == first.schema else ds.dataset(files, format=fmt, schema=schema)


def _union_schema(schemas: list[pa.Schema]) -> pa.Schema:
    """Every field of ``schemas`` (the first one's metadata), plus the version columns for tito shards."""
    try:
        schema = pa.unify_schemas(schemas)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # conflicting types: pyarrow's own choice, the first
        schema = schemas[0]
    if "loss_mask" in schema.names and "weight_version" in schema.names:
        for f in VERSION_FIELDS:
            if f.name not in schema.names:
                schema = schema.append(f)
    return schema


def sample_filter(*, min_weight_version: int | None = None, max_weight_version: int | None = None,
                  min_reward: float | None = None, max_reward: float | None = None,
                  finish_reasons: Iterable[str] | None = None, max_breaks: int | None = None,
                  ) -> ds.Expression | None:
    """A compute expression keeping the samples that pass every given bound (bounds are inclusive);
    None when no bound is given.

    Weight versions bound every sampled token of a sample, not a summary of it: ``min_weight_version``
    tests ``weight_version``, the *lowest* version among its sampled tokens, so it keeps a sample only if
    no token is older (a trainer's staleness bound: ``min_weight_version=k - 1 - max_off_policy_steps``);
    ``max_weight_version`` tests ``weight_version_max``, the *highest*, so it keeps a sample only if no
    token is newer (``weight_version`` on shards of schema <= 2, where the two are equal).

    ``max_breaks`` bounds the rollout's number of breaks. Every break starts a new segment, so it is
    ``segment_count - 1`` (the length of the ``breaks`` JSON list): testing the int column keeps the
    filter a pushdown-able expression instead of JSON parsing in Python.
    """
    terms: list[ds.Expression] = []
    if min_weight_version is not None:
        terms.append(pc.field("weight_version") >= min_weight_version)
    if max_weight_version is not None:
        terms.append(pc.coalesce(pc.field("weight_version_max"), pc.field("weight_version")) <= max_weight_version)
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
    sampled tokens, 0 elsewhere), ``turn_index`` int16, ``weight_versions`` int32 (the weight version that
    sampled each token, -1 where ``loss_mask`` is false; None on a sample built by hand, taken then as
    ``meta["weight_version"]`` on every sampled token: :meth:`versions`). Arrays may be read-only views of
    Arrow memory. ``meta`` has ``weight_version`` and ``weight_version_max``, the lowest and highest."""

    token_ids: Any
    loss_mask: Any
    logprobs: Any
    turn_index: Any
    advantage: float
    rollout_id: str
    segment_index: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # the other scalar columns that were read
    weight_versions: Any = None

    def versions(self) -> np.ndarray:
        """``weight_versions`` as an int32 numpy array (derived from ``loss_mask`` and
        ``meta["weight_version"]`` when the sample has none)."""
        if self.weight_versions is not None:
            return np.asarray(self.weight_versions, dtype=np.int32)
        return np.where(np.asarray(self.loss_mask, dtype=bool), int(self.meta.get("weight_version") or 0),
                        -1).astype(np.int32)

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


def _versions_column(batch: pa.RecordBatch, mask: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of ``weight_versions``, like :func:`_list_column`. Rows without it (a shard of
    schema <= 2: the column is absent or null) get it derived from ``loss_mask`` and ``weight_version``:
    the row's one version on every sampled token, -1 elsewhere."""
    names = batch.schema.names
    if "weight_versions" in names and batch.column("weight_versions").null_count == 0:
        return _list_column(batch, "weight_versions")
    mask_values, offsets = mask
    low = batch.column("weight_version").fill_null(0).to_numpy() if "weight_version" in names \
        else np.zeros(batch.num_rows, np.int64)
    derived = np.full(len(mask_values), -1, np.int32)
    span = slice(offsets[0], offsets[-1])
    per_token = np.repeat(low.astype(np.int32), np.diff(offsets))
    derived[span] = np.where(mask_values[span], per_token, np.int32(-1))
    if "weight_versions" in names:  # a batch mixing old and new rows: keep the new rows' own versions
        col = batch.column("weight_versions")
        values = col.values.to_numpy(zero_copy_only=False)
        own = col.offsets.to_numpy()
        for i in np.flatnonzero(col.is_valid().to_numpy(zero_copy_only=False)):
            derived[offsets[i]:offsets[i + 1]] = values[own[i]:own[i + 1]]
    derived.flags.writeable = False  # like the views of Arrow memory
    return derived, offsets


def iter_samples(data: ds.Dataset | str | Path | Sequence[str | Path], *, filter: ds.Expression | None = None,
                 batch_size: int = 1024, torch: bool = False) -> Iterator[Sample]:
    """Stream samples from a dataset (or any source :func:`open_shards` takes), in file order, reading
    ``batch_size`` rows at a time. With ``torch=True`` the token arrays are ``torch.Tensor`` sharing the
    numpy memory (``torch.from_numpy``; read-only Arrow views are copied first, since torch requires
    writable memory)."""
    dataset = data if isinstance(data, ds.Dataset) else open_shards(data)
    names = set(dataset.schema.names)
    scalars = [c for c in SCALAR_COLUMNS if c in names]
    extra = [c for c in ("weight_versions", "weight_version") if c in names and c not in scalars]
    if torch:
        import torch as _torch
    for batch in dataset.to_batches(columns=list(TOKEN_COLUMNS) + scalars + extra, filter=filter,
                                    batch_size=batch_size):
        if batch.num_rows == 0:
            continue
        lists = {c: _list_column(batch, c) for c in TOKEN_COLUMNS}
        lists["weight_versions"] = _versions_column(batch, lists["loss_mask"])
        meta_cols = {c: batch.column(c).to_pylist() for c in scalars}
        if "weight_version_max" in meta_cols and "weight_version" in meta_cols:  # null in schema <= 2 rows
            meta_cols["weight_version_max"] = [low if high is None else high for low, high in
                                               zip(meta_cols["weight_version"], meta_cols["weight_version_max"])]
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


@dataclass
class StepBatch:
    """Batch ``step`` of a follow-mode run directory, sealed and checked (:func:`read_step`): its samples
    (those that passed the filters) and its manifest (``_manifest.json``: the files with their rows,
    tokens and sha256, and whatever the run recorded about the batch). Iterates, indexes and measures
    like the list of samples, so ``pack(batch, ...)`` takes it as it is."""

    step: int
    path: Path  # RUN_DIR/rollouts/step_<step>
    samples: list[Sample]
    manifest: dict[str, Any]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def read_step(run_dir: str | Path, k: int, *, timeout: float | None = None, poll_s: float = 0.2,
              verify: bool = True, torch: bool = False, **filters: Any) -> StepBatch:
    """Wait until batch ``k`` of the run directory ``run_dir`` is sealed (``rollouts/step_k/_manifest.json``
    exists: the follow service writes it last, and the batch never changes after), then return its
    samples that pass :func:`sample_filter` ``(**filters)`` as a :class:`StepBatch`, in file order.

    ``filters`` are checked before waiting (an unknown one is a TypeError at once). A trainer's staleness
    bound is ``min_weight_version=k - 1 - S``: it tests each sample's lowest sampled version, so every
    token of every sample returned is at most S versions behind the on-policy version k - 1.

    Waiting sleeps ``poll_s`` between checks (no busy loop); ``timeout`` seconds without the seal raise
    :class:`TimeoutError` naming the step and the directory (None: wait for ever). ``verify`` (default)
    checks the files the manifest lists before reading: a missing file or a sha256 that differs raises
    :class:`~rollout.data.shards.ShardCorrupt` naming it, as ``tito inspect`` and ``tito run --resume`` do.
    Only the files the manifest lists are read. Needs neither torch (unless ``torch=True``) nor Ray."""
    from . import layout
    from .outputs import check_integrity
    from .shards import DATA_DIR, ShardCorrupt, read_manifest

    expr = sample_filter(**filters)
    step = layout.step_dir(run_dir, k)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not layout.is_sealed(run_dir, k):
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError(f"batch {k} was not sealed within {timeout:g} s: no {step / layout.SEALED} "
                               f"(is tito run --follow {run_dir} running, and has it reached step {k}?)")
        time.sleep(poll_s if left is None else min(poll_s, left))
    manifest = read_manifest(step) or {}
    # entries name a file relative to the step directory (data/train-....arrow: write_outputs) or, as a
    # ShardWriter returns them, to its data/ folder; either way, as the path relative to the step directory
    files: list[Path] = []
    entries = []
    for entry in manifest.get("files", []):
        rel = Path(entry["file"])
        if not (step / rel).is_file() and (step / DATA_DIR / rel).is_file():
            rel = Path(DATA_DIR) / rel
        path = step / rel
        if not path.is_file():
            raise ShardCorrupt(f"{path}: listed in the sealed batch's manifest {step / layout.SEALED} but missing "
                               "(moved or deleted after the batch was sealed); restore it from a copy")
        files.append(path)
        entries.append({**entry, "file": rel.as_posix()})
    if verify:
        check_integrity(step, {**manifest, "files": entries})
    samples = list(iter_samples([str(f) for f in files], filter=expr, torch=torch)) if files else []
    return StepBatch(k, step, samples, manifest)
