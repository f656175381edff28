"""An output directory, exactly as ``tito run`` lays it out (shards through RendererService's ShardWriter
into data/, manifest and summary rebuilt by rollout.data.outputs, a break log beside them), opens with every
reader docs/shards.md names, each pointed at the directory itself: pyarrow.dataset, polars, HF datasets,
DuckDB, pandas, Ray Data, rollout.data.readers and tito inspect. A run still writing (a hidden temporary in data/)
disturbs none of them. The old schema-1 flat layout still opens with tito's own readers."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from rollout.config import RunConfig
from rollout.data import open_shards, shard_files
from rollout.data.inspect_shards import summarize
from rollout.data.outputs import write_outputs
from rollout.data.shards import BREAKS, DATA_DIR, MANIFEST, STREAM, SUMMARY, ShardWriter

from .test_data import synthetic_row

GROUPS, G = 5, 2


def make_output(out, fmt: str) -> list[dict]:
    rows = []
    for i, stream in enumerate(("r0", "r1")):  # two renderer actors' streams side by side
        w = ShardWriter(out / DATA_DIR, stream=f"{STREAM}-{stream}", fmt=fmt, rows_per_file=3)
        for g in range(i, GROUPS, 2):
            group = [dict(synthetic_row(g * G + k), group_id=f"t{g}", task_id=f"t{g}", rollout_id=f"t{g}#{k}",
                          temperature=0.8, top_p=0.95, top_k=0, seed=None) for k in range(G)]
            w.add(group)
            rows += group
        w.close()
    (out / BREAKS).write_text(json.dumps({"rollout_id": "t0#1", "turn": 1, "reason": "x"}) + "\n")
    cfg = RunConfig(group_size=G, output={"dir": str(out), "format": fmt})
    write_outputs(out, cfg.model_dump(mode="json"), {"renderer": "r", "template_sha256": "0", "rollouts": len(rows)})
    return rows


@pytest.fixture(params=["arrow", "parquet"])
def output(tmp_path, request):
    out = tmp_path / "demo"
    rows = make_output(out, request.param)
    # a shard still being written: ShardWriter's hidden temporary, not yet a complete file
    (out / DATA_DIR / f".{STREAM}-r0-00009.{request.param}.tmp").write_bytes(b"partial")
    return out, request.param, rows


def test_pyarrow_dataset_on_the_directory(output):
    out, fmt, rows = output
    table = ds.dataset(out, format="ipc" if fmt == "arrow" else "parquet").to_table()
    assert sorted(table["rollout_id"].to_pylist()) == sorted(r["rollout_id"] for r in rows)
    assert table.schema.field("token_ids").type == pa.list_(pa.int32())


def test_polars_on_the_directory(output):
    """polars reads every non-empty file under a directory it is given, hidden ones too, and refuses mixed
    extensions; the documented calls name the shards under the directory: a glob, hidden_file_prefix
    (scan_parquet only), tito's list of shard files, or pyarrow's dataset of the directory."""
    import polars as pl

    out, fmt, rows = output
    if fmt == "arrow":
        scans = [pl.scan_ipc(f"{out}/**/*.arrow"), pl.scan_ipc(shard_files(out)),
                 pl.scan_pyarrow_dataset(ds.dataset(out, format="ipc"))]
    else:
        scans = [pl.scan_parquet(f"{out}/**/*.parquet"), pl.scan_parquet(out, hidden_file_prefix=["_", "."]),
                 pl.scan_parquet(shard_files(out))]
    for scan in scans:
        df = scan.select("rollout_id", "temperature").collect()
        assert sorted(df["rollout_id"].to_list()) == sorted(r["rollout_id"] for r in rows)
        assert set(df["temperature"].to_list()) == {0.8}


def test_hf_load_dataset_on_the_directory(output, tmp_path):
    datasets = pytest.importorskip("datasets")
    out, fmt, rows = output
    d = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "cache"))
    assert sorted(d["rollout_id"]) == sorted(r["rollout_id"] for r in rows)
    assert d.features["loss_mask"].feature.dtype == "bool"


def test_duckdb_sql_on_the_directory(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    out = tmp_path / "demo"
    rows = make_output(out, "parquet")
    (out / DATA_DIR / f".{STREAM}-r0-00009.parquet.tmp").write_bytes(b"partial")
    want = {}
    for r in rows:
        n, c = want.get(r["task_id"], (0, 0))
        want[r["task_id"]] = (n + 1, c + r["completion_tokens"])
    for source in (f"read_parquet('{out}')", f"'{out}/**/*.parquet'"):
        got = duckdb.sql(f"SELECT task_id, count(*) AS n, sum(completion_tokens) AS c FROM {source} "
                         "GROUP BY task_id ORDER BY task_id").fetchall()
        assert got == [(t, *want[t]) for t in sorted(want)], source


def test_pandas_on_the_directory(output):
    import pandas as pd

    out, fmt, rows = output
    if fmt == "parquet":
        df = pd.read_parquet(out)
    else:  # pandas has no directory reader for Arrow IPC files: through pyarrow, as documented
        df = ds.dataset(out, format="ipc").to_table().to_pandas()
    assert sorted(df["rollout_id"]) == sorted(r["rollout_id"] for r in rows)
    assert list(df["token_ids"].iloc[0]) == next(r["token_ids"] for r in rows if r["rollout_id"] == df["rollout_id"].iloc[0])


def test_ray_data_on_the_directory(tmp_path):
    """Ray Data's read_parquet takes the directory (it keeps *.parquet files only). Ray has no Arrow IPC file
    reader: docs/shards.md sends IPC shards through pyarrow (``ray.data.from_arrow``)."""
    ray_data = pytest.importorskip("ray.data")
    import ray

    out = tmp_path / "demo"
    rows = make_output(out, "parquet")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=100 * 2**20,
                 log_to_driver=False)
    try:
        got = ray_data.read_parquet(str(out)).select_columns(["rollout_id"]).take_all()
        assert sorted(r["rollout_id"] for r in got) == sorted(r["rollout_id"] for r in rows)
    finally:
        if started:
            ray.shutdown()


def test_tito_readers_and_manifest_match_the_files(output):
    out, _, rows = output
    assert open_shards(out).count_rows() == len(rows)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["rows"] == len(rows) and all((out / f["file"]).exists() for f in manifest["files"])
    assert {f["file"].split("/")[0] for f in manifest["files"]} == {DATA_DIR}
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["rollouts"] == len(rows) and summary["tasks"] == GROUPS
    assert summarize(out)["rollouts"] == len(rows)


def test_old_flat_layout_still_opens(tmp_path):
    """Schema 1 wrote shard-*.arrow and manifest.json at the top of the output directory."""
    out = tmp_path / "old"
    rows = make_output(out, "arrow")
    for f in (out / DATA_DIR).iterdir():
        shutil.move(f, out / f.name.replace(STREAM, "shard"))
    (out / DATA_DIR).rmdir()
    (out / MANIFEST).rename(out / "manifest.json")
    assert open_shards(out).count_rows() == len(rows)
    assert summarize(out)["rollouts"] == len(rows)
