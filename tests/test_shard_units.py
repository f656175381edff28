"""ShardWriter units: a group's rows always land in one file, files are written per finished unit
batch (rows or time threshold), and ``flush`` puts pending rows on disk at once (what ``tito serve``
calls when a session is deleted)."""

from __future__ import annotations

import time

from rollout.data.shards import DATA_DIR, ShardWriter, read_table
from rollout.renderer_service import RendererService
from rollout.turns import RolloutMeta

from ._support import tokenizer_dir
from .test_data import synthetic_row


def _group(g: int, size: int) -> list[dict]:
    return [dict(synthetic_row(g * 10 + k), group_id=f"g{g}", rollout_id=f"g{g}#{k}") for k in range(size)]


def test_a_group_never_straddles_two_files(tmp_path):
    w = ShardWriter(tmp_path, rows_per_file=4)
    for g in range(5):
        w.add(_group(g, 3))  # 3 rows a group, 4 a file: the old writer split every other group
    files = w.close()
    seen: dict[str, str] = {}
    for f in files:
        for gid in read_table(tmp_path / f["file"])["group_id"].to_pylist():
            assert seen.setdefault(gid, f["file"]) == f["file"], f"group {gid} straddles two files"
    assert len(seen) == 5 and sum(f["rows"] for f in files) == 15
    assert all(f["rows"] <= 4 + 3 for f in files)  # at most rows_per_file + one group


def test_flush_writes_pending_rows_now(tmp_path):
    w = ShardWriter(tmp_path, rows_per_file=1024)
    assert w.flush() == []  # nothing pending: a no-op
    w.add(_group(0, 2))
    assert not list(tmp_path.glob("*.arrow")), "below rows_per_file and no interval: still pending"
    new = w.flush()
    assert [f["rows"] for f in new] == [2] and (tmp_path / new[0]["file"]).exists()
    assert w.flush() == [] and w.close() == new


def test_interval_flushes_a_slow_run(tmp_path):
    w = ShardWriter(tmp_path, rows_per_file=1024, flush_interval_s=0.2)
    w.add(_group(0, 2))
    deadline = time.monotonic() + 5
    while not list(tmp_path.glob("*.arrow")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [read_table(p).num_rows for p in tmp_path.glob("*.arrow")] == [2]
    w0 = ShardWriter(tmp_path / "each", flush_interval_s=0)  # 0: a file per unit
    w0.add(_group(1, 2))
    w0.add(_group(2, 2))
    assert len(list((tmp_path / "each").glob("*.arrow"))) == 2


def test_renderer_service_flush(tmp_path):
    model = str(tokenizer_dir("qwen2.5-7b-instruct"))
    assert RendererService(model).flush() == []  # no output directory
    svc = RendererService(model, out_dir=str(tmp_path))
    msgs = [{"role": "user", "content": "2+2?"}]
    svc.begin("s1", msgs, None)
    assert svc.flush() == []
    assert svc.finish("s1", RolloutMeta(task_id="s1", group_id="s1", messages=msgs)) == 1
    new = svc.flush()
    assert [f["rows"] for f in new] == [1]
    row = read_table(tmp_path / DATA_DIR / new[0]["file"]).to_pylist()[0]
    assert row["rollout_id"] == "s1" and row["temperature"] is None  # a caller that gave no sampling: null
