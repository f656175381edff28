"""parse_response scans token ids. Completions are built with transformers' tokenizer (the
reference), so the special ids in them are the ones a model would sample."""

from __future__ import annotations

import pytest

import tito_renderers as renderers
from tito_renderers import ToolCallStatus

from ._support import ours, reference

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def qwen3():
    return renderers.create_renderer(ours("qwen3-0.6b"))


def ids(text: str) -> list[int]:
    return reference("qwen3-0.6b")(text, add_special_tokens=False)["input_ids"]


def test_reasoning_content_and_tool_calls(qwen3):
    completion = ids(
        "<think>\nI need the tool.\n</think>\n\nLet me compute.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expr": "6*7", "exact": true, "n": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": "{\\"expr\\": \\"1+1\\"}"}\n</tool_call><|im_end|>'
    )
    parsed = qwen3.parse_response(completion, tools=TOOLS)
    assert parsed.reasoning_content == "I need the tool."
    assert parsed.reasoning_complete is True
    assert parsed.content == "Let me compute."
    assert parsed.stop_token_id == qwen3.tokenizer.token_id("<|im_end|>")
    first, second = parsed.tool_calls
    assert (first.name, first.arguments, first.status) == ("calculator", {"expr": "6*7", "exact": True, "n": 3}, ToolCallStatus.OK)
    assert completion[first.token_span[0]] == qwen3.tokenizer.token_id("<tool_call>")
    assert completion[first.token_span[1] - 1] == qwen3.tokenizer.token_id("</tool_call>")
    # double-encoded arguments (a real failure mode of models) are decoded once
    assert second.arguments == {"expr": "1+1"} and second.status is ToolCallStatus.OK
    message = parsed.to_message()
    assert message["tool_calls"][0]["function"]["name"] == "calculator"


@pytest.mark.parametrize(
    "body,status",
    [
        ('{"name": "calculator", "arguments": {"expr": True}}', ToolCallStatus.INVALID_JSON),
        ('["calculator"]', ToolCallStatus.NOT_AN_OBJECT),
        ('{"arguments": {}}', ToolCallStatus.MISSING_NAME),
        ('{"name": "calculator", "arguments": [1, 2]}', ToolCallStatus.INVALID_ARGUMENTS),
        ('{"name": "rm_rf", "arguments": {}}', ToolCallStatus.UNKNOWN_TOOL),
    ],
)
def test_tool_call_statuses(qwen3, body, status):
    parsed = qwen3.parse_response(ids(f"<tool_call>\n{body}\n</tool_call><|im_end|>"), tools=TOOLS)
    (call,) = parsed.tool_calls
    assert call.status is status
    assert call.raw.strip() == body
    assert call.error
    assert "tool_calls" not in parsed.to_message()  # only ok calls reach the environment as calls


def test_unclosed_call_and_truncated_reasoning(qwen3):
    parsed = qwen3.parse_response(ids('<tool_call>\n{"name": "calculator", "argu'))
    assert parsed.tool_calls[0].status is ToolCallStatus.UNCLOSED
    assert parsed.stop_token_id is None
    parsed = qwen3.parse_response(ids("<think>\nstill thinking about"))
    assert parsed.reasoning_complete is False
    assert parsed.reasoning_content == "still thinking about"
    assert parsed.content == ""


def test_prompt_decides_the_starting_state(qwen3):
    tok = qwen3.tokenizer
    off = renderers.create_renderer(tok, enable_thinking=False)
    prompt = off.render_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    parsed = off.parse_response(ids("Hello!<|im_end|>"), prompt)
    assert parsed.reasoning_content is None and parsed.content == "Hello!"
    # a prompt that ends inside an open think block: the completion starts as reasoning
    opened = prompt[:-4] + [tok.token_id("<think>")] + tok.encode_plain("\n")
    parsed = off.parse_response(ids("plan\n</think>\n\nHello!<|im_end|>"), opened)
    assert parsed.reasoning_content == "plan" and parsed.content == "Hello!" and parsed.reasoning_complete


def test_close_without_open_means_what_came_before_was_reasoning(qwen3):
    parsed = qwen3.parse_response(ids("quiet thought\n</think>\n\nAnswer<|im_end|>"))
    assert parsed.reasoning_content == "quiet thought"
    assert parsed.content == "Answer"


def test_marker_text_is_not_a_marker(qwen3):
    """A completion whose tokens spell '<tool_call>' as ordinary text is content, not a call."""
    tok = qwen3.tokenizer
    completion = tok.encode_plain('<tool_call>{"name": "calculator"}</tool_call>') + [tok.token_id("<|im_end|>")]
    parsed = qwen3.parse_response(completion, tools=TOOLS)
    assert parsed.tool_calls == []
    assert parsed.content == '<tool_call>{"name": "calculator"}</tool_call>'


def test_tokens_after_the_stop_are_ignored(qwen3):
    parsed = qwen3.parse_response(ids("done<|im_end|>garbage"))
    assert parsed.content == "done"


@pytest.mark.parametrize("fixture", ["qwen2.5-7b-instruct", "deepseek-r1-distill-qwen-32b", "smollm2"])
def test_other_families(fixture):
    tok = ours(fixture)
    r = renderers.create_renderer(tok)
    hf = reference(fixture)
    if fixture == "deepseek-r1-distill-qwen-32b":
        parsed = r.parse_response(hf("<think>\nsum\n</think>\n\n4<｜end▁of▁sentence｜>", add_special_tokens=False)["input_ids"])
        assert (parsed.reasoning_content, parsed.content, parsed.reasoning_complete) == ("sum", "4", True)
        assert parsed.stop_token_id == tok.token_id("<｜end▁of▁sentence｜>")
    elif fixture == "qwen2.5-7b-instruct":
        text = 'ok\n<tool_call>\n{"name": "calculator", "arguments": {"expr": "2"}}\n</tool_call><|im_end|>'
        parsed = r.parse_response(hf(text, add_special_tokens=False)["input_ids"], tools=TOOLS)
        assert parsed.content == "ok" and parsed.tool_calls[0].status is ToolCallStatus.OK
        assert parsed.reasoning_content is None
    else:
        parsed = r.parse_response(hf("Blue <think> x<|im_end|>", add_special_tokens=False)["input_ids"])
        assert parsed.content == "Blue <think> x" and parsed.tool_calls == []
        assert parsed.stop_token_id == 2


def test_to_message_gives_arguments_as_the_template_wants_them(qwen3):
    completion = ids('<tool_call>\n{"name": "calculator", "arguments": {"expr": "6*7"}}\n</tool_call><|im_end|>')
    parsed = qwen3.parse_response(completion, tools=TOOLS)
    wire = parsed.to_message()["tool_calls"][0]["function"]["arguments"]
    assert wire == '{"expr": "6*7"}'  # OpenAI's wire form: a JSON string
    assert parsed.to_message(arguments="object")["tool_calls"][0]["function"]["arguments"] == {"expr": "6*7"}
    assert qwen3.history_arguments == "object"
    assert renderers.RENDERERS["deepseek-r1-distill"].history_arguments == "json"  # that template concatenates
    with pytest.raises(ValueError, match="'json' or 'object'"):
        parsed.to_message(arguments="yaml")
