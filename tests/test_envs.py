"""Environments: the safe calculator, the Python sandbox, tool-call error handling, the built-ins' flows and
scores, task files and generators. Everything runs on CPU in a few seconds (the sandbox tests start short
subprocesses)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.envs import (
    ENVIRONMENTS,
    CalculatorError,
    EnvError,
    Environment,
    RolloutState,
    Score,
    StepResult,
    Task,
    TaskFileError,
    call_ids,
    env_options,
    evaluate,
    generate_tasks,
    load_tasks,
    make_env,
)
from rollout.envs.scoring import check_answer, last_number
from tito_renderers.types import ParsedResponse, ToolCall, ToolCallStatus

# -- helpers ---------------------------------------------------------------------------------------------


def call(name: str | None, arguments: Any, status: ToolCallStatus = ToolCallStatus.OK, error: str | None = None):
    return ToolCall(name=name, arguments=arguments, status=status, token_span=(0, 1), raw=f"raw {name}", error=error)


def response(content: str = "", *calls: ToolCall) -> ParsedResponse:
    return ParsedResponse(
        content=content, reasoning_content=None, tool_calls=list(calls), reasoning_complete=None, stop_token_id=0
    )


def task(answer: str | None = "444", prompt: str = "What is 37 * 12?") -> Task:
    return Task(task_id="t", messages=[{"role": "user", "content": prompt}], answer=answer)


async def rollout(env, t: Task, turns: list[ParsedResponse]):
    """A minimal rollout loop: what rollout/ does, without the engine. Returns (state, trajectory, results)."""
    state = env.reset(t)
    trajectory = list(t.messages)
    results = []
    for parsed in turns:
        trajectory.append(parsed.to_message())
        result = await env.step(state, parsed)
        trajectory.extend(result.new_messages)
        results.append(result)
        if result.done:
            break
    return state, trajectory, results


# -- calculator --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("37 * 12", 444),
        ("(37 * 12) - 5 ** 2", 419),
        ("-(3 + 4) * 2", -14),
        ("+5 - -5", 10),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("1 / 4", 0.25),
        ("2 ** -1", 0.5),
        ("10 - 2 - 3", 5),
        ("2 ** 3 ** 2", 512),
        ("2 ** 1000 % 7", 2),
        ("3 × 4 ÷ 2", 6.0),
        ("1_000 + 0.5", 1000.5),
    ],
)
def test_calculator_evaluates(expression: str, expected: float) -> None:
    assert evaluate(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os')", "function calls are not allowed"),
        ("__import__('os').system('true')", "function calls"),
        ("abs(-1)", "function calls"),
        ("x + 1", "names are not allowed"),
        ("__builtins__", "names are not allowed"),
        ("(1).real", "attribute access"),
        ("[1, 2][0]", "unsupported syntax: Subscript"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 1j", "only numbers"),
        ("lambda: 1", "unsupported syntax: Lambda"),
        ("1 if 1 else 2", "unsupported syntax: IfExp"),
        ("1 < 2", "unsupported syntax: Compare"),
        ("2 ^ 3", r"use \*\* for powers"),
        ("9**9**9", "exponent 387420489 is too large"),
        ("2 ** 100000", "exponent 100000 is too large"),
        ("99 ** 999", "the power is too large"),
        ("(10 ** 300) * (10 ** 300)", "too large"),
        ("1e308 * 10", "too large"),
        ("10.0 ** 400", "too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "complex"),
        ("1 +", "invalid syntax"),
        ("", "empty"),
        ("1" * 301, "longer than 300"),
        ("(1+" * 40 + "1" + ")" * 40, "nested too deeply"),
        ("-" * 200 + "1", "nested too deeply"),
        ("1\x00", "cannot be parsed|invalid syntax"),
    ],
)
def test_calculator_rejects_quickly(expression: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(CalculatorError, match=message):
        evaluate(expression)
    assert time.perf_counter() - start < 0.1  # refused before computing, not after


def test_calculator_rejects_non_strings() -> None:
    with pytest.raises(CalculatorError, match="must be a string"):
        evaluate(5)  # type: ignore[arg-type]


def test_calculator_env_flow_and_ids_match_the_assistant_message() -> None:
    env = make_env("calculator")
    assert env.tools is not None and env.tools[0]["function"]["name"] == "calculator"
    turns = [
        response("", call("calculator", {"expression": "37 * 12"}), call("calculator", {"expression": "1/0"})),
        response("444"),
    ]
    state, trajectory, results = asyncio.run(rollout(env, task(), turns))
    first = results[0]
    assert not first.done and [m["role"] for m in first.new_messages] == ["tool", "tool"]
    assert [m["content"] for m in first.new_messages] == ["444", "Error: division by zero"]
    assistant = trajectory[1]
    assert [c["id"] for c in assistant["tool_calls"]] == [m["tool_call_id"] for m in first.new_messages]
    assert results[1].done and results[1].info["reason"] == "answered"
    score = env.score(state, trajectory)
    assert score.reward == 1.0 and score.components == {"correct": 1.0, "format": 1.0}


def test_calculator_env_stops_after_max_tool_turns() -> None:
    env = make_env("calculator", max_tool_turns=2)
    turn = response("", call("calculator", {"expression": "1+1"}))
    state, trajectory, results = asyncio.run(rollout(env, task(), [turn, turn, turn]))
    assert [r.done for r in results] == [False, True]
    assert results[-1].info["reason"] == "max_tool_turns"
    assert env.score(state, trajectory).reward == 0.0
    with pytest.raises(EnvError, match="finished rollout"):
        asyncio.run(env.step(state, turn))


# -- malformed tool calls ----------------------------------------------------------------------------------

MALFORMED = [
    call(None, None, ToolCallStatus.INVALID_JSON, "Expecting value: line 1 column 2"),
    call(None, None, ToolCallStatus.NOT_AN_OBJECT, "the call is a JSON list"),
    call(None, {"expression": "1"}, ToolCallStatus.MISSING_NAME, "no name"),
    call("calculator", None, ToolCallStatus.INVALID_ARGUMENTS, "arguments is a string"),
    call("search", {"q": "x"}, ToolCallStatus.UNKNOWN_TOOL, "not among the tools"),
    call("calculator", None, ToolCallStatus.UNCLOSED, "no </tool_call>"),
]


def odd_ok_calls(tool: str, arg: str) -> list[ToolCall]:
    """Calls with status ok whose contents are wrong: an unknown name, arguments that are not a dict, bad
    argument values."""
    return [
        call("search", {"q": "x"}),
        call(["not", "a", "name"], {arg: "1"}),  # type: ignore[arg-type]  # a name that is not even a string
        call(tool, json.dumps({arg: "1+1"})),  # double-encoded JSON (verifiers #562)
        call(tool, ["1+1"]),
        call(tool, None),
        call(tool, {}),
        call(tool, {arg: 5}),
        call(tool, {arg: "x" * 100_000}),
    ]


@pytest.mark.parametrize("env_name, arg", [("calculator", "expression"), ("python", "code")])
def test_malformed_tool_calls_get_error_messages_and_never_raise(env_name: str, arg: str) -> None:
    env = make_env(env_name)
    parsed = response("", *MALFORMED, *odd_ok_calls(env_name, arg))
    state = env.reset(task())
    result = asyncio.run(env.step(state, parsed))
    assert not result.done
    messages = result.new_messages
    assert len(messages) == len(parsed.tool_calls)  # one answer per call, none vanishes
    assert all(m["role"] == "tool" and m["content"].startswith("Error:") for m in messages)
    for message, bad in zip(messages, MALFORMED):
        assert bad.status.value in message["content"] and bad.error in message["content"]
        assert "tool_call_id" not in message  # the call is not in the assistant message, so it has no id
    # the ok-status calls carry exactly the ids to_message() gave them
    assistant_ids = [c["id"] for c in parsed.to_message()["tool_calls"]]
    assert [m.get("tool_call_id") for m in messages[len(MALFORMED) :]] == assistant_ids
    assert call_ids(parsed) == [None] * len(MALFORMED) + assistant_ids
    assert "unknown tool 'search'" in messages[len(MALFORMED)]["content"]
    odd = [m["content"] for m in messages[len(MALFORMED) :]]
    assert "unknown tool None" in odd[1] and "name" not in messages[len(MALFORMED) + 1]
    assert "must be a JSON object, got str" in odd[2] and "got list" in odd[3] and "got NoneType" in odd[4]
    assert f"missing required argument {arg!r}" in odd[5] and f"argument {arg!r} must be a string" in odd[6]
    assert "characters long; the limit is" in odd[7]


def test_tool_results_and_errors_bridge_append_only_with_a_real_renderer() -> None:
    """The whole path on Qwen3's renderer: parse a completion with a good call, a call with a Python-style
    boolean (invalid JSON, renderers #47) and broken JSON; every call gets a tool message and the next
    prompt extends the previous one exactly."""
    import tito_renderers as renderers

    from ._support import ours

    renderer = renderers.create_renderer(ours("qwen3-0.6b"))
    env = make_env("calculator")
    t = generate_tasks("calculator", 1, seed=0)[0]
    state = env.reset(t)
    prompt = renderer.render_ids(t.messages, tools=env.tools, add_generation_prompt=True)
    completion = renderer.tokenizer.encode(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*12"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": True}}\n</tool_call>\n'
        "<tool_call>\n{bad json\n</tool_call><|im_end|>"
    )
    parsed = renderer.parse_response(completion, prompt, tools=env.tools)
    assert [c.status.value for c in parsed.tool_calls] == ["ok", "invalid_json", "invalid_json"]
    result = asyncio.run(env.step(state, parsed))
    assert [m.get("tool_call_id") for m in result.new_messages] == ["call_0", None, None]
    assert result.new_messages[0]["content"] == "444"
    assert all("status invalid_json" in m["content"] for m in result.new_messages[1:])
    bridged = renderer.bridge(prompt, completion, result.new_messages, tools=env.tools)
    assert isinstance(bridged, renderers.Bridged), bridged
    assert bridged.token_ids[: bridged.prefix_len] == prompt + completion


# -- arithmetic and scoring ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, answer, correct, fmt",
    [
        ("444", "444", 1.0, 1.0),
        (" 444.\n", "444", 1.0, 1.0),
        ("The answer is 444.", "444", 1.0, 0.0),
        ("37 * 12 = 444", "444", 1.0, 0.0),
        ("444.0", "444", 1.0, 1.0),
        ("1,234", "1234", 1.0, 1.0),
        ("It is -8", "-8", 1.0, 0.0),
        ("−8", "-8", 1.0, 1.0),  # a unicode minus
        ("10-3", "3", 1.0, 0.0),  # a binary minus is not a sign
        ("I think 443 or 444", "444", 1.0, 0.0),  # the last number counts
        ("444 is wrong; it is 443", "444", 0.0, 0.0),
        ("0.5", "1/2", 1.0, 1.0),  # compared exactly, as fractions
        ("0.30000000000000004", "0.3", 0.0, 1.0),
        ("Qwen3", "3", 0.0, 0.0),  # a digit glued to a word is not a number
        ("", "444", 0.0, 0.0),
        ("no idea", "444", 0.0, 0.0),
        ("444", "not a number", 0.0, 1.0),
        ("9" * 500, "9", 0.0, 1.0),  # absurdly long numbers are not parsed
    ],
)
def test_check_answer(content: str, answer: str, correct: float, fmt: float) -> None:
    assert check_answer(content, answer) == {"correct": correct, "format": fmt}


def test_last_number_ignores_non_strings() -> None:
    assert last_number(None) is None and last_number(444) is None
    assert check_answer(None, "1") == {"correct": 0.0, "format": 0.0}


def test_arithmetic_single_turn_and_score_edges() -> None:
    env = make_env("arithmetic", format_weight=0.5)
    assert env.tools is None
    state, trajectory, results = asyncio.run(rollout(env, task(), [response("So 37 * 12 = 444")]))
    assert results[0].done and results[0].new_messages == []
    assert env.score(state, trajectory).reward == 1.0
    state, trajectory, _ = asyncio.run(rollout(env, task(), [response("444", call("calculator", {}))]))
    assert env.score(state, trajectory).reward == 1.5
    # a trajectory without an assistant message, or with null content, scores 0 instead of raising
    assert env.score(env.reset(task()), [{"role": "user", "content": "q"}]).reward == 0.0
    assert env.score(env.reset(task()), [{"role": "assistant", "content": None}]).reward == 0.0
    with pytest.raises(EnvError, match="needs tasks with an answer"):
        env.reset(task(answer=None))


def test_try_again_flow_over_several_turns() -> None:
    env = make_env("try_again", max_attempts=4, discount=0.5)
    t = task(answer="5", prompt="What is 2 + 3?")
    turns = [response("4"), response("It is 6"), response("5"), response("never reached")]
    state, trajectory, results = asyncio.run(rollout(env, t, turns))
    assert [r.done for r in results] == [False, False, True]
    assert [m["role"] for m in trajectory] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert trajectory[2]["content"] == "That is not correct. Try again."
    score = env.score(state, trajectory)
    assert score.reward == 0.25
    assert score.components == {"correct": 1.0, "attempts": 3.0, "first_try": 0.0, "format": 1.0}

    state, trajectory, results = asyncio.run(rollout(env, t, [response("5")]))
    assert results[0].done and env.score(state, trajectory).reward == 1.0

    env2 = make_env("try_again", max_attempts=2, feedback="Nope.")
    state, trajectory, results = asyncio.run(rollout(env2, t, [response("1"), response("2"), response("5")]))
    assert [r.done for r in results] == [False, True] and trajectory[2]["content"] == "Nope."
    assert env2.score(state, trajectory).components["correct"] == 0.0


def test_concurrent_rollouts_share_an_env_without_sharing_state() -> None:
    env = make_env("try_again", max_attempts=3)

    async def both():
        a, b = env.reset(task("1")), env.reset(task("2"))
        ra = await env.step(a, response("0"))
        rb = await env.step(b, response("2"))
        ra2 = await env.step(a, response("1"))
        return a, b, ra, rb, ra2

    a, b, ra, rb, ra2 = asyncio.run(both())
    assert (ra.done, rb.done, ra2.done) == (False, True, True)
    assert (a.turns, b.turns) == (2, 1)


# -- python env (the sandbox itself: tests/test_sandbox.py) ------------------------------------------------


def test_python_env_flow() -> None:
    env = make_env("python", timeout_s=5)
    turns = [response("", call("python", {"code": "print(37 * 12)"})), response("444")]
    state, trajectory, results = asyncio.run(rollout(env, task(), turns))
    tool = results[0].new_messages[0]
    assert tool["tool_call_id"] == "call_0" and tool["name"] == "python"
    assert tool["content"] == "exit code 0\nstdout:\n444\n"
    assert results[1].done and env.score(state, trajectory).reward == 1.0
    assert state.data["runs"][0]["exit_code"] == 0
    too_long = asyncio.run(make_env("python", max_code_chars=10).step(env.reset(task()), turns[0]))
    assert "is 14 characters long; the limit is 10" in too_long.new_messages[0]["content"]


# -- registry ----------------------------------------------------------------------------------------------


def test_make_env_errors_name_the_problem() -> None:
    assert set(ENVIRONMENTS) == {"arithmetic", "try_again", "calculator", "python", "reasoning_gym", "verifiers"}
    with pytest.raises(EnvError, match=r"unknown environment 'nope' \(known: arithmetic, calculator"):
        make_env("nope")
    with pytest.raises(EnvError, match=r"unknown option\(s\) 'timeout' \(options: cpu_s"):
        make_env("python", timeout="3")
    with pytest.raises(EnvError, match=r"option 'max_attempts': Input should be greater than or equal to 1"):
        make_env("try_again", max_attempts=0)
    with pytest.raises(EnvError, match=r"option 'network'"):
        make_env("python", network="sometimes")
    assert env_options("arithmetic")["difficulty"]["default"] == 2


# -- tasks ---------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_jsonl_both_schemas(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": 4, "split": "train"},
            "",  # blank lines are skipped
            {"messages": messages, "answer": "4", "task_id": 7, "metadata": {"level": 1}},
            {"messages": json.dumps(messages)},
        ],
    )
    tasks = load_tasks(path).tasks
    assert [t.answer for t in tasks] == ["4", "4", None]
    assert tasks[0].messages == [{"role": "user", "content": "What is 2+2?"}]
    assert tasks[0].metadata == {"split": "train", "source": str(path)}
    assert tasks[1].task_id == "7" and tasks[1].metadata["level"] == 1 and tasks[1].messages == messages
    assert tasks[2].messages == messages
    # derived ids are content hashes: stable across loads and independent of the row's position
    assert re.fullmatch(r"[0-9a-f]{16}", tasks[0].task_id)
    reordered = load_tasks(write_jsonl(tmp_path / "b.jsonl", [{"answer": 4, "prompt": "What is 2+2?"}])).tasks
    assert reordered[0].task_id == tasks[0].task_id


def test_load_parquet_both_schemas(tmp_path: Path) -> None:
    prompts = pa.table({"prompt": ["What is 1+1?", "What is 2+2?"], "answer": ["2", None], "source_id": [10, 11]})
    pq.write_table(prompts, tmp_path / "p.parquet")
    tasks = load_tasks(tmp_path / "p.parquet").tasks
    assert [(t.messages[0]["content"], t.answer, t.metadata["source_id"]) for t in tasks] == [
        ("What is 1+1?", "2", 10),
        ("What is 2+2?", None, 11),
    ]
    # a list of message structs: Parquet gives every message every field, absent ones as null
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
        [{"role": "user", "content": "2+2?", "name": "bob"}],
    ]
    pq.write_table(pa.table({"messages": conversations, "answer": ["2", "4"]}), tmp_path / "m.parquet")
    tasks = load_tasks(tmp_path / "m.parquet").tasks
    assert [t.messages for t in tasks] == conversations
    pq.write_table(pa.table({"messages": [json.dumps(c) for c in conversations]}), tmp_path / "s.parquet")
    assert [t.messages for t in load_tasks(tmp_path / "s.parquet").tasks] == conversations


@pytest.mark.parametrize(
    "row, where",
    [
        ('{"prompt": "a"', r": invalid JSON"),
        ([1, 2], r": must be a JSON object"),
        ({"question": "a"}, r": needs 'messages' or 'prompt' \(keys: question\)"),
        ({"prompt": ""}, r", column 'prompt': must be a non-empty string"),
        ({"prompt": "a", "messages": []}, r": has both"),
        ({"messages": "not json"}, r", column 'messages': a string that is not JSON"),
        ({"messages": {"role": "user"}}, r", column 'messages': must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "a"}]}, r", column 'messages': message 0: unknown role 'robot'"),
        (
            {"messages": [{"role": "user", "content": "a", "x": 1}]},
            r", column 'messages': message 0: unknown field\(s\) \['x'\]",
        ),
        ({"prompt": "a", "answer": True}, r", column 'answer': must be a string or a number, got a boolean"),
        ({"prompt": "a", "answer": [1]}, r", column 'answer'"),
        ({"prompt": "a", "task_id": 1.5}, r", column 'task_id'"),
        ({"prompt": "a", "metadata": 3}, r", column 'metadata': must be an object"),
    ],
)
def test_bad_jsonl_rows_are_named_precisely(tmp_path: Path, row: Any, where: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine", "answer": "1"}, row, {"prompt": "also fine"}])
    with pytest.raises(TaskFileError, match=re.escape(f"{path}, row 1 (line 2)") + where):
        load_tasks(path)
    loaded = load_tasks(path, skip_bad_rows=True)
    assert (len(loaded), loaded.skipped) == (2, 1) and str(path) in loaded.errors[0]


def test_bad_parquet_files_and_rows(tmp_path: Path) -> None:
    pq.write_table(pa.table({"prompt": ["ok", "", "ok too"]}), tmp_path / "rows.parquet")
    with pytest.raises(TaskFileError, match=r"rows.parquet, row 1, column 'prompt': must be a non-empty string"):
        load_tasks(tmp_path / "rows.parquet")
    assert load_tasks(tmp_path / "rows.parquet", skip_bad_rows=True).skipped == 1
    pq.write_table(pa.table({"question": ["a"]}), tmp_path / "cols.parquet")
    with pytest.raises(TaskFileError, match=r"needs a 'messages' or a 'prompt' column \(columns: question\)"):
        load_tasks(tmp_path / "cols.parquet")
    pq.write_table(pa.table({"prompt": ["a"], "messages": ["[]"]}), tmp_path / "both.parquet")
    with pytest.raises(TaskFileError, match="both a 'messages' and a 'prompt' column"):
        load_tasks(tmp_path / "both.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(TaskFileError, match="not a readable Parquet file"):
        load_tasks(tmp_path / "junk.parquet")
    (tmp_path / "tasks.csv").write_text("prompt\na\n")
    with pytest.raises(TaskFileError, match="cannot tell the format"):
        load_tasks(tmp_path / "tasks.csv")
    with pytest.raises(TaskFileError, match="no such task file"):
        load_tasks(tmp_path / "missing.jsonl")


# -- generators ----------------------------------------------------------------------------------------------


def test_generators_are_deterministic_and_correct() -> None:
    # reasoning-gym's tasks: tests/test_env_plugins.py; a verifiers taskset's: tests/test_env_verifiers.py
    for name in sorted(set(ENVIRONMENTS) - {"reasoning_gym", "verifiers"}):
        first = generate_tasks(name, 20, seed=3)
        assert first == generate_tasks(name, 20, seed=3)
        assert first != generate_tasks(name, 20, seed=4)
        assert len({t.task_id for t in first}) == 20 and all(t.answer is not None for t in first)
        for t in first:
            env = make_env(name)
            state = env.reset(t)  # every generated task is runnable by its env
            assert env.score(state, [*t.messages, {"role": "assistant", "content": t.answer}]).reward == 1.0
    # pinned: a change here changes every run's tasks (and breaks comparisons across versions)
    pinned = generate_tasks("arithmetic", 2, seed=0)
    assert [(t.task_id, t.messages[0]["content"], t.answer) for t in pinned] == [
        ("arithmetic/0/0", "What is 82 - 45? Answer with just the number.", "37"),
        ("arithmetic/0/1", "What is 31 * 41? Answer with just the number.", "1271"),
    ]
    # the answers are the expressions' values (the calculator divides in floats: compare with a tolerance)
    for difficulty in range(1, 7):
        for t in generate_tasks("arithmetic", 30, seed=1, difficulty=difficulty):
            expression = t.messages[0]["content"].removeprefix("What is ").split("?")[0]
            assert Fraction(t.answer).denominator == 1
            assert abs(evaluate(expression) - int(t.answer)) <= 1e-9 * max(1, abs(int(t.answer)))
    with pytest.raises(EnvError, match="n must be >= 0"):
        generate_tasks("arithmetic", -1)
    with pytest.raises(EnvError, match="unknown option"):
        generate_tasks("arithmetic", 1, levels=3)


# -- an environment that writes its own prompt (the verifiers adapter's reset) --------------------------------


class _PromptEnv(Environment):
    name = "prompt_writer"

    def __init__(self, prompt: Any, returns_state: bool = True) -> None:
        super().__init__()
        self.prompt, self.returns_state = prompt, returns_state

    async def reset(self, task: Task) -> RolloutState:
        if not self.returns_state:
            return {"task": task}  # type: ignore[return-value]
        state = RolloutState(task=task)
        state.prompt = self.prompt
        state.tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        return state

    async def step(self, state, parsed):
        return StepResult(new_messages=[], done=True)

    def score(self, state, trajectory):
        return Score(reward=0.0)

    def generate_tasks(self, n, seed):
        return []


def test_the_guard_checks_a_prompt_an_environment_writes_in_reset() -> None:
    from rollout.envs.guard import EnvFault, GuardedEnv

    task = Task(task_id="t", messages=[{"role": "user", "content": "from the task"}])

    def reset(env):
        return asyncio.run(GuardedEnv(env, name=env.name, timeout_s=5, max_message_chars=100).reset(task))

    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "from the env"}]
    state = reset(_PromptEnv(prompt))
    assert state.prompt == prompt and state.tools[0]["function"]["name"] == "f"
    with pytest.raises(EnvFault, match=r"reset\(\) set a malformed prompt: prompt\[1\] has role 'robot'"):
        reset(_PromptEnv([prompt[0], {"role": "robot", "content": "x"}]))
    with pytest.raises(EnvFault, match=r"prompt hold more than env.max_message_chars 100"):
        reset(_PromptEnv([{"role": "user", "content": "x" * 101}]))
    with pytest.raises(EnvFault, match=r"reset\(\) returned dict, not a RolloutState"):
        reset(_PromptEnv(prompt, returns_state=False))
