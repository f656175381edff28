"""A real follow run (SmolLM2 embedded engine, a stand-in trainer publishing v1 mid-batch-1, then silent):
every metrics.jsonl field recomputed from that batch's shards and manifest, and RUN_DIR/status.json through
the run (sampling, validating/loading, waiting_for_weights at the bound, rewritten while idle, stalled, then
stopped) with `tito status`'s output and exit codes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

from rollout.cli.main import main as tito
from rollout.data import layout, load_samples
from rollout.data.readers import open_shards
from rollout.data.shards import read_manifest
from rollout.follow.metrics import read_metrics
from rollout.follow.publish import publish_weights
from rollout.follow.status import read_status

from .test_follow import Harness, _config, _config_of, _perturbed, _tasks, _turns_under_way, base_state, model_path  # noqa: F401


def _recompute(run_dir, k: int) -> dict:
    """Batch k's figures from its shards and manifest alone."""
    samples = load_samples(layout.step_dir(run_dir, k))
    withheld = read_manifest(layout.step_dir(run_dir, k))["follow"]["withheld"]
    tokens: Counter[int] = Counter()
    vmin: dict[str, int] = {}
    vmax: dict[str, int] = {}
    turns: dict[tuple[str, int], set[int]] = {}
    for s in samples:
        for v, t in zip(s.versions(), s.turn_index):
            if v >= 0:
                tokens[int(v)] += 1
                turns.setdefault((s.rollout_id, int(t)), set()).add(int(v))
                vmin[s.rollout_id] = min(vmin.get(s.rollout_id, v), int(v))
                vmax[s.rollout_id] = max(vmax.get(s.rollout_id, v), int(v))
    cols = open_shards(layout.step_dir(run_dir, k)).to_table(
        columns=["segment_index", "reward", "error", "completion_tokens", "finish_reason"]).to_pylist()
    firsts = [c for c in cols if c["segment_index"] == 0]
    rewards = [c["reward"] for c in firsts if c["error"] is None] + [w["reward"] for w in withheld]
    n = sum(tokens.values())
    return {
        "step": k, "samples": len(samples), "written": len(firsts), "withheld": len(withheld),
        "rollouts": len(firsts) + len(withheld),
        "completion_tokens": sum(c["completion_tokens"] for c in cols),
        "tokens_per_version": {str(v): c for v, c in sorted(tokens.items())},
        "staleness": {str(d): c for d, c in sorted(Counter(k - 1 - v for v in vmin.values()).items())},
        "token_staleness_mean": round(sum((k - 1 - v) * c for v, c in tokens.items()) / n, 4),
        "spanning_versions": sum(vmin[r] != vmax[r] for r in vmin),
        # abort_resume: a turn stopped by an update and continued under the new weights carries two versions
        "resumed_turns": sum(len(vs) > 1 for vs in turns.values()),
        "errors": sum(c["error"] is not None for c in firsts),
        "env_errors": sum(c["finish_reason"] == "env_error" for c in firsts + withheld),
        "reward": {"min": min(rewards), "mean": round(sum(rewards) / len(rewards), 4), "max": max(rewards)},
    }


def test_metrics_are_each_batchs_own_and_status_json_follows_the_run(tmp_path, model_path, base_state, capsys):  # noqa: F811
    model, base = base_state
    cfg = _config(24, max_steps=4, max_off_policy_steps=1, status_interval_s=1.0, stall_after_s=3.0)
    h = Harness(cfg, tmp_path, model_path, _tasks(4))
    seen_states: list[str] = []

    def status(*extra: str) -> tuple[int, str]:
        rc = tito(["status", str(tmp_path), *extra])
        return rc, capsys.readouterr().out

    async def main() -> None:
        run = asyncio.create_task(h.follow.run())
        await _turns_under_way(h, 0.5)
        seen_states.append(read_status(tmp_path)["state"])
        publish_weights(tmp_path, 1, _perturbed(base, 1.3), config=_config_of(model))  # then silent
        while h.follow.sealed < 3:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        first = read_status(tmp_path)
        await asyncio.sleep(5.5)  # idle at the bound: batch 4 needs version 2
        second = read_status(tmp_path)
        assert not run.done() and h.follow.sealed == 3
        assert second["updated_at"] - first["updated_at"] > 4, (first["updated_at"], second["updated_at"])
        for s in (first, second):
            assert s["state"] == "waiting_for_weights" and s["batch"] == 4 and s["sealed"] == 3
            assert s["version"] == [1] and s["engines_alive"] == s["engines_configured"] == 1
            assert "batch 4 needs version >= 2" in s["waiting_for"]["what"], s
        seen_states.extend(r["state"] for r in second["recent"])
        rc, out = status()  # nothing progressed for > follow.stall_after_s: stalled, naming what it waits for
        assert rc == 3 and "stalled" in out and "batch 4 needs version >= 2" in out, out
        rc, out = status("--json")
        assert rc == 3 and json.loads(out)["state"] == "waiting_for_weights"
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)

    asyncio.run(main())
    h.service.close()
    assert seen_states[0] == "sampling"
    assert {"sampling", "validating", "loading", "waiting_for_weights"} <= set(seen_states), seen_states
    assert seen_states.index("validating") < seen_states.index("loading")
    final = read_status(tmp_path)
    assert final["state"] == "stopped"
    rc, out = status()
    assert rc == 1 and "stopped" in out, out
    rc = tito(["status", str(tmp_path / "nothing")])
    assert rc == 2 and "status.json does not exist" in capsys.readouterr().err

    lines = read_metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        want = _recompute(tmp_path, m["step"])
        assert {key: m[key] for key in want} == want, (m["step"], m, want)
        versions = {int(v) for v in m["tokens_per_version"]}
        listed = {u["version"] for u in m["weight_updates"]}
        assert versions <= {m["admitted_at_version"]} | listed  # every version sampled: admitted under or loaded
        assert min(versions) >= m["step"] - 2  # the bound
        assert m["sampling_s"] <= m["batch_s"] and m["admission_wait_s"] >= 0
    one, _, three = lines
    assert one["resumed_turns"] >= 1 and one["spanning_versions"] >= 1  # the update stopped its turns
    assert [u["during"] for u in one["weight_updates"]] == ["sampling"]
    # admitted under the final version, nothing loaded while it ran: no resumed turns, its own figures only
    assert three["admitted_at_version"] == 1 and three["resumed_turns"] == 0 and three["tokens_per_version"].keys() == {"1"}
    assert all(u["during"] == "admission" for u in three["weight_updates"]), lines
    assert three["total_resumed_turns"] == sum(m["resumed_turns"] for m in lines) == h.driver.resumed_turns
    assert three["total_weight_updates"] == 1 and three["total_elapsed_s"] > one["total_elapsed_s"]
