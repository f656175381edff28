"""``tito export DIR --to trl|verl|skyrl|prime``: training shards rewritten in the field names and layout
each trainer reads, as a directory of Parquet files (``train-00000.parquet`` ...).

Every target keeps tito's token identity: the ids, the trainable tokens (``loss_mask``) and the sampler's
logprobs are copied, never re-tokenized. The targets differ in names and in the prompt/response split:

* ``trl``: ``input_ids``, ``completion_mask`` (TRL's names) and ``labels`` (the token where trainable,
  -100 elsewhere), one row per sample. ``SFTTrainer`` trains on the directory as it is.
* ``prime``: prime-rl's ``TrainingSample`` (``token_ids``, ``mask``, ``logprobs``, per-token
  ``temperatures``, ``env_name``, per-token ``advantages``): one flat sequence, no split.
* ``skyrl``: SkyRL's ``GeneratorOutput`` fields per trajectory (``prompt_token_ids``, ``response_ids``,
  ``loss_masks``, ``rewards``, ``rollout_logprobs``, ``stop_reasons``, ``trajectory_ids``, ``is_last_step``);
  :func:`skyrl_generator_output` gathers rows into the batch dict.
* ``verl``: the per-sample halves of verl's rollout ``DataProto`` (``prompts``, ``responses``,
  ``response_mask``, ``rollout_log_probs``, the reward and the GRPO ``uid``); :func:`verl_batch` pads them
  into the batch tensors (left-padded prompts, right-padded responses, ``input_ids``, ``attention_mask``,
  ``position_ids``, ``rm_scores``).

The split (verl, SkyRL): the prompt is every token before the first trainable one, the response is the
rest, with its mask. In a multi-turn sample the response therefore holds the later turns' context (tool
results, user messages, template scaffolding) with mask 0 and logprob 0: only sampled tokens train.
Samples with no trainable token (a rollout that failed before sampling) are skipped and counted.
The field sources are cited in docs/trainer.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from .readers import open_shards

TARGETS = ("trl", "verl", "skyrl", "prime")
IGNORE_INDEX = -100  # the label value PyTorch's cross-entropy (and TRL) skip
FILE_PREFIX = "train"  # Hugging Face datasets maps train-*.parquet to the "train" split
# finish reasons that mean the sample was cut at a token limit (SkyRL's stop reason "length")
TRUNCATED = frozenset({"length", "context_limit", "token_budget"})

_NEEDS = ("token_ids", "loss_mask", "logprobs", "message_index", "reward", "advantage", "group_id", "rollout_id",
          "task_id", "segment_index", "segment_count", "finish_reason", "temperature")

SCHEMAS: dict[str, pa.Schema] = {
    "trl": pa.schema([
        ("input_ids", pa.list_(pa.int32())),
        ("completion_mask", pa.list_(pa.bool_())),
        ("labels", pa.list_(pa.int32())),
    ]),
    "prime": pa.schema([
        ("token_ids", pa.list_(pa.int32())),
        ("mask", pa.list_(pa.bool_())),
        ("logprobs", pa.list_(pa.float32())),
        ("temperatures", pa.list_(pa.float32())),
        ("env_name", pa.string()),
        ("advantages", pa.list_(pa.float32())),
    ]),
    "skyrl": pa.schema([
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("loss_masks", pa.list_(pa.int8())),
        ("rewards", pa.float64()),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("stop_reasons", pa.string()),
        ("trajectory_ids", pa.struct([("instance_id", pa.string()), ("repetition_id", pa.int32())])),
        ("is_last_step", pa.bool_()),
    ]),
    "verl": pa.schema([
        ("prompts", pa.list_(pa.int32())),
        ("responses", pa.list_(pa.int32())),
        ("response_mask", pa.list_(pa.int8())),
        ("rollout_log_probs", pa.list_(pa.float32())),
        ("reward", pa.float64()),
        ("uid", pa.string()),
        ("num_turns", pa.int32()),
        ("rollout_id", pa.string()),
    ]),
}


@dataclass
class ExportResult:
    """What an export wrote: the target, the output directory, its files, rows written and samples skipped
    (no trainable token)."""

    target: str
    out: Path
    files: list[Path]
    rows: int
    skipped: int


def default_out(source: str | Path, target: str) -> Path:
    """``DIR-<target>`` beside the source directory: never inside it, so the source stays a directory of
    shards only (readers such as polars take every file under a directory)."""
    path = Path(source).expanduser()
    return path.with_name(f"{path.name}-{target}")


def first_trainable(mask: np.ndarray) -> int:
    """Index of the first trainable token: where the prompt ends. ``len(mask)`` when none is."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else len(mask)


