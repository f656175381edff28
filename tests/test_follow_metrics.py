"""rollout.follow.metrics: metrics.jsonl always, Weights & Biases (offline mode here) when configured.

Two real wandb runs in all (offline, both in test_offline_run_resumes_on_restart); the failure paths use a
patched ``wandb.init``. Every W&B directory points into tmp_path: nothing is written to $HOME.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout.data import layout
from rollout.follow.metrics import (
    RUN_ID_FILE,
    MetricsSink,
    flatten,
    read_metrics,
    wandb_configured,
    wandb_disabled,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"model": "smollm2-135m", "group_size": 4, "follow": {"max_off_policy_steps": 1}}


def line(k: int, reward: float = 0.5) -> dict[str, Any]:
    """A metrics line shaped like rollout.follow.service.seal_batch's."""
    return {"step": k, "rollouts": 8, "written": 7, "withheld": 1, "samples": 7,
            "reward": {"min": 0.0, "mean": reward, "max": 1.0}, "completion_tokens": 900,
            "staleness": {"0": 5, "1": 2}, "token_staleness_mean": 0.25,
            "tokens_per_version": {str(k - 2): 100, str(k - 1): 800}, "spanning_versions": 1, "errors": 0,
            "admitted_at_version": k - 1, "version_at_seal": k - 1, "admission_wait_s": 0.2, "sampling_s": 1.2,
            "batch_s": 1.5, "resumed_turns": 0,
            "weight_updates": [{"version": k - 1, "load_s": 0.4, "aborted_requests": 3, "during": "admission"}],
            "total_elapsed_s": 3.0 * k, "total_resumed_turns": 2, "total_weight_updates": k - 1}


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No W&B configuration from the caller's environment; wandb's own directories under tmp_path."""
    for key in list(os.environ):
        if key.startswith("WANDB_"):
            monkeypatch.delenv(key)
    home = tmp_path / "wandb-home"
    monkeypatch.setenv("NETRC", str(home / "netrc"))  # absent: not logged in
    for key, sub in (("WANDB_DIR", "dir"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_DATA_DIR", "data")):
        (home / sub).mkdir(parents=True)
        monkeypatch.setenv(key, str(home / sub))
    run_dir = tmp_path / "run-7"
    run_dir.mkdir()
    return run_dir


def wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file: a LevelDB-style log (``:W&B`` header, 32 KiB blocks, 7-byte record
    headers: crc32, length, type FULL/FIRST/MIDDLE/LAST) of ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path}: not a W&B transaction log"
    block, pos, part, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # a block's zero-filled tail
            pos += left
            continue
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def history(records: list[Any]) -> dict[int, dict[str, Any]]:
    """step -> {key: value} from a run's history records."""
    out = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            out[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return out


def test_flatten_numeric_leaves() -> None:
    flat = flatten(line(3))
    assert flat["reward/mean"] == 0.5
    assert flat["staleness/0"] == 5 and flat["staleness/1"] == 2
    assert flat["tokens_per_version/1"] == 100 and flat["tokens_per_version/2"] == 800
    assert flat["weight_updates/0/load_s"] == 0.4 and flat["step"] == 3
    assert flatten({"step": 1, "ok": True, "name": "x", "none": None, "empty": {}}) == {"step": 1}


def test_jsonl_only_when_wandb_not_configured(wandb_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = wandb_env
    with MetricsSink(run_dir, CONFIG) as sink:
        assert sink.wandb_run is None
        sink.log(line(1))
        sink.log(line(2, reward=0.75))
    sink = MetricsSink(run_dir, CONFIG)  # a restart appends
    sink.log(line(3))
    sink.close()
    raw = (run_dir / layout.METRICS).read_text().splitlines()
    assert len(raw) == 3 and json.loads(raw[1]) == line(2, reward=0.75)
    assert read_metrics(run_dir) == [line(1), line(2, reward=0.75), line(3)]
    assert capsys.readouterr().err == ""
    assert not (run_dir / "wandb").exists() and not (run_dir / RUN_ID_FILE).exists()


def test_importing_and_using_the_sink_unconfigured_never_imports_wandb(wandb_env: Path) -> None:
    code = ("import sys; from rollout.follow.metrics import MetricsSink; "
            f"s = MetricsSink({str(wandb_env)!r}, {{}}); s.log({{'step': 1}}); s.close(); "
            "assert 'wandb' not in sys.modules, 'wandb imported'")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=60)
    assert read_metrics(wandb_env) == [{"step": 1}]


def test_the_configured_rule(tmp_path: Path) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    absent = str(tmp_path / "absent")
    assert wandb_configured({"NETRC": absent}) is None
    assert wandb_configured({"NETRC": absent, "WANDB_MODE": "offline"}) == "WANDB_MODE=offline"
    assert wandb_configured({"NETRC": absent, "WANDB_API_KEY": "x" * 40}) == "WANDB_API_KEY"
    assert wandb_configured({"NETRC": str(netrc)}) == str(netrc)
    # a key for another host is not a login to this one
    assert wandb_configured({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"}) is None
    for off in ({"WANDB_MODE": "disabled"}, {"WANDB_DISABLED": "true"}, {"WANDB_DISABLED": "1"}):
        env = {"NETRC": str(netrc), "WANDB_API_KEY": "x" * 40, "WANDB_MODE": "offline", **off}
        assert wandb_disabled(env) and wandb_configured(env) is None
    assert not wandb_disabled({"WANDB_DISABLED": "false"})


def test_disabled_logs_nothing_to_wandb(wandb_env: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import of wandb would fail: none happens
    sink = MetricsSink(wandb_env, CONFIG)
    sink.log(line(1))
    sink.close()
    assert sink.wandb_run is None and read_metrics(wandb_env) == [line(1)]
    assert capsys.readouterr().err == ""
    assert not (wandb_env / "wandb").exists() and not (wandb_env / RUN_ID_FILE).exists()


def test_configured_but_not_installed_is_one_line(wandb_env: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setitem(sys.modules, "wandb", None)
    sink = MetricsSink(wandb_env, CONFIG)
    sink.log(line(1))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "WANDB_MODE=offline" in err[0] and "not installed" in err[0], err
    assert read_metrics(wandb_env) == [line(1)]


@pytest.mark.slow  # two wandb inits: a few seconds
def test_offline_run_resumes_on_restart(wandb_env: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("wandb")
    # An LLM client in the process makes wandb.init suggest Weave on stderr even when silent (the
    # CI run where another test had imported openai): the sink's one line must stay the only one.
    pytest.importorskip("openai")
    monkeypatch.delenv("WANDB_DISABLE_WEAVE", raising=False)
    run_dir = wandb_env
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "tito-test")

    async def first() -> str:  # the service makes its sink on a running event loop
        sink = MetricsSink(run_dir, CONFIG)
        assert sink.wandb_run is not None
        sink.log(line(1, reward=0.25))
        sink.log(line(2, reward=0.5))
        sink.close()
        return sink_id(run_dir)

    def sink_id(d: Path) -> str:
        return (d / RUN_ID_FILE).read_text().strip()

    run_id = asyncio.run(first())
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"tito-test/{run_id}" in err[0] and "WANDB_MODE=offline" in err[0], err
    assert "WANDB_DISABLE_WEAVE" not in os.environ  # the user's environment is left as found

    with MetricsSink(run_dir, CONFIG) as sink:  # the restarted service: same id, later steps
        assert sink.wandb_run.id == run_id
        sink.log(line(3, reward=0.75))
    assert sink_id(run_dir) == run_id
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]

    # (two inits in the same second: the second directory gets a "-1" suffix)
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2, sorted(p.name for p in (run_dir / "wandb").iterdir())
    logged: dict[int, dict[str, Any]] = {}
    for run in runs:
        records = wandb_records(run / f"run-{run_id}.wandb")
        (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (meta.run_id, meta.project, meta.display_name) == (run_id, "tito-test", run_dir.name)
        config = {i.key: json.loads(i.value_json) for i in meta.config.update}
        assert {k: config[k] for k in CONFIG} == CONFIG
        assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished
        logged.update(history(records))
    assert sorted(logged) == [1, 2, 3]
    assert [logged[k]["reward/mean"] for k in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert logged[3]["staleness/1"] == 2 and logged[3]["tokens_per_version/2"] == 800
    assert logged[3]["weight_updates/0/load_s"] == 0.4 and "step" not in logged[3]
    assert capsys.readouterr().err.count("\n") == 1  # the second run's one line


def test_init_failure_leaves_jsonl_working(wandb_env: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")

    def refuse(**kwargs: Any) -> Any:
        raise RuntimeError("no route to the W&B server")

    monkeypatch.setattr(wandb, "init", refuse)
    sink = MetricsSink(wandb_env, CONFIG)
    assert sink.wandb_run is None
    sink.log(line(1))
    sink.log(line(2))
    sink.close()
    assert read_metrics(wandb_env) == [line(1), line(2)]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no route to the W&B server" in err[0] and "metrics.jsonl only" in err[0], err


def test_log_failure_stops_wandb_not_the_jsonl(wandb_env: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    calls: list[str] = []

    class BrokenRun:
        project, id, url, dir = "tito", "abc", None, str(wandb_env)

        def log(self, data: dict, step: int) -> None:
            calls.append(f"log {step}")
            raise OSError("wandb-core went away")

        def finish(self, exit_code: int | None = None) -> None:
            calls.append("finish")

    inits: list[dict[str, Any]] = []
    monkeypatch.setattr(wandb, "init", lambda **kw: inits.append(kw) or BrokenRun())
    sink = MetricsSink(wandb_env, CONFIG)
    capsys.readouterr()
    for k in (1, 2, 3):
        sink.log(line(k))
    sink.close()
    assert calls == ["log 1"]  # stopped after the failure, and not finished
    assert read_metrics(wandb_env) == [line(1), line(2), line(3)]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "step 1" in err[0] and "wandb-core went away" in err[0], err
    (kw,) = inits
    assert kw["resume"] == "allow" and kw["id"] == (wandb_env / RUN_ID_FILE).read_text().strip()
    assert kw["name"] == wandb_env.name and kw["config"] == CONFIG and kw["dir"] == str(wandb_env)
