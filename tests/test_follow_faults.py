"""Broadcast faults in follow mode (issue 40 item 5): the engines stay on verified weights, and each fault is one
line naming it, once. The follower runs on a real driver over a replay engine in this process (the loading and
validation paths are the service's own; replay validates real safetensors headers and values); the checkpoints
are real safetensors written by ``publish_weights``. What the embedded engine loads is tested in test_follow.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import torch

from rollout.config import RunConfig
from rollout.data import layout
from rollout.engines.replay import ReplayEngine
from rollout.envs.registry import make_env
from rollout.follow.publish import publish_weights
from rollout.follow.service import WeightFollower
from rollout.handles import LocalEngine
from rollout.loop import RolloutDriver
from rollout.startup import create_parser

from ._support import tokenizer_dir

VOCAB = 151665


class DeletedWhileValidated(ReplayEngine):
    """The trainer removes the step while the engine validates it (prime-rl deletes step_{N-2}): the step is gone
    by the time the engine reads it."""

    async def validate_weights(self, path: str) -> dict:
        shutil.rmtree(path)
        return await super().validate_weights(path)


class Hangs(ReplayEngine):
    """An engine whose validate or load of a checkpoint never returns (a stalled file system, a wedged loader)."""

    def __init__(self, call: str) -> None:
        super().__init__(synthetic=True, vocab_size=VOCAB)
        self.call = call

    async def validate_weights(self, path: str) -> dict:
        if self.call == "validate":
            await asyncio.Event().wait()
        return await super().validate_weights(path)

    async def update_weights(self, path: str, version: int | None = None, **kw) -> dict:
        if self.call == "load":
            await asyncio.Event().wait()
        return await super().update_weights(path, version, **kw)


def _follower(run_dir: Path, backend: ReplayEngine | None = None, keep_broadcasts: int | None = None,
              *more: ReplayEngine, **options) -> tuple[WeightFollower, ReplayEngine, list[str]]:
    cfg = RunConfig(model=str(tokenizer_dir("qwen2.5-7b-instruct")), env={"name": "arithmetic"}, group_size=1)
    if backend is None:  # (not ``or``: an engine without records has len 0)
        backend = ReplayEngine(synthetic=True, vocab_size=VOCAB)
    engines = [LocalEngine(b) for b in (backend, *more)]
    driver = RolloutDriver(cfg, make_env("arithmetic"), engines, [], backend.info(),
                           create_parser(cfg.renderer, cfg.model))
    lines: list[str] = []
    driver.log = lines.append  # the healer's lines too
    follower = WeightFollower(run_dir, engines, driver, inflight="drain", poll_interval_s=0.01, log=lines.append,
                              keep_broadcasts=keep_broadcasts, **options)
    return follower, backend, lines


def _publish(run_dir: Path, n: int) -> Path:
    return publish_weights(run_dir, n, {"w": torch.full((4,), float(n))}, config={"model_type": "none"})


def _poll(follower: WeightFollower) -> bool:
    return asyncio.run(follower.poll_once())


def test_each_broadcast_fault_is_one_line_and_the_engines_stay_on_verified_weights(tmp_path):
    run = tmp_path / "run"
    _publish(run, 1)
    follower, engine, lines = _follower(run)
    assert _poll(follower) and engine.info().weight_version == 1 and lines[-1].startswith("weights v1 loaded")

    # a step that skips ahead: loaded (it is the newest stable one), the gap named
    _publish(run, 3)
    assert _poll(follower) and engine.info().weight_version == 3
    assert lines[-1].endswith("; skipped ahead from v1: v2 not published, or not stable when v3 was found"), lines[-1]

    # an older step appearing after a newer one: ignored, named once
    _publish(run, 2)
    n = len(lines)
    assert not _poll(follower) and not _poll(follower) and engine.info().weight_version == 3
    assert lines[n:] == [f"{layout.broadcast_dir(run, 2)} appeared after version 3 was loaded: older than what the "
                         "engines hold, ignored"]

    # STABLE of the loaded step rewritten, then (after the next load) removed: named once each, nothing reloaded
    stable = layout.broadcast_dir(run, 3) / layout.STABLE
    os.utime(stable, (time.time() + 5, time.time() + 5))
    n = len(lines)
    assert not _poll(follower) and not _poll(follower) and engine.info().weight_version == 3
    assert lines[n:] == [f"{stable} was rewritten after version 3 was loaded: the engines keep the weights they "
                         "validated and loaded (a version is loaded once)"]
    _publish(run, 4)
    assert _poll(follower) and engine.info().weight_version == 4
    (layout.broadcast_dir(run, 4) / layout.STABLE).unlink()
    n = len(lines)
    assert not _poll(follower) and not _poll(follower) and engine.info().weight_version == 4
    assert len(lines) == n + 1 and "step_4/STABLE was removed after version 4 was loaded" in lines[-1]

    # a file truncated under an existing STABLE: refused (named), the engines keep version 4
    bad = _publish(run, 5)
    shard = next(bad.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:20])
    assert not _poll(follower) and engine.info().weight_version == 4
    assert lines[-1].startswith(f"weights {bad} refused: ") and lines[-1].endswith("the engines stay on version 4")
    assert not _poll(follower) and lines[-1].startswith(f"weights {bad} refused: ")  # refused once, not again

    # names a trainer never writes, and a symlink out of the run directory: one line each, once
    outside = tmp_path / "elsewhere"
    _publish(outside, 9)
    (run / layout.BROADCASTS / "step_9").symlink_to(layout.broadcast_dir(outside, 9), target_is_directory=True)
    for name in ("step_abc", "step_-1", "step_" + "7" * 30, "step_06"):
        (run / layout.BROADCASTS / name).mkdir()
        (run / layout.BROADCASTS / name / layout.STABLE).touch()
    n = len(lines)
    assert not _poll(follower) and not _poll(follower) and engine.info().weight_version == 4
    named = sorted(line.split("/")[-1].split(" ")[0] for line in lines[n:])
    assert named == sorted(["step_9", "step_abc", "step_-1", "step_" + "7" * 30, "step_06"]), lines[n:]
    assert all(" is not a broadcast, ignored: " in line for line in lines[n:])
    assert "symlink" in next(line for line in lines[n:] if "/step_9 " in line)


def test_a_step_deleted_while_it_is_validated_or_before_it_is_read_changes_nothing(tmp_path):
    run = tmp_path / "run"
    _publish(run, 1)
    follower, engine, lines = _follower(run, DeletedWhileValidated(synthetic=True, vocab_size=VOCAB))
    assert not _poll(follower) and engine.info().weight_version == 0 and follower.version == 0
    assert lines[-1].startswith(f"weights {layout.broadcast_dir(run, 1)} ") and "version 0" in lines[-1], lines
    # found, then removed before the follower reads its STABLE: one line, the service goes on
    follower, engine, lines = _follower(run)
    _publish(run, 2)
    shutil.rmtree(layout.broadcast_dir(run, 2))
    assert not asyncio.run(follower.load(2)) and engine.info().weight_version == 0
    assert lines == [f"weights {layout.broadcast_dir(run, 2)} vanished before it was loaded "
                     f"({layout.broadcast_dir(run, 2) / layout.STABLE}); the engines stay on version 0"]


def test_keep_broadcasts_removes_older_steps_but_never_what_the_engines_hold(tmp_path):
    run = tmp_path / "run"
    follower, engine, lines = _follower(run, keep_broadcasts=2)
    for n in range(1, 7):
        _publish(run, n)
        assert _poll(follower) and engine.info().weight_version == n
        assert layout.step_numbers(run) == list(range(max(1, n - 1), n + 1)), (n, layout.step_numbers(run))
    # a step still being written (no STABLE yet) is left alone; so is the one the engines hold
    (run / layout.BROADCASTS / "step_7").mkdir()
    assert not _poll(follower) and layout.step_numbers(run) == [5, 6, 7]
    assert follower.removed_broadcasts == 4 and not any("could not remove" in line for line in lines)
    # off by default: nothing is removed
    other = tmp_path / "other"
    follower, engine, _ = _follower(other)
    for n in range(1, 5):
        _publish(other, n)
        assert _poll(follower)
    assert layout.step_numbers(other) == [1, 2, 3, 4]


def test_a_checkpoint_file_that_would_block_is_refused_before_any_engine_reads_it(tmp_path):
    run = tmp_path / "run"
    step = _publish(run, 1)
    (step / "model.safetensors").unlink()
    os.mkfifo(step / "model.safetensors")  # an open() for reading waits for a writer that never comes
    follower, engine, lines = _follower(run)
    assert not _poll(follower) and engine.info().weight_version == 0
    assert lines == [f"weights {step} refused: model.safetensors is not a regular file (a FIFO, socket or device "
                     "would block or never end); the engines stay on version 0"]
    assert not _poll(follower) and len(lines) == 1  # refused once, not retried


def test_a_validation_that_never_returns_is_refused_within_the_bound_and_its_engine_is_hung(tmp_path):
    run = tmp_path / "run"
    step = _publish(run, 1)
    follower, _, lines = _follower(run, Hangs("validate"), None, ReplayEngine(synthetic=True, vocab_size=VOCAB),
                                   load_timeout_s=0.3)
    t0 = time.monotonic()
    assert not _poll(follower)
    assert time.monotonic() - t0 < 5 and follower.version == 0
    assert lines == [
        "engine 0 lost: hung (validating step_1 did not finish within follow.load_timeout_s 0.3); 1 of 2 engines "
        "serving; it runs in this process and cannot be restarted",
        f"weights {step} refused: engine 0 did not validate it within follow.load_timeout_s 0.3; the engines stay "
        "on version 0"]
    assert follower.holder.router.alive() == [1]


def test_a_load_that_never_returns_costs_that_engine_only_and_the_others_load(tmp_path):
    run = tmp_path / "run"
    _publish(run, 1)
    other, hung = ReplayEngine(synthetic=True, vocab_size=VOCAB), Hangs("load")
    follower, _, lines = _follower(run, other, None, hung, load_timeout_s=0.3)
    assert _poll(follower) and follower.version == 1 and other.info().weight_version == 1
    assert hung.info().weight_version == 0 and follower.holder.router.alive() == [0]
    assert lines[0] == ("engine 1 lost: hung (loading step_1 did not finish within follow.load_timeout_s 0.3); 1 of "
                        "2 engines serving; it runs in this process and cannot be restarted")
    assert lines[1].startswith("weights v1 loaded in "), lines
