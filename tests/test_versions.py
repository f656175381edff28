"""Per-token weight versions (follow mode, issue 30): a turn sampled under two weight versions keeps the
version of every token through the renderer service, the shards, the readers and packing; shards of
schema 2 (without the columns) still read and resume; ``read_step`` waits for a sealed batch; the
renderer service writes per-batch outputs into their own directories."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from rollout.data import Sample, iter_samples, layout, open_shards, read_step, sample_filter
from rollout.data.outputs import complete_groups, drop_groups, write_outputs
from rollout.data.packing import pack, pad
from rollout.data.shards import (
    DATA_DIR,
    SCHEMA,
    SCHEMA_VERSION,
    VERSION_COLUMNS,
    ShardCorrupt,
    ShardWriter,
    read_table,
    rows_to_table,
    write_manifest,
)
from rollout.renderer_service import RendererService
from rollout.turns import Finished, RolloutMeta, SampledTurn

from ._support import tokenizer_dir
from .test_data import synthetic_row

MODEL = "qwen2.5-7b-instruct"


@pytest.fixture(scope="module")
def model() -> str:
    return str(tokenizer_dir(MODEL))


@pytest.fixture(scope="module")
def service(model):
    """RendererService(model, **kw), the tokenizer loaded once for the module (seconds each on 2 cores)."""
    from unittest import mock

    import tito_renderers

    tok = tito_renderers.load_tokenizer(model)

    def make(**kw) -> RendererService:
        with mock.patch.object(tito_renderers, "load_tokenizer", return_value=tok):
            return RendererService(model, **kw)

    return make


def _two_version_rollout(svc: RendererService, rid: str = "t#0") -> list[int]:
    """One rollout whose second turn a weight update stopped: tokens of versions 3, 3, 4, 4. Returns the
    prompt's length."""
    msgs = [{"role": "user", "content": "2+2?"}]
    first = svc.begin(rid, msgs, None)
    ids = svc.tokenizer.encode("4<|im_end|>")
    assert len(ids) == 2
    svc.extend(rid, SampledTurn(0, ids, [-0.5, -0.5], 3, {"role": "assistant", "content": "4"}),
               [{"role": "user", "content": "and 3+3?"}])
    second = svc.tokenizer.encode("6 it is<|im_end|>")[:4]
    svc.record_turn(rid, SampledTurn(1, second, [-0.1] * 4, 3, {"role": "assistant", "content": "6 it is"},
                                     versions=[3, 3, 4, 4]))
    return first.ids


def _group_meta(rid: str = "t#0") -> Finished:
    return Finished(rid, RolloutMeta(task_id="t", group_id="t"))


# ---- shards ---------------------------------------------------------------------------------------


def test_a_turn_sampled_by_two_versions_keeps_each_tokens_version(tmp_path, service):
    svc = service(out_dir=str(tmp_path))
    prompt = _two_version_rollout(svc)
    assert svc.finish_group([_group_meta()]) == 1
    out = svc.close()
    assert out["write_error"] is None and out["outputs"] == {}
    row = read_table(tmp_path / DATA_DIR / out["files"][0]["file"]).to_pylist()[0]
    versions, mask = row["weight_versions"], row["loss_mask"]
    assert len(versions) == len(row["token_ids"])
    assert versions[: len(prompt)] == [-1] * len(prompt)  # the first prompt is context
    assert all(v == -1 for v, m in zip(versions, mask) if not m)
    # turn 0 sampled two tokens under version 3; turn 1 was stopped after two and resumed under 4
    assert [v for v, m in zip(versions, mask) if m] == [3, 3, 3, 3, 4, 4]
    assert (row["weight_version"], row["weight_version_max"]) == (3, 4)


def test_session_sample_shows_per_token_versions_and_keeps_per_turn_ones(service):
    svc = service()
    _two_version_rollout(svc, "s")
    (seg,) = svc.sample("s")["segments"]
    assert seg["weight_versions"] == [3, 3]  # as before: one per turn, its lowest version
    assert len(seg["token_weight_versions"]) == len(seg["token_ids"])
    assert [v for v, m in zip(seg["token_weight_versions"], seg["loss_mask"]) if m] == [3, 3, 3, 3, 4, 4]
    assert (seg["weight_version"], seg["weight_version_max"]) == (3, 4)


def test_a_rollout_without_sampled_tokens_is_version_0(tmp_path, service):
    svc = service(out_dir=str(tmp_path))
    svc.begin("t#0", [{"role": "user", "content": "hi"}], None)
    svc.finish_group([Finished("t#0", RolloutMeta(task_id="t", group_id="t", error="engine died")),
                      Finished("t#1", RolloutMeta(task_id="t", group_id="t", error="never rendered"))])
    rows = read_table(tmp_path / DATA_DIR / svc.close()["files"][0]["file"]).to_pylist()
    for row in rows:
        assert (row["weight_version"], row["weight_version_max"]) == (0, 0)
        assert set(row["weight_versions"]) <= {-1} and len(row["weight_versions"]) == len(row["token_ids"])