def _run_defaults(source: str | Path | Sequence[str | Path] | ds.Dataset) -> dict[str, Any]:
    """The env name and sampling temperature the output directory's manifest records, if it has one."""
    if isinstance(source, (ds.Dataset, list, tuple)) or not Path(source).is_dir():
        return {}
    from .shards import read_manifest

    config = (read_manifest(Path(source)) or {}).get("config") or {}
    return {"env_name": (config.get("env") or {}).get("name"),
            "temperature": (config.get("sampling") or {}).get("temperature")}


def _rows(dataset: ds.Dataset, filter: ds.Expression | None, batch_size: int) -> Iterator[dict[str, Any]]:
    """Samples as dicts of numpy token arrays and python scalars, streamed by record batch."""
    names = set(dataset.schema.names)
    columns = [c for c in _NEEDS if c in names]
    for batch in dataset.to_batches(columns=columns, filter=filter, batch_size=batch_size):
        lists = {}
        for c in ("token_ids", "loss_mask", "logprobs", "message_index"):
            arr = batch.column(c)
            values = arr.values.to_numpy(zero_copy_only=False)
            lists[c] = (values, arr.offsets.to_numpy())
        scalars = {c: batch.column(c).to_pylist() for c in columns if c not in lists}
        for i in range(batch.num_rows):
            row = {c: v[o[i]:o[i + 1]] for c, (v, o) in lists.items()}
            row.update({c: vals[i] for c, vals in scalars.items()})
            yield row


class _Converter:
    """Turns one tito sample into one row of the target's schema."""

    def __init__(self, target: str, *, env_name: str, temperature: float | None) -> None:
        self.target = target
        self.env_name = env_name
        self.temperature = temperature
        self._repetition: dict[str, dict[str, int]] = {}  # SkyRL: group -> rollout -> repetition index

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        ids = row["token_ids"].astype(np.int32, copy=False)
        mask = row["loss_mask"].astype(bool, copy=False)
        logprobs = row["logprobs"].astype(np.float32, copy=False)
        if self.target == "trl":
            return {"input_ids": ids, "completion_mask": mask, "labels": np.where(mask, ids, IGNORE_INDEX)}
        if self.target == "prime":
            temperature = row.get("temperature")
            if temperature is None:
                temperature = self.temperature
            if temperature is None:
                raise ValueError(f"sample {row['rollout_id']} records no sampling temperature (an older shard): "
                                 "pass temperature=... (--temperature) for prime-rl's per-token temperatures")
            return {"token_ids": ids, "mask": mask, "logprobs": logprobs,
                    "temperatures": np.full(len(ids), temperature, np.float32), "env_name": self.env_name,
                    "advantages": np.where(mask, np.float32(row["advantage"]), np.float32(0))}
        start = first_trainable(mask)
        prompt, response = ids[:start], ids[start:]
        response_mask = mask[start:].astype(np.int8)
        response_logprobs = np.where(mask[start:], logprobs[start:], np.float32(0))
        if self.target == "skyrl":
            group = row.get("group_id") or row.get("task_id") or ""
            reps = self._repetition.setdefault(group, {})
            repetition = reps.setdefault(row["rollout_id"], len(reps))
            last = row.get("segment_index", 0) == (row.get("segment_count") or 1) - 1
            stop = "length" if row.get("finish_reason") in TRUNCATED and last else "stop"
            return {"prompt_token_ids": prompt, "response_ids": response, "loss_masks": response_mask,
                    "rewards": row["reward"], "rollout_logprobs": response_logprobs, "stop_reasons": stop,
                    "trajectory_ids": {"instance_id": group, "repetition_id": repetition}, "is_last_step": last}
        # verl counts chat turns of every role (system, user, assistant, tool): the messages the sample's tokens
        # belong to (-1 is template scaffolding)
        messages = row["message_index"]
        return {"prompts": prompt, "responses": response, "response_mask": response_mask,
                "rollout_log_probs": response_logprobs, "reward": row["reward"],
                "uid": row.get("group_id") or row.get("task_id"), "rollout_id": row["rollout_id"],
                "num_turns": int(np.unique(messages[messages >= 0]).size)}


