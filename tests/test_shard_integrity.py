"""Shard integrity on real files: each file's sha256 in the manifest, checked by --resume and
``tito inspect`` (a changed or truncated file is named, with what to do); a write that fails on a real
full disk (a 40 KB tmpfs) names the file, leaves no temporary and stops the writer; stale temporaries
are removed; the progress counts the rollouts written to disk."""

from __future__ import annotations

import hashlib
import io
import json
import time

import pytest

from rollout.cli.progress import Progress
from rollout.data.inspect_shards import summarize
from rollout.data.outputs import check_resume, complete_groups, drop_groups, remove_temporaries, write_outputs
from rollout.data.shards import (
    DATA_DIR,
    MANIFEST,
    ShardCorrupt,
    ShardWriteError,
    ShardWriter,
    output_shards,
    read_manifest,
    read_table,
)
from rollout.renderer_service import RendererService

from ._support import tiny_tmpfs, tokenizer_dir
from .test_data import synthetic_row


def _group(g: int, size: int = 2, n: int = 12) -> list[dict]:
    return [dict(synthetic_row(g * 10 + k, n), task_id=f"t{g}", group_id=f"t{g}", rollout_id=f"t{g}#{k}", segment_count=1)
            for k in range(size)]


def _output_dir(tmp_path, groups: int = 4, config: dict | None = None):
    """An output directory as ``tito run`` leaves it: one group a file in data/, manifest, summary."""
    out = tmp_path / "out"
    w = ShardWriter(out / DATA_DIR, flush_interval_s=0)
    for g in range(groups):
        w.add(_group(g))
    written = w.close()
    write_outputs(out, config or {"group_size": 2}, {"renderer": "r", "template_sha256": None}, written)
    return out, written


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _overwrite_middle(path, data: bytes = b"\xde\xad\xbe\xef") -> None:
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + len(data)] = data
    path.write_bytes(bytes(raw))


# ---- checksums -----------------------------------------------------------------------------------


def test_manifest_records_the_sha256_of_each_file(tmp_path):
    out, written = _output_dir(tmp_path)
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["files"]) == 4
    for entry in manifest["files"]:
        assert entry["sha256"] == _sha(out / entry["file"])
    # the writer's own entries carry the checksum of the bytes it wrote
    assert {f"{DATA_DIR}/{w['file']}": w["sha256"] for w in written} == {f["file"]: f["sha256"] for f in manifest["files"]}


def test_resume_stops_on_a_changed_file_naming_it(tmp_path):
    out, _ = _output_dir(tmp_path)
    bad = output_shards(out)[1]
    _overwrite_middle(bad)  # 4 bytes, mid-file: the file still reads (the run went on with rc 0)
    with pytest.raises(ShardCorrupt) as err:
        check_resume(out, {"group_size": 2}, "")
    text = str(err.value)
    assert str(bad) in text and "sha256" in text and "move" in text and "--resume" in text
    assert str(output_shards(out)[0]) not in text  # only the bad file is named


def test_truncated_file_is_named(tmp_path):
    out, _ = _output_dir(tmp_path)
    bad = output_shards(out)[0]
    bad.write_bytes(bad.read_bytes()[:100])
    # listed in the manifest: the checksum names it
    with pytest.raises(ShardCorrupt, match=str(bad)):
        check_resume(out, {"group_size": 2}, "")
    # not listed (a run killed before its manifest): reading it names it ("Not an Arrow file" did not)
    (out / MANIFEST).unlink()
    with pytest.raises(ShardCorrupt, match=f"{bad}: not a readable shard file"):
        complete_groups(out, 2)


def test_unreadable_manifest_is_named(tmp_path):
    out, _ = _output_dir(tmp_path)
    (out / MANIFEST).write_bytes(b'{"files": [')  # cut short
    with pytest.raises(ShardCorrupt, match=f"{out / MANIFEST}: not a readable manifest"):
        check_resume(out, {"group_size": 2}, "")


def test_inspect_verifies_and_names_a_bad_file(tmp_path):
    out, _ = _output_dir(tmp_path)
    assert summarize(out)["checksums"] == "sha256 ok (4 files)"
    bad = output_shards(out)[3]
    _overwrite_middle(bad)
    with pytest.raises(ShardCorrupt, match=str(bad)):
        summarize(out)


def test_old_manifest_without_checksums_still_loads(tmp_path):
    out, _ = _output_dir(tmp_path)
    manifest = json.loads((out / MANIFEST).read_text())
    for f in manifest["files"]:
        del f["sha256"]
    (out / MANIFEST).write_text(json.dumps(manifest))
    check_resume(out, {"group_size": 2}, "")  # nothing to check against: no error
    assert summarize(out)["checksums"].startswith("none recorded")
    # the next rebuild (the end of a resumed run) records them
    write_outputs(out, {"group_size": 2}, {"renderer": "r", "template_sha256": None})
    assert all(f["sha256"] == _sha(out / f["file"]) for f in read_manifest(out)["files"])


