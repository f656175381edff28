"""The rollout loop without Ray: a strict replay engine serves exactly the prompts the loop must
send (computed here with the renderer and the environment), so any drift in what the loop renders,
bridges or records fails the run."""

from __future__ import annotations

import asyncio
import json

import tito_renderers as renderers
from rollout.config import RunConfig
from rollout.data.shards import read_table
from rollout.engines.replay import ReplayEngine, ReplayRecord
from rollout.envs.calculator import CalculatorEnv
from rollout.handles import LocalEngine, LocalRenderer
from rollout.loop import RolloutDriver
from rollout.renderer_service import RendererService

from ._support import ours, tokenizer_dir


def _script(env, task, r, tok):
    """The two turns a correct model would take: a calculator call, then the answer."""
    expression = task.metadata.get("expression") or task.messages[-1]["content"].split("compute ")[1].split(".")[0]
    prompt0 = r.render_ids(task.messages, env.tools, add_generation_prompt=True)
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    c0 = tok.encode(f"<tool_call>\n{call}\n</tool_call><|im_end|>")
    parsed0 = r.parse_response(c0, prompt0, env.tools)
    step0 = asyncio.run(env.step(env.reset(task), parsed0))
    prompt1 = r.bridge(prompt0, c0, step0.new_messages, env.tools).token_ids
    c1 = tok.encode(f"{task.answer}<|im_end|>")
    return [ReplayRecord(prompt0, c0, [-0.125] * len(c0), "stop", c0[-1]),
            ReplayRecord(prompt1, c1, [-0.25] * len(c1), "stop", c1[-1])], c0, c1, prompt1


def test_multi_turn_rollouts_write_exact_samples(tmp_path):
    tok = ours("qwen2.5-7b-instruct")
    r = renderers.create_renderer(tok)
    env = CalculatorEnv()
    good, bad = env.generate_tasks(2, seed=3)
    records, c0, c1, prompt1 = _script(env, good, r, tok)
    engine = ReplayEngine(records, vocab_size=tok.vocab_size, max_model_len=4096)
    svc = RendererService(str(tokenizer_dir("qwen2.5-7b-instruct")), out_dir=str(tmp_path), rows_per_file=100)
    cfg = RunConfig(group_size=2, max_turns=4, max_tokens_per_turn=64, max_tokens_per_rollout=256)
    driver = RolloutDriver(cfg, env, [LocalEngine(engine)], [LocalRenderer(svc)], engine.info(), r)
    outcomes = asyncio.run(driver.run([good, bad]))
    svc.close()

    ok = [o for o in outcomes if o.task_id == good.task_id]
    failed = [o for o in outcomes if o.task_id == bad.task_id]
    assert [o.finish_reason for o in ok] == ["env_done", "env_done"]
    assert all(o.reward == 1.0 and o.turns == 2 and o.error is None for o in ok)
    # the task with no recorded completion fails cleanly; the run went on
    assert len(failed) == 2 and all(o.finish_reason == "error" and "EngineError" in o.error for o in failed), failed[0].error

    table = read_table(next(tmp_path.glob("data/train-*.arrow")))
    rows = table.to_pylist()
    assert sorted(row["rollout_id"] for row in rows) == sorted(o.rollout_id for o in outcomes)  # each exactly once
    for row in rows:
        if row["task_id"] != good.task_id:
            assert row["error"] and not any(row["loss_mask"])
            continue
        assert row["token_ids"] == prompt1 + c1  # the final prompt was the bridge's, append-only
        trained = [t for t, m in zip(row["token_ids"], row["loss_mask"]) if m]
        assert trained == c0 + c1  # exactly the engine's tokens
        lps = [lp for lp, m in zip(row["logprobs"], row["loss_mask"]) if m]
        assert lps == [-0.125] * len(c0) + [-0.25] * len(c1)
        assert row["segment_count"] == 1 and json.loads(row["breaks"]) == []
        assert row["advantage"] == 0.0 and row["reward"] == 1.0
        messages = json.loads(row["messages"])
        assert [m["role"] for m in messages][-3:] == ["assistant", "tool", "assistant"]
        assert max(row["message_index"]) == len(messages) - 1
    assert driver.finish_counts == {"env_done": 2, "error": 2}


def _synthetic_driver(tmp_path, **engine_kwargs):
    tok = ours("qwen2.5-7b-instruct")
    r = renderers.create_renderer(tok)
    engine = ReplayEngine(synthetic=True, vocab_size=tok.vocab_size, **engine_kwargs)
    svc = RendererService(str(tokenizer_dir("qwen2.5-7b-instruct")), out_dir=str(tmp_path))
    return r, engine, svc