def _table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    return pa.table({f.name: pa.array([r[f.name] for r in rows], f.type) for f in schema}, schema=schema)


def _write(table: pa.Table, path: Path) -> None:
    """Write under a hidden temporary name and rename, so a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def export(source: str | Path | Sequence[str | Path] | ds.Dataset, target: str, out: str | Path | None = None, *,
           filter: ds.Expression | None = None, env_name: str | None = None, temperature: float | None = None,
           rows_per_file: int = 4096, batch_size: int = 1024) -> ExportResult:
    """Write the samples of ``source`` (a shard directory, file, glob, list, or an opened dataset) that pass
    ``filter`` in ``target``'s layout into ``out`` (default :func:`default_out`), ``rows_per_file`` rows per
    Parquet file. ``env_name`` and ``temperature`` (prime-rl) default to what the output directory's
    manifest records; a row's own ``temperature`` column wins over both.

    Raises ValueError for an unknown target, an ``out`` that already holds files or lies inside the source,
    and (prime) a sample with no known temperature; FileNotFoundError when the source has no shards."""
    if target not in TARGETS:
        raise ValueError(f"unknown export target {target!r} (known: {', '.join(TARGETS)})")
    source_dir = None if isinstance(source, (ds.Dataset, list, tuple)) else Path(source).expanduser()
    if source_dir is not None and not source_dir.is_dir():
        source_dir = None
    if out is None:
        if source_dir is None:
            raise ValueError("the default export directory sits beside a source directory; for a file, a glob, a "
                             "list or a dataset give one (--out)")
        out = default_out(source_dir, target)
    out = Path(out).expanduser()
    # inside the run directory the export's files would join the shards for every directory reader
    if source_dir is not None and out.resolve().is_relative_to(source_dir.resolve()):
        raise ValueError(f"the export directory {out} is inside the source {source_dir}; choose another --out")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"export directory {out} already holds files; remove it or choose another --out")
    dataset = source if isinstance(source, ds.Dataset) else open_shards(source)
    defaults = _run_defaults(source)
    convert = _Converter(target, env_name=env_name if env_name is not None else (defaults.get("env_name") or ""),
                         temperature=temperature if temperature is not None else defaults.get("temperature"))
    schema = SCHEMAS[target].with_metadata({"tito.export": target, "tito.doc": "docs/trainer.md"})
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    pending: list[dict[str, Any]] = []
    rows = skipped = 0

    def flush() -> None:
        path = out / f"{FILE_PREFIX}-{len(files):05d}.parquet"
        _write(_table(pending, schema), path)
        files.append(path)
        pending.clear()

    for sample in _rows(dataset, filter, batch_size):
        if not sample["loss_mask"].any():
            skipped += 1
            continue
        pending.append(convert(sample))
        rows += 1
        if len(pending) >= rows_per_file:
            flush()
    if pending or not files:
        flush()  # an export with no rows still writes one empty file of the target's schema
    return ExportResult(target=target, out=out, files=files, rows=rows, skipped=skipped)


def skyrl_generator_output(source: str | Path | Sequence[str | Path]) -> dict[str, Any]:
    """A SkyRL ``GeneratorOutput`` dict (lists over the batch) from a ``skyrl`` export: the shape
    ``GeneratorInterface.generate`` returns. ``trajectory_ids`` are ``{"instance_id", "repetition_id"}``
    dicts (build ``TrajectoryID(**d)`` where SkyRL is installed); ``rollout_metrics`` is None."""
    table = ds.dataset(_parquet_files(source), format="parquet").to_table()
    out: dict[str, Any] = {name: table[name].to_pylist() for name in SCHEMAS["skyrl"].names}
    out["rollout_metrics"] = None
    return out


def verl_batch(source: str | Path | Sequence[str | Path], *, pad_token_id: int, prompt_length: int | None = None,
               response_length: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """verl's rollout ``DataProto`` contents from a ``verl`` export: ``(batch, non_tensor_batch)``, the
    tensors as verl's agent loop pads them (prompts left-padded to ``prompt_length``, responses right-padded
    to ``response_length``; default: the longest), all int64 except ``rollout_log_probs`` and ``rm_scores``
    (float32, the reward on each sample's last response token). ``DataProto.from_dict(tensors=batch,
    non_tensors=non_tensor_batch)`` builds the object where verl is installed. Raises ValueError when a
    sample is longer than the given lengths."""
    import torch

    table = ds.dataset(_parquet_files(source), format="parquet").to_table()
    prompts, responses = table["prompts"].to_pylist(), table["responses"].to_pylist()
    p_len = prompt_length if prompt_length is not None else max(map(len, prompts), default=0)
    r_len = response_length if response_length is not None else max(map(len, responses), default=0)
    if any(len(p) > p_len for p in prompts) or any(len(r) > r_len for r in responses):
        raise ValueError(f"a sample is longer than prompt_length={p_len} / response_length={r_len}")
    n = table.num_rows
    prompt_ids = torch.full((n, p_len), pad_token_id, dtype=torch.int64)
    prompt_attn = torch.zeros((n, p_len), dtype=torch.int64)
    response_ids = torch.full((n, r_len), pad_token_id, dtype=torch.int64)
    response_attn = torch.zeros((n, r_len), dtype=torch.int64)
    response_mask = torch.zeros((n, r_len), dtype=torch.int64)
    log_probs = torch.zeros((n, r_len), dtype=torch.float32)
    rm_scores = torch.zeros((n, r_len), dtype=torch.float32)
    for i, (p, r, m, lp, reward) in enumerate(zip(prompts, responses, table["response_mask"].to_pylist(),
                                                  table["rollout_log_probs"].to_pylist(), table["reward"].to_pylist())):
        if p:
            prompt_ids[i, p_len - len(p):] = torch.tensor(p)
            prompt_attn[i, p_len - len(p):] = 1
        response_ids[i, :len(r)] = torch.tensor(r)
        response_attn[i, :len(r)] = 1
        response_mask[i, :len(r)] = torch.tensor(m)
        log_probs[i, :len(r)] = torch.tensor(lp)
        rm_scores[i, len(r) - 1] = reward
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)
    batch = {
        "prompts": prompt_ids, "responses": response_ids, "response_mask": response_mask,
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1), "attention_mask": attention_mask,
        # positions count real tokens only: 0 on the left padding, then 0, 1, 2, ...
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
        "rollout_log_probs": log_probs, "rm_scores": rm_scores,
    }
    non_tensor = {"uid": np.array(table["uid"].to_pylist(), dtype=object),
                  "__num_turns__": np.array(table["num_turns"].to_pylist(), dtype=np.int32)}
    return batch, non_tensor


def _parquet_files(source: str | Path | Sequence[str | Path]) -> list[str]:
    if isinstance(source, (list, tuple)):
        return [f for s in source for f in _parquet_files(s)]
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(str(p) for p in path.glob("*.parquet") if not p.name.startswith((".", "_")))
        if not files:
            raise FileNotFoundError(f"no export files (*.parquet) in {path}")
        return files
    return [str(path)]


def describe(result: ExportResult) -> str:
    """One line for the command line."""
    skipped = f", skipped {result.skipped} without a trainable token" if result.skipped else ""
    return (f"exported {result.rows} samples for {result.target} to {result.out} "
            f"({len(result.files)} file{'s' if len(result.files) != 1 else ''}{skipped})")