def test_repair_rewrite_keeps_the_manifest_checksums_true(tmp_path):
    out, _ = _output_dir(tmp_path)
    w = ShardWriter(out / DATA_DIR, flush_interval_s=0)
    w.add(_group(0, size=1) + _group(9))  # a partial group t0 beside a whole one: t0 gets repaired
    w.close()
    write_outputs(out, {"group_size": 2}, {"renderer": "r", "template_sha256": None})
    done, broken = complete_groups(out, 2)
    assert broken == {"t0"}
    drop_groups(out, broken)
    # the manifest was updated with the rewrite at once: a resume killed now must not see a mismatch
    check_resume(out, {"group_size": 2}, "")
    assert {f["file"] for f in read_manifest(out)["files"]} == {p.relative_to(out).as_posix() for p in output_shards(out)}


def test_stale_temporaries_are_removed(tmp_path):
    out, _ = _output_dir(tmp_path)
    stale = [out / DATA_DIR / ".train-r0-00009.arrow.tmp", out / "._manifest.json.tmp"]
    for p in stale:
        p.write_bytes(b"")
    assert sorted(remove_temporaries(out)) == sorted(stale)
    assert not any(p.exists() for p in stale) and len(output_shards(out)) == 4


# ---- a real full disk ----------------------------------------------------------------------------


@pytest.fixture
def full_disk(tmp_path):
    """A 40 KB tmpfs: writes fail with ENOSPC once it is full."""
    with tiny_tmpfs(tmp_path / "tiny") as mnt:
        yield mnt


def _fill(writer: ShardWriter) -> ShardWriteError:
    for g in range(200):
        try:
            writer.add(_group(g, n=400))  # ~6 KB a file
        except ShardWriteError as exc:
            return exc
    raise AssertionError("the 40 KB disk never filled")


def test_full_disk_names_the_file_and_leaves_no_temporary(full_disk):
    w = ShardWriter(full_disk / DATA_DIR, flush_interval_s=0)
    exc = _fill(w)
    failed = full_disk / DATA_DIR / f"train-{w._seq - 1:05d}.arrow"
    assert str(exc) == f"cannot write {failed}: No space left on device"
    assert isinstance(exc, ValueError) and isinstance(exc, OSError)  # the CLI prints a ValueError as one line
    assert not list((full_disk / DATA_DIR).glob(".*")), "a half-written temporary was left"
    # every file the writer reports is complete and readable; nothing more is written after a failure
    assert [p.name for p in output_shards(full_disk)] == [f["file"] for f in w.files]
    assert all(read_table(full_disk / DATA_DIR / f["file"]).num_rows == 2 for f in w.files)
    with pytest.raises(ShardWriteError, match="No space left"):
        w.add(_group(999))
    with pytest.raises(ShardWriteError, match="No space left"):
        w.close()


def test_timed_flush_failure_stops_the_next_add(full_disk):
    w = ShardWriter(full_disk / DATA_DIR, flush_interval_s=0.05)
    w.add([row for g in range(8) for row in _group(g, n=400)])  # one ~48 KB file: never fits
    deadline = time.monotonic() + 10
    while w.error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert w.error is not None, "the timed flush did not run"
    assert not list((full_disk / DATA_DIR).glob(".*"))
    with pytest.raises(ShardWriteError, match="No space left on device"):
        w.add(_group(50))


def test_renderer_service_reports_the_write_error_on_close(full_disk):
    svc = RendererService(str(tokenizer_dir("qwen2.5-7b-instruct")), out_dir=str(full_disk), flush_interval_s=None)
    svc.writer.add([row for g in range(8) for row in _group(g, n=400)])
    closed = svc.close()  # the final flush fails: reported, not raised (the driver still rebuilds the manifest)
    assert closed["files"] == [] and "No space left on device" in closed["write_error"]
    assert str(full_disk / DATA_DIR / "train-00000.arrow") in closed["write_error"]


# ---- progress ------------------------------------------------------------------------------------


def test_progress_counts_rollouts_written(tmp_path):
    data = tmp_path / DATA_DIR
    old = ShardWriter(data, stream="train-r0", flush_interval_s=0)
    old.add(_group(0))  # a previous run's file (a resume): not this run's
    stream = io.StringIO()
    bar = Progress(6, stream=stream, interval_s=3600)
    bar.watch(data)
    w = ShardWriter(data, stream="train-r0", flush_interval_s=0)
    for g in (1, 2):
        w.add(_group(g))
    for _ in range(6):  # six rollouts finished; the third group's two are not on disk
        bar.done += 1
    bar.finish()
    last = stream.getvalue().splitlines()[-1]
    assert "rollouts 6/6" in last and "written 4 " in last