def test_misaligned_versions_are_refused(service):
    svc = service()
    svc.begin("r", [{"role": "user", "content": "hi"}], None)
    with pytest.raises(ValueError, match="3 weight versions for 2 completion tokens"):
        svc.record_turn("r", SampledTurn(0, [1, 2], None, 0, {"role": "assistant", "content": "x"}, versions=[0, 0, 1]))
    row = synthetic_row(0)
    with pytest.raises(ValueError, match="weight_versions has 3 entries for 12 tokens"):
        rows_to_table([dict(row, weight_versions=[0, 0, 0])])
    with pytest.raises(ValueError, match="-1 where loss_mask is false"):
        rows_to_table([dict(row, weight_versions=[0] * 12)])


def test_rows_without_the_version_columns_get_them_derived():
    row = synthetic_row(3)  # weight_version 3, 5 context tokens then 7 sampled
    t = rows_to_table([row, dict(synthetic_row(4), weight_versions=[-1] * 5 + [4, 4, 5, 5, 5, 6, 6],
                                 weight_version_max=6)])
    assert t["weight_versions"].to_pylist() == [[-1] * 5 + [3] * 7, [-1] * 5 + [4, 4, 5, 5, 5, 6, 6]]
    assert t["weight_version_max"].to_pylist() == [3, 6]


# ---- readers and packing --------------------------------------------------------------------------


def _versioned_row(i: int, versions: list[int]) -> dict:
    """synthetic_row(i) (5 context tokens, 7 sampled) whose sampled tokens have ``versions``."""
    return dict(synthetic_row(i), weight_versions=[-1] * 5 + versions, weight_version=min(versions),
                weight_version_max=max(versions))


def test_samples_and_packed_rows_carry_the_versions(tmp_path):
    w = ShardWriter(tmp_path)
    w.add([_versioned_row(0, [3, 3, 3, 4, 4, 4, 4]), _versioned_row(1, [5] * 7)])
    w.close()
    a, b = iter_samples(tmp_path)
    assert a.weight_versions.dtype == np.int32 and a.weight_versions.tolist() == [-1] * 5 + [3, 3, 3, 4, 4, 4, 4]
    assert (a.meta["weight_version"], a.meta["weight_version_max"]) == (3, 4)
    (row,) = pack([a, b], budget=64, shuffle=False)
    assert row.weight_versions.dtype == np.int32
    assert row.weight_versions.tolist() == [-1] * 5 + [3, 3, 3, 4, 4, 4, 4] + [-1] * 5 + [5] * 7
    assert ((row.weight_versions >= 0) == row.loss_mask).all()
    # a split piece's first token is not trained: no version either
    pieces = pack([a], budget=8, allow_split=True, shuffle=False)
    assert [r.weight_versions.tolist() for r in pieces] == [[-1] * 5 + [3, 3, 3], [-1, 4, 4, 4]]
    padded = pad([a, Sample(np.arange(3, dtype=np.int32), np.array([False, True, True]), np.zeros(3, np.float32),
                            np.zeros(3, np.int16), 1.0, "hand", meta={"weight_version": 7})])
    assert padded["weight_versions"].tolist() == [[-1] * 5 + [3, 3, 3, 4, 4, 4, 4], [-1, 7, 7] + [-1] * 9]


def test_staleness_filters_bound_every_token(tmp_path):
    w = ShardWriter(tmp_path)
    w.add([_versioned_row(0, [3] * 3 + [4] * 4), _versioned_row(1, [4] * 7), _versioned_row(2, [4] * 3 + [5] * 4)])
    w.close()

    def kept(**f):
        return [s.rollout_id for s in iter_samples(tmp_path, filter=sample_filter(**f))]

    assert kept(min_weight_version=4) == ["r1", "r2"]  # r0 has tokens of version 3
    assert kept(max_weight_version=4) == ["r0", "r1"]  # r2 has tokens of version 5
    assert kept(min_weight_version=4, max_weight_version=4) == ["r1"]


