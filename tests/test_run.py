"""Runs on a real local Ray: the run writes readable shards once per rollout, an engine killed
mid-run loses and duplicates nothing, and --resume completes an interrupted run without duplicates.
The engines are replay engines in synthetic mode (fast, deterministic); the embedded engine's run is
in test_demo.py."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from actors.engine import start_engine_actors  # noqa: E402
from rollout.config import load_config  # noqa: E402
from rollout.envs import make_env  # noqa: E402
from rollout.inspect_shards import summarize  # noqa: E402
from rollout.loop import RolloutDriver  # noqa: E402
from rollout.renderer_service import RendererService  # noqa: E402
from rollout.run import done_rollouts, run  # noqa: E402
from rollout.shards import MANIFEST, SUMMARY, read_table  # noqa: E402

from ._support import tokenizer_dir  # noqa: E402

VOCAB = 151665  # the Qwen2.5 fixture's vocabulary


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             namespace="tito-test-run", _temp_dir=str(tmp_path_factory.mktemp("ray")), log_to_driver=False)
    yield
    ray.shutdown()


def _config(tmp_path, **over):
    sets = [
        f"model={tokenizer_dir('qwen2.5-7b-instruct')}", "engine.backend=replay", "engine.count=2",
        f"engine.options={{synthetic: true, vocab_size: {VOCAB}, max_model_len: 4096, token_delay_s: 0.002}}",
        "env.name=try_again", "tasks.count=3", "group_size=2", "max_turns=3", "max_tokens_per_turn=24",
        "max_tokens_per_rollout=72", f"output.dir={tmp_path / 'out'}", "sampling.seed=7", "renderer.actors=2",
    ]
    sets += [f"{k}={v}" for k, v in over.items()]
    return load_config(None, sets)


def _rows(out_dir):
    rows = []
    for path in sorted(out_dir.glob("data/train-*")) + sorted(out_dir.glob("shard-*")):
        rows += read_table(path).select(["rollout_id", "task_id", "segment_index", "loss_mask", "reward"]).to_pylist()
    return rows


def test_run_writes_each_rollout_once(tmp_path):
    cfg = _config(tmp_path)
    summary = run(cfg, progress=False)
    out = tmp_path / "out"
    assert summary["rollouts"] == 6 and summary["errors"] == 0
    rows = _rows(out)
    firsts = [r["rollout_id"] for r in rows if r["segment_index"] == 0]
    assert sorted(firsts) == sorted({r["rollout_id"] for r in rows}) and len(firsts) == 6
    assert all(any(r["loss_mask"]) for r in rows)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["rows"] == len(rows)
    saved = json.loads((out / SUMMARY).read_text())
    assert saved["rollouts"] == 6 and saved["this_run"]["rollouts"] == 6
    # the resolved config and the sampling params travel with the data: manifest, summary and rows
    assert manifest["config"] == saved["config"] == cfg.model_dump(mode="json")
    assert manifest["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 7}
    sampled = read_table(next(out.glob("data/*.arrow")), columns=["temperature", "top_p", "top_k", "seed"])
    assert set(map(tuple, (r.values() for r in sampled.to_pylist()))) == {(1.0, 1.0, 0, 7)}
    assert summarize(out)["rollouts"] == 6
    # a second run into the same directory must not silently mix runs
    with pytest.raises(ValueError, match="--resume"):
        run(cfg, progress=False)


def test_resume_completes_without_duplicates(tmp_path):
    run(_config(tmp_path, **{"tasks.count": 2}), progress=False)  # "interrupted" after 2 of 4 tasks
    before = done_rollouts(tmp_path / "out")
    assert len(before) == 4
    summary = run(_config(tmp_path, **{"tasks.count": 4}), resume=True, progress=False)
    assert summary["this_run"]["skipped_tasks_resumed"] == 2 and summary["this_run"]["rollouts"] == 4
    # manifest and summary cover every shard on disk, both runs'
    assert summary["rollouts"] == 8 and summary["tasks"] == 4
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["rows"] == len(_rows(tmp_path / "out")) and len(manifest["files"]) == len(list((tmp_path / "out").glob("data/*")))
    firsts = [r["rollout_id"] for r in _rows(tmp_path / "out") if r["segment_index"] == 0]
    assert len(firsts) == len(set(firsts)) == 8


def test_engine_killed_mid_run_loses_and_duplicates_nothing(tmp_path):
    cfg = _config(tmp_path, **{"tasks.count": 4, "engine.options": "{synthetic: true, vocab_size: 151665, "
                                                    "max_model_len: 4096, token_delay_s: 0.02}"})
    engines = start_engine_actors([{"kind": "replay", "kwargs": dict(cfg.engine.options), "replicas": 2, "num_cpus": 0}])
    info = ray.get(engines[0].info.remote())
    svc = RendererService(cfg.model, out_dir=str(tmp_path / "out"), rows_per_file=3)
    env = make_env("try_again")
    tasks = env.generate_tasks(4, 0)
    driver = RolloutDriver(cfg, env, engines, [svc], info, svc.renderer)

    async def main():
        job = asyncio.create_task(driver.run(tasks))
        await asyncio.sleep(0.4)  # rollouts are mid-turn on both engines
        ray.kill(engines[0])
        return await job

    outcomes = asyncio.run(main())
    svc.close()
    assert driver.reruns > 0, "the kill should have hit running rollouts"
    assert len(outcomes) == 8 and all(o.error is None for o in outcomes)
    firsts = [r["rollout_id"] for r in _rows(tmp_path / "out") if r["segment_index"] == 0]
    assert sorted(firsts) == sorted(o.rollout_id for o in outcomes) and len(set(firsts)) == 8
    ray.kill(engines[1])
