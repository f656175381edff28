"""``tito inspect PATH``: what a shard directory (or file) holds, and one sample with its trainable
tokens highlighted (ANSI in a terminal, plain marks in a pipe), or an HTML viewer (rollout/data/viewer.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from .readers import open_shards, shard_files


def _open(path: str | Path):
    """The shards at ``path`` (a file, a directory or a glob) as a lazy dataset; a clear error if none.
    An output directory's files are first checked against the manifest's checksums (ShardCorrupt names
    a file that changed)."""
    try:
        files = shard_files(path)
    except FileNotFoundError as exc:
        raise ValueError(str(exc)) from None
    verify(path)
    return open_shards(files), len(files)


_verified: dict[str, tuple] = {}  # directory -> the (name, size, mtime) of its files when last verified


def verify(path: str | Path) -> str:
    """Check an output directory's shards against the sha256 its manifest records (once per process
    while the files are unchanged) and say how that went; raises ShardCorrupt naming each bad file."""
    from .outputs import check_integrity
    from .shards import output_shards, read_manifest

    directory = Path(path)
    manifest = read_manifest(directory) if directory.is_dir() else None
    if manifest is None:
        return "no manifest here (a file or a glob): not verified"
    state = tuple((p.name, st.st_size, st.st_mtime_ns) for p in output_shards(directory) for st in [p.stat()])
    key = str(directory.resolve())
    if _verified.get(key, (None,))[0] != state:
        _verified[key] = (state, check_integrity(directory, manifest), len(state))
    _, checked, total = _verified[key]
    if not checked:
        return "none recorded (a manifest written before checksums): not verified"
    unlisted = f", {total - checked} not in the manifest" if total > checked else ""
    return f"sha256 ok ({checked} files{unlisted})"


def summarize(path: str | Path) -> dict[str, Any]:
    """Rows, tokens, trainable fraction, reward and break statistics, reading only the columns it needs."""
    data, n_files = _open(path)
    t = data.to_table(columns=["token_ids", "loss_mask", "reward", "rollout_id", "segment_count", "finish_reason",
                               "error", "segment_index"])
    tokens = pc.sum(pc.list_value_length(t["token_ids"])).as_py() or 0
    trainable = pc.sum(pc.list_flatten(t["loss_mask"])).as_py() or 0
    firsts = t.filter(pc.equal(t["segment_index"], 0)).select(
        ["reward", "rollout_id", "segment_count", "finish_reason", "error"]).to_pylist()
    rewards = [c["reward"] for c in firsts]
    segments = [c["segment_count"] for c in firsts]
    finish: dict[str, int] = {}
    for c in firsts:
        finish[c["finish_reason"]] = finish.get(c["finish_reason"], 0) + 1
    return {
        "files": n_files, "rows": t.num_rows, "rollouts": len({c["rollout_id"] for c in firsts}), "tokens": tokens,
        "trainable_fraction": trainable / tokens if tokens else 0.0,
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollouts_with_breaks": sum(1 for s in segments if s > 1),
        "extra_segments_from_breaks": sum(s - 1 for s in segments),
        "finish_reasons": finish, "errors": sum(c["error"] is not None for c in firsts),
        "checksums": verify(path), **_run_record(path),
    }


def _run_record(path: str | Path) -> dict[str, Any]:
    """What the output directory's manifest says about the run (model, group size, sampling), if any."""
    from .shards import read_manifest

    manifest = read_manifest(path) if Path(path).is_dir() else None
    if not manifest or "config" not in manifest:
        return {}
    return {"model": manifest.get("model"), "group_size": manifest.get("group_size"),
            "sampling": manifest.get("sampling")}


def _sample(path: str | Path, index: int) -> dict[str, Any]:
    data, _ = _open(path)
    rows = data.count_rows()
    if not 0 <= index < rows:
        raise ValueError(f"sample {index} is out of range: the shards hold {rows} rows")
    return data.take([index]).to_pylist()[0]


def _pieces(row: dict, tokenizer) -> list[tuple[str, bool]]:
    """Decoded runs of tokens with the same trainability (decoding runs, not single tokens, keeps
    multi-byte characters whole)."""
    out: list[tuple[str, bool]] = []
    ids, mask = row["token_ids"], row["loss_mask"]
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            out.append((tokenizer.decode(ids[start:i]), bool(mask[start])))
            start = i
    return out


def render_terminal(row: dict, tokenizer, color: bool = True) -> str:
    """The sample as text: trainable runs on green with ``color``, else between ``[[`` and ``]]`` (a pipe,
    a log or ``NO_COLOR`` gets no escape codes)."""
    head = (f"rollout {row['rollout_id']}  segment {row['segment_index'] + 1}/{row['segment_count']}  "
            f"reward {row['reward']:.3f}  advantage {row['advantage']:.3f}  finish {row['finish_reason']}\n"
            + ("trainable tokens in green\n\n" if color else "trainable tokens between [[ and ]]\n\n"))
    on, off = ("\x1b[42;30m", "\x1b[0m") if color else ("[[", "]]")
    body = "".join(f"{on}{text}{off}" if trainable else text for text, trainable in _pieces(row, tokenizer))
    breaks = json.loads(row["breaks"])
    tail = "\n\nbreaks: " + (", ".join(f"turn {b['turn']} {b['reason']}" for b in breaks) if breaks else "none")
    return head + body + tail


def inspect(path: str | Path, *, sample: int = 0, html_out: str | None = None, tokenizer=None, limit: int = 200,
            color: bool = False) -> str:
    """The summary text, plus the sample rendered for the terminal (``color``: ANSI colours; the command
    line asks for them on a terminal without NO_COLOR), or ``limit`` samples from ``sample`` written as an HTML viewer
    (rollout/data/viewer.py; token ids instead of text without a tokenizer)."""
    summary = summarize(path)
    lines = [f"  {k:<28} {v}" for k, v in summary.items()]
    text = "shards: " + str(path) + "\n" + "\n".join(lines)
    if html_out:
        from .viewer import write_viewer

        n = write_viewer(path, html_out, start=sample, limit=limit, tokenizer=tokenizer)
        ids_only = "" if tokenizer is not None else " (no tokenizer: token ids shown)"
        return text + f"\n\n{n} samples from row {sample} written to {html_out}{ids_only}"
    if tokenizer is None:
        return text
    row = _sample(path, sample)
    return text + "\n\n" + render_terminal(row, tokenizer, color)