def _write_schema2(path, rows: list[dict], fmt: str = "arrow") -> None:
    """A shard file as schema 2 wrote it: no weight_versions, no weight_version_max."""
    import pyarrow.parquet as pq

    old = pa.schema([f for f in SCHEMA if f.name not in VERSION_COLUMNS], metadata={"tito.schema_version": "2"})
    table = pa.Table.from_pylist([{k: r.get(k) for k in old.names} for r in rows], schema=old)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "arrow":
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, old) as w:
            w.write_table(table)
    else:
        pq.write_table(table, path)


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_schema_2_shards_read_beside_schema_3_ones(tmp_path, fmt):
    data = tmp_path / DATA_DIR
    # the old file sorts first: its schema must not hide the new file's columns
    _write_schema2(data / f"train-r0-00000.{fmt}", [synthetic_row(2), synthetic_row(3)], fmt)
    w = ShardWriter(data, stream="train-r0", fmt=fmt)
    w.add([_versioned_row(10, [6, 6, 6, 7, 7, 7, 7])])
    w.close()
    assert sorted(p.name for p in data.iterdir())[0] == f"train-r0-00000.{fmt}"
    got = {s.rollout_id: s for s in iter_samples(tmp_path, batch_size=2)}
    assert got["r2"].weight_versions.tolist() == [-1] * 5 + [2] * 7  # derived: one version, its weight_version
    assert got["r2"].meta["weight_version_max"] == 2
    assert got["r10"].weight_versions.tolist() == [-1] * 5 + [6, 6, 6, 7, 7, 7, 7]
    assert got["r10"].meta["weight_version_max"] == 7
    assert [s.rollout_id for s in iter_samples(tmp_path, filter=sample_filter(max_weight_version=3))] == ["r2", "r3"]
    # an old directory alone: the version columns are still there to filter on, and derived
    only_old = tmp_path / "old"
    _write_schema2(only_old / DATA_DIR / f"train-r0-00000.{fmt}", [synthetic_row(4)], fmt)
    assert "weight_version_max" in open_shards(only_old).schema.names
    (s,) = iter_samples(only_old, filter=sample_filter(max_weight_version=4, min_weight_version=4))
    assert s.weight_versions.tolist() == [-1] * 5 + [4] * 7 and s.meta["weight_version_max"] == 4
    assert [r.weight_versions.tolist() for r in pack([s], 64)] == [[-1] * 5 + [4] * 7]


def test_resume_repair_rewrites_a_schema_2_file_with_derived_versions(tmp_path):
    """The resume steps on an old directory (tito run --resume runs them; tests/test_run.py runs the
    whole resume): check, find the broken group, rewrite its file in schema 3."""
    from rollout.data.outputs import check_resume

    out = tmp_path / "out"
    one = {"segment_count": 1, "breaks": "[]"}
    whole = [dict(synthetic_row(i), group_id="g0", task_id="g0", rollout_id=f"g0#{i}", **one) for i in range(2)]
    partial = [dict(synthetic_row(3), group_id="g1", task_id="g1", rollout_id="g1#0", **one)]
    _write_schema2(out / DATA_DIR / "train-r0-00000.arrow", whole + partial)
    write_outputs(out, {"model": "m"}, {})  # a manifest with checksums, as schema 2 wrote it
    check_resume(out, {"model": "m"}, "")
    assert complete_groups(out, 2) == ({"g0"}, {"g1"})
    drop_groups(out, {"g1"})
    table = read_table(out / DATA_DIR / "train-r0-00000.arrow")
    assert table.schema.metadata[b"tito.schema_version"] == SCHEMA_VERSION.encode()
    assert table["rollout_id"].to_pylist() == ["g0#0", "g0#1"]
    assert table["weight_versions"].to_pylist() == [[-1] * 5 + [0] * 7, [-1] * 5 + [1] * 7]
    assert table["weight_version_max"].to_pylist() == [0, 1]
    check_resume(out, {"model": "m"}, "")  # the manifest follows the rewrite: checksums still hold


# ---- read_step ------------------------------------------------------------------------------------


def _seal(run_dir, k: int, rows: list[dict]) -> None:
    """Batch k as the follow service writes it: shards in step_k/data/, then the manifest."""
    step = layout.step_dir(run_dir, k)
    w = ShardWriter(step / DATA_DIR, stream="train-r0")
    w.add(rows)
    files = w.close()
    write_manifest(step, [{**f, "file": f"{DATA_DIR}/{f['file']}"} for f in files], {"step": k})


def test_read_step_waits_for_the_seal(tmp_path):
    rows = [_versioned_row(0, [1] * 7), _versioned_row(1, [0] * 3 + [1] * 4)]
    sealer = threading.Timer(0.5, _seal, (tmp_path, 2, rows))
    start = time.monotonic()
    sealer.start()
    try:
        batch = read_step(tmp_path, 2, timeout=30, poll_s=0.05)
    finally:
        sealer.join()
    assert time.monotonic() - start >= 0.5
    assert batch.step == 2 and batch.path == layout.step_dir(tmp_path, 2) and batch.manifest["step"] == 2
    assert [s.rollout_id for s in batch] == ["r0", "r1"] and len(batch) == 2
    assert batch[1].weight_versions.tolist() == [-1] * 5 + [0, 0, 0, 1, 1, 1, 1]
    # the trainer's staleness bound for step 2 with S = 0: every token from version >= 1
    assert [s.rollout_id for s in read_step(tmp_path, 2, min_weight_version=1)] == ["r0"]
    assert len(pack(batch, budget=32)) == 1


