"""rollout.data.readers: opening shard files/directories/globs lazily, pushdown filters, zero-copy samples, and
interop with Hugging Face ``datasets`` (Arrow IPC file format and Parquet)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from rollout.data import iter_samples, load_samples, open_shards, sample_filter, shard_files
from rollout.data.shards import ShardWriter


def synthetic_row(i: int, n: int = 12, prompt: int = 5) -> dict:
    """A schema-complete row: ``prompt`` context tokens then ``n - prompt`` sampled ones; fields vary with i."""
    mask = [False] * prompt + [True] * (n - prompt)
    segs = 1 + i % 3
    return {
        "token_ids": [(i * 31 + t) % 1000 for t in range(n)], "loss_mask": mask,
        "logprobs": [-(0.01 * (t + 1)) if m else 0.0 for t, m in enumerate(mask)],
        "message_index": [0] * n, "turn_index": [t // 6 for t in range(n)], "messages": "[]",
        "reward": float(i % 4), "reward_components": "{}", "advantage": float(i % 4) - 1.5,
        "task_id": f"t{i // 2}", "group_id": f"g{i // 2}", "rollout_id": f"r{i}", "segment_index": 0,
        "segment_count": segs, "finish_reason": ["env_done", "length", "error"][i % 3],
        "breaks": json.dumps([{"turn": k, "reason": "x"} for k in range(segs - 1)]), "weight_version": i % 5,
        "model": "m", "renderer": "r", "template_sha256": "0", "prompt_tokens": prompt,
        "completion_tokens": n - prompt, "error": None,
    }


def write_shards(directory, count: int, fmt: str = "arrow", rows_per_file: int = 4, n=lambda i: 12) -> list[dict]:
    rows = [synthetic_row(i, n(i)) for i in range(count)]
    w = ShardWriter(directory, fmt=fmt, rows_per_file=rows_per_file)
    for row in rows:  # one unit each: files of rows_per_file rows
        w.add([row])
    w.close()
    return rows


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_open_file_directory_and_glob(tmp_path, fmt):
    rows = write_shards(tmp_path, 10, fmt)
    (tmp_path / f".shard-00009.{fmt}.tmp").write_bytes(b"partial")  # an in-progress temporary is ignored
    files = shard_files(tmp_path)
    assert len(files) == 3 and all(f.suffix == f".{fmt}" for f in files)
    for source in (tmp_path, str(tmp_path / f"*.{fmt}"), files):
        d = open_shards(source)
        assert isinstance(d, ds.Dataset) and d.count_rows() == 10
    assert open_shards(files[0]).count_rows() == 4
    got = load_samples(tmp_path)
    assert [s.rollout_id for s in got] == [r["rollout_id"] for r in rows]
    with pytest.raises(FileNotFoundError):
        open_shards(tmp_path / "nothing-*.arrow")


def test_mixed_formats_union(tmp_path):
    write_shards(tmp_path, 4, "arrow")
    w = ShardWriter(tmp_path, stream="pq", fmt="parquet")
    w.add([synthetic_row(i) for i in range(4, 7)])
    w.close()
    assert open_shards(tmp_path).count_rows() == 7


def test_samples_are_typed_views_of_the_rows(tmp_path):
    rows = write_shards(tmp_path, 7, n=lambda i: 6 + i)
    samples = list(iter_samples(tmp_path, batch_size=3))
    assert len(samples) == 7
    for s, r in zip(samples, rows):
        assert s.token_ids.dtype == np.int32 and s.loss_mask.dtype == np.bool_
        assert s.logprobs.dtype == np.float32 and s.turn_index.dtype == np.int16
        assert s.token_ids.tolist() == r["token_ids"] and s.loss_mask.tolist() == r["loss_mask"]
        np.testing.assert_array_equal(s.logprobs, np.array(r["logprobs"], np.float32))
        assert s.advantage == r["advantage"] and s.meta["finish_reason"] == r["finish_reason"]
    # zero-copy: token ids of one batch share one Arrow buffer (numpy views are read-only, not owners)
    assert not samples[0].token_ids.flags.owndata and not samples[0].token_ids.flags.writeable
    assert np.shares_memory(samples[0].token_ids.base, samples[1].token_ids.base)
    t = next(iter_samples(tmp_path, torch=True))
    import torch

    assert t.token_ids.dtype == torch.int32 and t.loss_mask.dtype == torch.bool and t.logprobs.dtype == torch.float32


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_filters(tmp_path, fmt):
    rows = write_shards(tmp_path, 20, fmt)

    def kept(**f):
        return [s.rollout_id for s in iter_samples(tmp_path, filter=sample_filter(**f))]

    def expect(pred):
        return [r["rollout_id"] for r in rows if pred(r)]

    assert sample_filter() is None
    assert kept(min_weight_version=2, max_weight_version=3) == expect(lambda r: 2 <= r["weight_version"] <= 3)
    assert kept(min_reward=1.0, max_reward=2.0) == expect(lambda r: 1 <= r["reward"] <= 2)
    assert kept(finish_reasons={"length", "error"}) == expect(lambda r: r["finish_reason"] in ("length", "error"))
    assert kept(max_breaks=1) == expect(lambda r: len(json.loads(r["breaks"])) <= 1)
    assert kept(max_breaks=0, min_reward=3) == expect(lambda r: r["segment_count"] == 1 and r["reward"] >= 3)
    assert kept(finish_reasons=[]) == []


def test_datasets_reads_ipc_file_shards_and_parquet(tmp_path):
    """HF datasets: ``load_dataset("arrow")`` reads our IPC *file* shards and ``load_dataset("parquet")``
    our Parquet ones, list columns keeping their element types. ``Dataset.from_file`` reads only the IPC
    *stream* format (datasets' own cache files), so it rejects our shards: docs/trainer.md says so."""
    datasets = pytest.importorskip("datasets")
    write_shards(tmp_path / "a", 6, "arrow")
    write_shards(tmp_path / "p", 6, "parquet")
    arrow_files = [str(f) for f in shard_files(tmp_path / "a")]
    loaded = {
        "arrow": datasets.load_dataset("arrow", data_files=arrow_files, split="train",
                                       cache_dir=str(tmp_path / "cache")),
        "parquet": datasets.load_dataset("parquet", data_files=[str(f) for f in shard_files(tmp_path / "p")],
                                         split="train", cache_dir=str(tmp_path / "cache")),
    }
    for how, d in loaded.items():
        assert d.num_rows == 6, how
        f = d.features
        assert f["token_ids"].feature.dtype == "int32" and f["loss_mask"].feature.dtype == "bool", how
        assert f["logprobs"].feature.dtype == "float32" and f["turn_index"].feature.dtype == "int16", how
        assert f["advantage"].dtype == "float64" and f["weight_version"].dtype == "int64", how
        assert d[0]["rollout_id"] == "r0" and d[0]["token_ids"] == synthetic_row(0)["token_ids"], how
    with pytest.raises(pa.ArrowInvalid):
        datasets.Dataset.from_file(arrow_files[0])
    t = loaded["arrow"].with_format("torch")[0]
    import torch

    # datasets' torch formatter widens integer columns to int64 (what embedding layers take anyway)
    assert t["token_ids"].dtype == torch.int64 and t["loss_mask"].dtype == torch.bool
    assert t["logprobs"].dtype == torch.float32
    assert isinstance(loaded["arrow"].data.table, pa.Table)