def test_context_limit_stops_cleanly_before_the_request(tmp_path):
    r, engine, svc = _synthetic_driver(tmp_path, max_model_len=120)
    env = CalculatorEnv()
    task = env.generate_tasks(1, seed=0)[0]
    assert len(r.render_ids(task.messages, env.tools, add_generation_prompt=True)) + 64 > 120
    cfg = RunConfig(group_size=1, max_turns=3, max_tokens_per_turn=64, max_tokens_per_rollout=128)
    (out,) = asyncio.run(RolloutDriver(cfg, env, [LocalEngine(engine)], [LocalRenderer(svc)], engine.info(), r).run([task]))
    assert out.finish_reason == "context_limit" and out.turns == 0 and out.error is None


def test_a_rollout_that_times_out_is_recorded_and_its_engine_request_aborted(tmp_path):
    r, engine, svc = _synthetic_driver(tmp_path, max_model_len=4096, token_delay_s=0.05)
    env = CalculatorEnv()
    tasks = env.generate_tasks(2, seed=0)
    cfg = RunConfig(group_size=1, max_turns=2, max_tokens_per_turn=64, max_tokens_per_rollout=128, rollout_timeout_s=0.5)
    outcomes = asyncio.run(RolloutDriver(cfg, env, [LocalEngine(engine)], [LocalRenderer(svc)], engine.info(), r).run(tasks))
    assert [o.finish_reason for o in outcomes] == ["timeout", "timeout"]
    assert all("timed out after 0.5s" in o.error for o in outcomes)
    assert not engine._running, "the engine still runs the timed-out requests"
    svc.close()
    rows = read_table(next(tmp_path.glob("data/train-*.arrow"))).to_pylist()
    assert sorted(row["rollout_id"] for row in rows) == sorted(o.rollout_id for o in outcomes)
    assert all(row["finish_reason"] == "timeout" and row["error"] for row in rows)


def test_progress_line_counts_rollouts_tokens_breaks_and_reward():
    import io

    from rollout.cli.progress import Progress
    from rollout.loop import RolloutOutcome

    out = io.StringIO()
    bar = Progress(4, stream=out)
    tok = ours("qwen2.5-7b-instruct")
    engine = ReplayEngine(synthetic=True, vocab_size=tok.vocab_size)
    bar.driver = RolloutDriver(RunConfig(), CalculatorEnv(), [LocalEngine(engine)], [], engine.info(), renderers.create_renderer(tok))
    bar.driver.breaks = 1  # one of the four turns below was re-rendered
    bar(RolloutOutcome("r0", "t", "t", "env_done", reward=1.0, turns=2, completion_tokens=10))
    bar(RolloutOutcome("r1", "t", "t", "error", reward=0.0, turns=2, completion_tokens=6, error="x"))
    line = out.getvalue().split("\r")[-1]
    assert "rollouts 2/4" in line and "break rate 0.250" in line and "mean reward 0.500" in line and "errors 1" in line


def test_a_conversation_crosses_to_the_renderer_once_and_its_rows_hold_all_of_it(tmp_path):
    """At max_turns the environment's last answer reaches no bridge: only it is sent at finish, and the
    rows still record the whole conversation (the renderer's copy, then that answer)."""
    tok = ours("qwen2.5-7b-instruct")
    r = renderers.create_renderer(tok)
    env = CalculatorEnv()
    (task,) = env.generate_tasks(1, seed=3)
    records, c0, _, _ = _script(env, task, r, tok)
    engine = ReplayEngine(records[:1], vocab_size=tok.vocab_size, max_model_len=4096)
    svc = RendererService(str(tokenizer_dir("qwen2.5-7b-instruct")), out_dir=str(tmp_path))
    sent = []

    class Recording(LocalRenderer):
        async def finish_group(self, items):
            sent.extend(items)
            return await super().finish_group(items)

    cfg = RunConfig(group_size=1, max_turns=1, max_tokens_per_turn=64, max_tokens_per_rollout=256)
    (out,) = asyncio.run(RolloutDriver(cfg, env, [LocalEngine(engine)], [Recording(svc)], engine.info(), r).run([task]))
    svc.close()
    assert out.finish_reason == "max_turns" and [m["role"] for m in out.messages][-2:] == ["assistant", "tool"]
    (item,) = sent
    assert item.meta.messages is None and item.meta.unsent_messages == out.messages[-1:]
    (row,) = read_table(next(tmp_path.glob("data/train-*.arrow"))).to_pylist()
    assert json.loads(row["messages"]) == out.messages
