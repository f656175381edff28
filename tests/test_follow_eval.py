"""Evaluation during training (``follow.eval``, issue 41 item 5), in a real follow run: SmolLM2 on the embedded
engine, a stand-in trainer publishing v1 after batch 1 and v2 after batch 2 (``max_off_policy_steps`` 0, so batch
k waits for version k - 1). With ``every: 2`` versions 0 and 2 are evaluated, 1 is not; each evaluation is sealed
in RUN_DIR/evals/step_N/ and its metrics.jsonl line is recomputed here from its shards alone."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout.config import EvalConfig, RunConfig
from rollout.data import load_samples
from rollout.data.readers import open_shards
from rollout.data.shards import read_manifest
from rollout.follow.eval import eval_dir, held_out_tasks
from rollout.follow.metrics import read_metrics
from rollout.follow.publish import publish_weights

from .test_follow import Harness, _config, _config_of, _perturbed, _tasks, base_state, model_path  # noqa: F401


def _recompute(out, version: int, correct_at: float) -> dict:
    rows = open_shards(out).to_table(columns=["rollout_id", "task_id", "segment_index", "reward", "error",
                                              "weight_versions", "loss_mask"]).to_pylist()
    pure: dict[str, list[float]] = {}
    for r in rows:
        if r["segment_index"] != 0 or r["error"] is not None:
            continue
        sampled = {v for v, m in zip(r["weight_versions"], r["loss_mask"]) if m}
        if sampled <= {version}:
            pure.setdefault(r["task_id"], []).append(r["reward"])
    rewards = [x for xs in pure.values() for x in xs]
    return {"counted": len(rewards), "accuracy": round(sum(x >= correct_at for x in rewards) / len(rewards), 4),
            "reward_mean": round(sum(rewards) / len(rewards), 4),
            "pass@2": round(sum(any(x >= correct_at for x in xs) for xs in pure.values()) / len(pure), 4)}


def test_versions_0_and_every_kth_are_evaluated_on_held_out_tasks_beside_the_batches(tmp_path, model_path,  # noqa: F811
                                                                                       base_state):  # noqa: F811
    model, base = base_state
    cfg = _config(16, max_steps=3, max_off_policy_steps=0,
                  eval=EvalConfig(every=2, group_size=2, tasks={"count": 3}, sampling={"temperature": 0.0}))
    h = Harness(cfg, tmp_path, model_path, _tasks(4))

    async def main() -> None:
        run = asyncio.create_task(h.follow.run())
        for k in (1, 2):  # the trainer: reads batch k, publishes version k
            while h.follow.sealed < k:
                await asyncio.sleep(0.05)
            publish_weights(tmp_path, k, _perturbed(base, 1.0 + 0.1 * k), config=_config_of(model))
        assert await asyncio.wait_for(run, 600) == 3

    asyncio.run(main())
    h.service.close()
    assert sorted(p.name for p in (tmp_path / "evals").iterdir()) == ["step_0", "step_2"]
    lines = [m for m in read_metrics(tmp_path) if m.get("kind") == "eval"]
    assert [m["eval_version"] for m in lines] == [0, 2]
    assert [m["step"] for m in read_metrics(tmp_path) if m.get("kind") != "eval"] == [1, 2, 3]
    for m in lines:
        v, out = m["eval_version"], eval_dir(tmp_path, m["eval_version"])
        manifest = read_manifest(out)
        assert manifest["eval"] == m["eval"] and m["eval"]["version"] == v
        assert m["eval"]["tasks"] == 3 and m["eval"]["rollouts"] == 6 and m["eval"]["errors"] == 0
        want = _recompute(out, v, 1.0)
        assert {key: m["eval"][key] for key in want} == want, (m, want)
        assert m["eval"]["counted"] + m["eval"]["spanned"] == 6
        groups = open_shards(out).to_table(columns=["group_id"])["group_id"].to_pylist()
        assert {g.split("/")[0] for g in groups} == {f"eval{v}"} and len(load_samples(out)) >= 6
        # held out: no eval task's prompt is a training task's
        tasks = [json.loads(t) for t in open_shards(out).to_table(columns=["task"])["task"].to_pylist()]
        assert len({t["task_id"] for t in tasks}) == 3
        assert not {json.dumps(t["messages"]) for t in tasks} & {json.dumps(t.messages) for t in _tasks(4)}
    # greedy at version 0: an evaluation is the same figures each time; the weights moved by version 2
    assert any("eval of version 2: accuracy" in line for line in h.lines), h.lines


def test_eval_tasks_that_are_all_in_the_training_pool_are_refused_before_anything_runs():
    cfg = RunConfig(env={"name": "arithmetic"}, tasks={"count": 8, "seed": 3},
                    follow={"eval": {"tasks": {"count": 8, "seed": 3}}})
    from rollout.envs import make_env

    train = make_env("arithmetic").generate_tasks(8, 3)
    with pytest.raises(ValueError, match=r"follow.eval: all 8 eval tasks are also in the training pool"):
        held_out_tasks(cfg, train)
    # the default seed: tasks.seed + 1, and any task the pool has is dropped
    cfg = RunConfig(env={"name": "arithmetic"}, tasks={"count": 8, "seed": 3}, follow={"eval": {"tasks": {"count": 8}}})
    tasks, dropped = held_out_tasks(cfg, train)
    assert len(tasks) + dropped == 8 and tasks
    assert not {json.dumps(t.messages) for t in tasks} & {json.dumps(t.messages) for t in train}
