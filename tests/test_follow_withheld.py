"""Withheld per sample, not per group: a rollout whose tokens are older than its batch's bound is not written,
its group's other rollouts are, its reward still counts in the group's baseline, and the batch's manifest
names it with the reason. Admission makes this rare; here it is forced the way it happens in a fleet: two real
replay engines, one that loaded version 1 and one still on version 0 (as when an engine failed to load a
checkpoint the others took), so a group's rollouts land on both."""

from __future__ import annotations

import asyncio

import tito_renderers as renderers
from rollout.config import RunConfig
from rollout.data import layout, load_samples
from rollout.data.shards import read_manifest
from rollout.engines.replay import ReplayEngine, ReplayRecord
from rollout.envs.arithmetic import ArithmeticEnv
from rollout.envs.base import Task
from rollout.follow.service import seal_batch
from rollout.handles import LocalEngine, LocalRenderer
from rollout.loop import RolloutDriver
from rollout.renderer_service import RendererService

from ._support import ours, tokenizer_dir

QWEN = "qwen2.5-7b-instruct"


def test_a_stale_rollout_is_withheld_alone_and_still_counts_in_the_baseline(tmp_path):
    tok = ours(QWEN)
    r = renderers.create_renderer(tok)
    env = ArithmeticEnv()
    task = Task(task_id="t", messages=[{"role": "user", "content": "What is 3 + 4?"}], answer="7")
    prompt = r.render_ids(task.messages, env.tools, add_generation_prompt=True)

    def record(text: str) -> ReplayRecord:
        ids = tok.encode(f"{text}<|im_end|>")
        return ReplayRecord(prompt, ids, [-0.5] * len(ids), "stop", ids[-1])

    # each engine answers its rollouts in turn: fresh (v1) right then wrong, stale (v0) wrong twice
    fresh = ReplayEngine([record("7"), record("3")], vocab_size=tok.vocab_size, max_model_len=4096,
                         token_delay_s=0.01, weight_version=1)
    stale = ReplayEngine([record("3"), record("3")], vocab_size=tok.vocab_size, max_model_len=4096,
                         token_delay_s=0.01, weight_version=0)
    svc = RendererService(str(tokenizer_dir(QWEN)), out_dir=str(tmp_path / layout.ROLLOUTS), flush_interval_s=None)
    cfg = RunConfig(group_size=4, max_turns=1, max_tokens_per_turn=16, max_tokens_per_rollout=16)
    driver = RolloutDriver(cfg, env, [LocalEngine(fresh), LocalEngine(stale)], [LocalRenderer(svc)], fresh.info(), r)
    out_dir = layout.step_dir(tmp_path, 2)
    outcomes = asyncio.run(driver.run_group(task, 0, group_id="t@2.0", out_dir=str(out_dir), min_version=1))

    by_version = {o.rollout_id: o.version_min for o in outcomes}
    assert sorted(by_version.values()) == [0, 0, 1, 1], by_version  # the group landed on both engines
    withheld = [o for o in outcomes if o.withheld]
    kept = [o for o in outcomes if not o.withheld]
    assert {o.version_min for o in withheld} == {0} and {o.version_min for o in kept} == {1}
    assert all("stale: sampled by version 0 < 1" == o.withheld for o in withheld)
    # the baseline is the mean over all four rewards (1, 0, 0, 0): 0.25, not the kept pair's 0.5
    assert sorted(o.reward for o in outcomes) == [0.0, 0.0, 0.0, 1.0]
    assert sorted(o.advantage for o in kept) == [-0.25, 0.75]

    files = asyncio.run(LocalRenderer(svc).close_output(str(out_dir)))["files"]
    seal_batch(tmp_path, 2, files=files, outcomes=outcomes, bound=1, info={}, config=cfg.model_dump(mode="json"))
    samples = load_samples(out_dir)
    assert sorted(s.rollout_id for s in samples) == sorted(o.rollout_id for o in kept)
    assert sorted(s.advantage for s in samples) == [-0.25, 0.75]
    manifest = read_manifest(out_dir)
    listed = {w["rollout_id"]: w for w in manifest["follow"]["withheld"]}
    assert set(listed) == {o.rollout_id for o in withheld}
    assert all(w["reason"].startswith("stale") and w["reward"] == 0.0 for w in listed.values())
    svc.close()