def test_read_step_times_out_naming_the_step(tmp_path):
    layout.step_dir(tmp_path, 3).mkdir(parents=True)  # being written, not sealed
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"batch 3 was not sealed within 0.3 s") as err:
        read_step(tmp_path, 3, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 5
    assert str(layout.step_dir(tmp_path, 3) / "_manifest.json") in str(err.value)
    with pytest.raises(TypeError):
        read_step(tmp_path, 3, timeout=0, min_wieght_version=1)  # a misspelt filter fails before waiting


def test_read_step_refuses_a_corrupt_batch(tmp_path):
    _seal(tmp_path, 1, [synthetic_row(0)])
    (shard,) = (layout.step_dir(tmp_path, 1) / DATA_DIR).iterdir()
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match="differs from the manifest"):
        read_step(tmp_path, 1, timeout=1)
    shard.unlink()
    with pytest.raises(ShardCorrupt, match="missing"):
        read_step(tmp_path, 1, timeout=1)


def test_read_step_takes_writer_entries_relative_to_data(tmp_path):
    step = layout.step_dir(tmp_path, 1)
    w = ShardWriter(step / DATA_DIR)
    w.add([synthetic_row(0)])
    write_manifest(step, w.close())  # names as ShardWriter returns them: train-00000.arrow
    assert [s.rollout_id for s in read_step(tmp_path, 1)] == ["r0"]
    manifest = json.loads((step / "_manifest.json").read_text())
    manifest["files"][0]["sha256"] = "0" * 64
    (step / "_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardCorrupt):  # still checked
        read_step(tmp_path, 1)


# ---- per-batch outputs of the renderer service ----------------------------------------------------


def test_batches_land_in_their_own_directories(tmp_path, service):
    svc = service(out_dir=str(tmp_path / "run"), stream="train-r3", rows_per_file=1024)
    steps = {k: layout.step_dir(tmp_path, k) for k in (1, 2)}
    for k, rid in ((1, "a#0"), (2, "b#0"), (1, "c#0")):
        _two_version_rollout(svc, rid)
        svc.finish_group([Finished(rid, RolloutMeta(task_id=rid[0], group_id=rid[0]))], out_dir=str(steps[k]))
    _two_version_rollout(svc, "d#0")
    svc.finish_group([Finished("d#0", RolloutMeta(task_id="d", group_id="d"))])  # the service's own output
    one = svc.close_output(str(steps[1]) + "/")  # the same directory, however it is spelt
    assert one["write_error"] is None and [(f["file"], f["rows"]) for f in one["files"]] == [("train-r3-00000.arrow", 2)]
    assert len(one["files"][0]["sha256"]) == 64
    table = read_table(steps[1] / DATA_DIR / "train-r3-00000.arrow")
    assert table["rollout_id"].to_pylist() == ["a#0", "c#0"]
    assert table["weight_version_max"].to_pylist() == [4, 4]
    assert not (steps[2] / DATA_DIR).exists() or not list((steps[2] / DATA_DIR).glob("*.arrow"))  # pending
    assert svc.close_output(str(tmp_path / "never")) == {"files": [], "write_error": None}
    out = svc.close()  # closes batch 2's writer too, reported apart from the run's own files
    assert [f["rows"] for f in out["files"]] == [1]
    assert read_table(tmp_path / "run" / DATA_DIR / out["files"][0]["file"])["rollout_id"].to_pylist() == ["d#0"]
    (key,) = out["outputs"]
    assert key == str(steps[2]) and [f["rows"] for f in out["outputs"][key]["files"]] == [1]
    assert read_table(steps[2] / DATA_DIR / "train-r3-00000.arrow")["rollout_id"].to_pylist() == ["b#0"]


def test_local_renderer_handle_passes_out_dir(tmp_path, service):
    import asyncio

    from rollout.handles import LocalRenderer

    svc = service()  # no output directory of its own: batch outputs still work
    handle = LocalRenderer(svc)
    _two_version_rollout(svc)

    async def main():
        await handle.finish_group([_group_meta()], out_dir=str(tmp_path / "step_1"))
        return await handle.close_output(str(tmp_path / "step_1"))

    out = asyncio.run(main())
    assert [f["rows"] for f in out["files"]] == [1] and out["write_error"] is None
    assert (tmp_path / "step_1" / DATA_DIR / out["files"][0]["file"]).is_file()
