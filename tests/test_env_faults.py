"""Environment faults cost one rollout, never the run (issue 41 item 7), on a real local Ray with replay engines
serving recorded completions for the exact prompts (transformers' apply_chat_template ids), so every rollout
reaches its environment's step and score.

One task per fault: reset, step and score raising; a step that awaits for ever and a score that blocks its thread
(both past ``env.timeout_s``); messages with an assistant role, a step returning a string, a 100 MB tool result;
a NaN reward and an infinite component. Each such rollout ends ``env_error`` with the fault in its row (its
conversation so far kept), the healthy tasks' rollouts are untouched, and the count is in the summary. A fault
rate above ``env.max_error_rate`` stops the run with one error naming the environment and the first fault."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from actors.placement import RayPlacement  # noqa: E402
from rollout.cli.run import run  # noqa: E402
from rollout.config import load_config  # noqa: E402
from rollout.data.readers import shard_files  # noqa: E402
from rollout.data.shards import read_table  # noqa: E402
from rollout.envs import Environment, RolloutState, Score, StepResult, Task  # noqa: E402
from rollout.loop import EnvErrorRate  # noqa: E402

from ._support import init_local_ray, reference, reference_ids, tokenizer_dir  # noqa: E402
from .test_run_failfast import ray_tmp  # noqa: E402, F401 - the fixture (a short RAY_TMPDIR, its session killed after)

RAY = RayPlacement()
QWEN = "qwen2.5-7b-instruct"
VOCAB = 151665
FAULTS = ["ok", "reset_raises", "step_raises", "score_raises", "step_hangs", "score_blocks", "assistant_message",
          "messages_not_a_list", "huge_tool_result", "nan_reward", "inf_component", "ok_too"]
EXPECTED = {
    "reset_raises": "reset() raised RuntimeError: reset broke",
    "step_raises": "step() raised KeyError: 'step broke'",
    "score_raises": "score() raised ZeroDivisionError: division by zero",
    "step_hangs": "step() did not return within env.timeout_s 1",
    "score_blocks": "score() did not return within env.timeout_s 1",
    "assistant_message": "step() returned malformed messages: new_messages[0] has role 'assistant' (an environment "
                         "adds user, tool, system)",
    "messages_not_a_list": "step() returned malformed messages: new_messages is a str, not a list",
    "huge_tool_result": "step() returned malformed messages: new_messages hold more than env.max_message_chars "
                        "1000000 characters (at new_messages[0]: 100000000)",
    "nan_reward": "score() gave reward = nan, not a finite number",
    "inf_component": "score() gave components['bonus'] = inf, not a finite number",
}


class FaultyEnv(Environment):
    """Task ``i`` misbehaves as ``FAULTS[i]`` says; the others end after one turn with reward 1."""

    name = "faulty"

    def reset(self, task: Task) -> RolloutState:
        if task.metadata["fault"] == "reset_raises":
            raise RuntimeError("reset broke")
        return RolloutState(task=task)

    async def step(self, state, parsed):
        fault = state.task.metadata["fault"]
        if fault == "step_raises":
            raise KeyError("step broke")
        if fault == "step_hangs":
            await asyncio.sleep(3600)
        if fault == "assistant_message":
            return StepResult(new_messages=[{"role": "assistant", "content": "I am the model now"}], done=False)
        if fault == "messages_not_a_list":
            return StepResult(new_messages="not a list", done=False)  # type: ignore[arg-type]
        if fault == "huge_tool_result":
            return StepResult(new_messages=[{"role": "tool", "content": "x" * 100_000_000}], done=False)
        return StepResult(new_messages=[], done=True)

    def score(self, state, trajectory):
        fault = state.task.metadata["fault"]
        if fault == "score_raises":
            return Score(reward=1 / 0)
        if fault == "score_blocks":
            time.sleep(4)  # a blocking call: bounded from the loop, its thread ends on its own
        if fault == "nan_reward":
            return Score(reward=float("nan"))
        if fault == "inf_component":
            return Score(reward=1.0, components={"bonus": float("inf")})
        return Score(reward=1.0)

    def generate_tasks(self, n, seed):
        return [Task(task_id=f"t{i}-{fault}", messages=[{"role": "user", "content": f"Task {i}: say ok."}],
                     metadata={"fault": fault}) for i, fault in enumerate(FAULTS[:n])]


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    init_local_ray(tmp_path_factory, "tito-test-env-faults")
    yield
    ray.shutdown()


def _config(tmp_path, n: int, **env):
    tok = reference(QWEN)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ok = tok("ok", add_special_tokens=False)["input_ids"] + [end]
    records = [{"prompt_ids": reference_ids(QWEN, t.messages, add_generation_prompt=True), "completion_ids": ok,
                "stop_token_id": end} for t in FaultyEnv().generate_tasks(n, 0)]
    settings = [f"model={tokenizer_dir(QWEN)}", "engine.backend=replay", "engine.num_cpus=0",
                f"engine.options={json.dumps({'records': records, 'vocab_size': VOCAB})}", "renderer.num_cpus=0",
                f"env.name={__name__}:FaultyEnv", "env.timeout_s=1", f"tasks.count={n}", "group_size=2",
                "max_turns=2", "max_tokens_per_turn=8", "max_tokens_per_rollout=16", f"output.dir={tmp_path / 'out'}"]
    return load_config(None, settings + [f"env.{k}={v}" for k, v in env.items()])


def test_each_env_fault_costs_its_rollouts_and_the_run_goes_on(tmp_path, local_ray):
    cfg = _config(tmp_path, len(FAULTS), max_error_rate=1.0)
    t0 = time.monotonic()
    summary = run(cfg, RAY, progress=False)
    assert time.monotonic() - t0 < 120
    faulty = len(EXPECTED) * 2
    assert summary["rollouts"] == len(FAULTS) * 2 and summary["this_run"]["env_errors"] == faulty, summary
    assert summary["finish_reasons"] == {"env_error": faulty, "env_done": 4}, summary["finish_reasons"]
    rows = [r for f in shard_files(tmp_path / "out") for r in read_table(f).to_pylist()]
    assert len({r["rollout_id"] for r in rows}) == len(FAULTS) * 2
    for r in rows:
        fault = json.loads(r["task"])["metadata"]["fault"]
        if fault in ("ok", "ok_too"):
            assert r["finish_reason"] == "env_done" and r["error"] is None and r["reward"] == 1.0
            continue
        assert r["finish_reason"] == "env_error" and r["advantage"] == 0.0, r
        assert r["error"] == f"environment '{cfg.env.name}': {EXPECTED[fault]}", r["error"]
        messages = json.loads(r["messages"])
        if fault != "reset_raises":  # the conversation up to the fault: its prompt and the model's answer
            assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"] == "ok", messages


def test_a_fault_rate_above_the_bound_stops_the_run_naming_the_env_and_the_first_fault(tmp_path, local_ray):
    cfg = _config(tmp_path, 4, max_error_rate=0.3, error_rate_after=4)
    with pytest.raises(EnvErrorRate) as caught:
        run(cfg, RAY, progress=False)
    message = str(caught.value)
    assert message.startswith(f"environment '{cfg.env.name}': ") and "rollouts ended with env_error (above " \
        "env.max_error_rate 0.3); the first: environment " in message, message
    assert any(EXPECTED[f] in message for f in ("reset_raises", "step_raises", "score_raises")), message
    assert caught.value.summary is not None  # what finished was written before it stopped


def test_tito_run_follow_stops_with_one_line_and_exit_5_above_the_fault_rate(tmp_path, ray_tmp):  # noqa: F811
    """The same bound in --follow: a pool whose every other task cannot even be reset stops the service with
    one line (exit 5), sealed batches kept."""
    import subprocess
    import sys

    from ._support import REPO, sigint_default

    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({
        "model": str(tokenizer_dir(QWEN)), "engine": {"backend": "replay", "num_cpus": 0, "options": {
            "synthetic": True, "vocab_size": VOCAB, "max_model_len": 4096}},
        "renderer": {"num_cpus": 0}, "env": {"name": f"{__name__}:FaultyEnv", "max_error_rate": 0.3,
                                             "error_rate_after": 4},
        "tasks": {"count": 2}, "group_size": 2, "max_turns": 1, "max_tokens_per_turn": 4, "max_tokens_per_rollout": 4,
        "follow": {"groups_per_step": 1, "max_steps": 50, "max_off_policy_steps": 100, "poll_interval_s": 0.1},
        "ray": {"num_cpus": 2}}))
    run_dir = tmp_path / "run"
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_TMPDIR=ray_tmp, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "actors.cli", "run", str(cfg), "--follow", str(run_dir)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300, preexec_fn=sigint_default)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tito run --follow: environment '{__name__}:FaultyEnv': ") and "rollouts ended with " \
        "env_error (above env.max_error_rate 0.3); the first: " in last and "reset() raised RuntimeError: reset " \
        "broke: stopping; " in last and f"batches sealed in {run_dir}" in last, last


def test_the_guard_awaits_async_reset_and_score_and_bounds_them():
    from rollout.envs.guard import EnvFault, GuardedEnv

    class AsyncEnv(FaultyEnv):
        name = "async_env"

        async def reset(self, task):  # an env whose reset and score are coroutines (verifiers-style)
            return RolloutState(task=task)

        async def score(self, state, trajectory):
            if state.task.metadata["fault"] == "score_blocks":
                await asyncio.sleep(3600)
            return Score(reward=0.5)

    guard = GuardedEnv(AsyncEnv(), name="async_env", timeout_s=0.5, max_message_chars=100)
    ok, hangs = AsyncEnv().generate_tasks(6, 0)[0], AsyncEnv().generate_tasks(6, 0)[5]

    async def main():
        state = await guard.reset(ok)
        assert isinstance(state, RolloutState) and (await guard.score(state, [])).reward == 0.5
        with pytest.raises(EnvFault, match=r"environment 'async_env': score\(\) did not return within env.timeout_s "
                                           r"0.5"):
            await guard.score(await guard.reset(hangs), [])

    asyncio.run(main())
