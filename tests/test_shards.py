"""Shards: atomic files, manifest, schema in the metadata, readable by pyarrow and polars, and rows
that round-trip to the engine's completions."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

import tito_renderers as renderers
from rollout.data.samples import SampleBuilder
from rollout.data.shards import MANIFEST, SCHEMA, SCHEMA_VERSION, ShardWriter, read_table, write_manifest

from ._support import ours


def _row(seg, i: int) -> dict:
    return {
        "token_ids": seg.token_ids, "loss_mask": seg.loss_mask, "logprobs": seg.logprobs,
        "message_index": seg.message_index, "turn_index": seg.turn_index, "messages": "[]",
        "reward": 1.0, "reward_components": "{}", "advantage": 0.5, "task_id": f"t{i}", "group_id": "g",
        "rollout_id": f"r{i}", "segment_index": 0, "segment_count": 1, "finish_reason": "no_tool_call",
        "breaks": "[]", "weight_version": 0, "model": "m", "renderer": "qwen2.5", "template_sha256": "x",
        "prompt_tokens": seg.prompt_tokens, "completion_tokens": seg.completion_tokens, "error": None,
    }


def built_rollout():
    """A two-turn rollout built the way the loop builds it: render, completion, bridge, completion."""
    tok = ours("qwen2.5-7b-instruct")
    r = renderers.create_renderer(tok)
    msgs = [{"role": "user", "content": "2+2?"}]
    b = SampleBuilder()
    b.start_segment(r.render(msgs, add_generation_prompt=True), turn=0)
    first = tok.encode("4<|im_end|>")
    b.add_completion(first, [-0.5] * len(first), message_index=1, turn=0)
    bridged = r.bridge(b.prompt_ids()[: -len(first)], first, [{"role": "user", "content": "and 3+3?"}])
    b.add_bridge(bridged, message_offset=2, turn=1)
    second = tok.encode("6<|im_end|>")
    b.add_completion(second, [-0.25] * len(second), message_index=3, turn=1)
    return tok, b, first, second


def test_rows_round_trip_to_the_completions(tmp_path):
    tok, b, first, second = built_rollout()
    seg = b.segments[0]
    w = ShardWriter(tmp_path, fmt="arrow", rows_per_file=2)
    for i in range(3):
        w.add([_row(seg, i)])
    files = w.close()
    assert [f["rows"] for f in files] == [2, 1]
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file is left behind"
    table = read_table(tmp_path / files[0]["file"])
    assert table.schema.metadata[b"tito.schema_version"] == SCHEMA_VERSION.encode()
    assert table.schema.field("loss_mask").metadata[b"description"]
    row = table.slice(0, 1).to_pylist()[0]
    trained = [t for t, m in zip(row["token_ids"], row["loss_mask"]) if m]
    assert trained == first + second  # exactly the engine's completions, nothing else
    assert [lp for lp, m in zip(row["logprobs"], row["loss_mask"]) if m] == [-0.5] * len(first) + [-0.25] * len(second)
    assert tok.decode(row["token_ids"]).endswith("and 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>")
    assert set(row["turn_index"]) == {0, 1}


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_readable_by_polars(tmp_path, fmt):
    import polars as pl

    _, b, _, _ = built_rollout()
    w = ShardWriter(tmp_path, fmt=fmt)
    w.add([_row(b.segments[0], 0)])
    files = w.close()
    write_manifest(tmp_path, files)
    path = tmp_path / files[0]["file"]
    df = pl.read_ipc(path) if fmt == "arrow" else pl.read_parquet(path)
    assert df.height == 1 and df["loss_mask"].list.sum()[0] == b.segments[0].completion_tokens
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["rows"] == 1 and manifest["files"][0]["file"] == files[0]["file"]


def test_bad_rows_fail_before_any_file_is_written(tmp_path):
    w = ShardWriter(tmp_path, rows_per_file=1)
    with pytest.raises((ValueError, pa.ArrowInvalid, pa.ArrowTypeError)):
        w.add([{"token_ids": "not a list"}])
    assert not list(tmp_path.iterdir())
    assert len(SCHEMA) == 31


def test_every_column_is_documented():
    from ._support import REPO

    doc = (REPO / "docs" / "shards.md").read_text()
    for field in SCHEMA:
        assert f"| `{field.name}` |" in doc, f"docs/shards.md does not document {field.name}"
