"""``tito run`` as a real subprocess on a real full disk (a 40 KB tmpfs): the first failed write stops
the run with one line naming the file and the cause (no Ray traceback) and a nonzero exit, nothing
half-written is left, the manifest lists exactly the files on disk with their sha256, and the progress
counts what was written; after space is freed, ``--resume`` runs exactly the rollouts not on disk.
And a shard changed or truncated after the run: ``--resume`` and ``tito inspect`` stop with one line
naming the file, and change nothing."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from rollout.data.shards import MANIFEST, SUMMARY, output_shards, read_table

from ._support import REPO, tiny_tmpfs, tokenizer_dir

TASKS, G = 20, 2
ENV = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled", NO_COLOR="1")


def _config(tmp_path, out) -> str:
    cfg = {
        "model": str(tokenizer_dir("qwen2.5-7b-instruct")),
        "engine": {"backend": "replay", "count": 1,
                   "options": {"synthetic": True, "vocab_size": 151665, "max_model_len": 4096, "token_delay_s": 0.01}},
        "env": {"name": "try_again"}, "tasks": {"count": TASKS}, "group_size": G, "max_turns": 2,
        "max_tokens_per_turn": 16, "max_tokens_per_rollout": 32, "max_concurrent_rollouts": 4,
        "sampling": {"seed": 3},
        # a file per group, written as the group finishes: the failed write is the group's own
        "output": {"dir": str(out), "flush_interval_s": 0}, "ray": {"num_cpus": 2},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _tito(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actors.cli", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=300)


def _rollouts_on_disk(out) -> Counter:
    ids: Counter[str] = Counter()
    for p in output_shards(out):
        t = read_table(p, columns=["rollout_id", "segment_index"])
        ids.update(r for r, s in zip(t["rollout_id"].to_pylist(), t["segment_index"].to_pylist()) if s == 0)
    return ids


def _assert_manifest_matches_disk(out) -> None:
    manifest = json.loads((out / MANIFEST).read_text())
    on_disk = {p.relative_to(out).as_posix(): p for p in output_shards(out)}
    assert {f["file"] for f in manifest["files"]} == set(on_disk)
    for f in manifest["files"]:
        assert f["sha256"] == hashlib.sha256(on_disk[f["file"]].read_bytes()).hexdigest(), f["file"]
        assert f["rows"] == read_table(on_disk[f["file"]], columns=["rollout_id"]).num_rows


def _no_temporaries(out) -> list:
    return [p for p in out.rglob(".*") if p.name.endswith(".tmp")]


@pytest.fixture
def tiny_disk(tmp_path):
    with tiny_tmpfs(tmp_path / "tiny") as mnt:
        yield mnt


def test_full_disk_stops_with_one_line_and_resume_reruns_the_rest(tmp_path, tiny_disk):
    out = tiny_disk / "out"
    config = _config(tmp_path, out)
    first = _tito("run", config)
    assert first.returncode == 2, first.stderr
    assert "Traceback" not in first.stderr and "RayTaskError" not in first.stderr, first.stderr
    errors = [ln for ln in first.stderr.splitlines() if "error" in ln.lower() and not ln.startswith("tito run: rollouts")]
    assert len(errors) == 1 and errors[0] == first.stderr.splitlines()[-1], first.stderr
    line = errors[0]
    m = re.match(r"tito run: error: cannot write (\S+): No space left on device\. The run stopped: (.*)", line)
    assert m and m.group(1).startswith(str(out / "data" / "train-r0-")) and "--resume" in line, line
    assert not _no_temporaries(out)
    before = _rollouts_on_disk(out)
    assert before and max(before.values()) == 1 and sum(before.values()) < TASKS * G
    if "manifest updated" in line:  # the manifest fits once the failed temporary is gone
        _assert_manifest_matches_disk(out)
        assert f"{sum(before.values())} rollouts are on disk" in line
    # the progress counts rollouts written to disk, beside those finished
    progress = [ln for ln in first.stderr.splitlines() if ln.startswith("tito run: rollouts")]
    assert re.search(r"written (\d+) ", progress[-1]).group(1) == str(sum(before.values())), progress[-1]

    subprocess.run(["mount", "-o", "remount,size=8m", str(tiny_disk)], check=True)  # space freed
    (out / "data" / ".train-r0-00099.arrow.tmp").write_bytes(b"")  # as a killed run would leave it
    second = _tito("run", config, "--resume", "--quiet")
    assert second.returncode == 0, second.stderr
    after = _rollouts_on_disk(out)
    assert len(after) == TASKS * G and max(after.values()) == 1, "a rollout missing, or on disk twice"
    assert all(after[r] == 1 for r in before)  # what was written stayed
    summary = json.loads((out / SUMMARY).read_text())
    assert summary["rollouts"] == TASKS * G and summary["this_run"]["rollouts"] == TASKS * G - len(before)
    _assert_manifest_matches_disk(out)
    assert not _no_temporaries(out)


def test_changed_or_truncated_shard_is_named_by_resume_and_inspect(tmp_path):
    out = tmp_path / "out"
    config = _config(tmp_path, out)
    done = _tito("run", config, "--quiet", "--set", "tasks.count=4")
    assert done.returncode == 0, done.stderr
    files = output_shards(out)
    assert len(files) == 4
    before = {p: p.read_bytes() for p in files}
    inspect = _tito("inspect", str(out), "--no-sample")
    assert inspect.returncode == 0 and "sha256 ok (4 files)" in inspect.stdout, inspect.stderr

    # 4 bytes overwritten mid-shard (the issue: --resume then ran with rc 0 and a changed logprobs column)
    bad = files[1]
    raw = bytearray(before[bad])
    raw[len(raw) // 2: len(raw) // 2 + 4] = b"\xde\xad\xbe\xef"
    bad.write_bytes(bytes(raw))
    resumed = _tito("run", config, "--resume", "--quiet", "--set", "tasks.count=4")
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, resumed.stderr
    assert str(bad) in resumed.stderr and "sha256" in resumed.stderr and "move" in resumed.stderr, resumed.stderr
    assert {p: p.read_bytes() for p in output_shards(out) if p != bad} == {p: b for p, b in before.items() if p != bad}
    inspect = _tito("inspect", str(out), "--no-sample")
    assert inspect.returncode == 2 and str(bad) in inspect.stderr and "Traceback" not in inspect.stderr, inspect.stderr

    # truncated (the issue: "Not an Arrow file" without its name)
    bad.write_bytes(before[bad][:200])
    for args in (("run", config, "--resume", "--quiet", "--set", "tasks.count=4"), ("inspect", str(out), "--no-sample")):
        result = _tito(*args)
        assert result.returncode == 2 and str(bad) in result.stderr and "Traceback" not in result.stderr, result.stderr

    # moved aside, as the message says: --resume runs that file's groups again
    bad.rename(tmp_path / bad.name)
    fixed = _tito("run", config, "--resume", "--quiet", "--set", "tasks.count=4")
    assert fixed.returncode == 0, fixed.stderr
    after = _rollouts_on_disk(out)
    assert len(after) == 4 * G and max(after.values()) == 1
    _assert_manifest_matches_disk(out)
