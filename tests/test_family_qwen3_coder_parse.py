"""Qwen3-Coder parse_response on what a model samples (completions encoded by the reference tokenizer):
XML tool calls, schema coercion, every status of a malformed call, reasoning and marker text."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tito_renderers as renderers
from tito_renderers import ToolCallStatus
from tito_renderers.dialects.xml_calls import coerce_arguments, function_schemas, parse_xml_call, type_call
from tito_renderers.qwen3_coder import Qwen3CoderRenderer

from ._support import ours
from .test_family_qwen3_coder import CODER_TOOLS, FAMILY, TOK, _typed, ids


@pytest.fixture(scope="module")
def coder() -> Qwen3CoderRenderer:
    return renderers.create_renderer(ours(TOK))


def call_text(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_parse_typed_calls(coder) -> None:
    text = (
        "I'll configure it.\n\n"
        + call_text(
            "configure",
            {
                "path": "\nsrc/x.py\n",
                "retries": "5",
                "ratio": "2",
                "force": "true",
                "options": '{"k": "v"}',
                "targets": '["a", 1]',
                "nothing": "null",
                "label": "None",
                "size": "big",
                "mode": "fast",
                "extra": "7",
            },
        )
        + "\n"
        + call_text("write_file", {"path": "a", "content": "line\n</parameter> in text\n"})
        + "<|im_end|>"
    )
    completion = ids(text)
    parsed = coder.parse_response(completion, tools=CODER_TOOLS)
    assert parsed.content == "I'll configure it."
    assert parsed.stop_token_id == 151645 and parsed.reasoning_content is None
    first, second = parsed.tool_calls
    assert first.status is ToolCallStatus.OK, first.error
    assert _typed(first.arguments) == _typed(
        {
            "path": "\nsrc/x.py\n",
            "retries": 5,
            "ratio": 2,
            "force": True,
            "options": {"k": "v"},
            "targets": ["a", 1],
            "nothing": None,
            "label": None,
            "size": "big",
            "mode": "fast",
            "extra": "7",  # not in the schema: kept verbatim
        }
    )
    assert second.status is ToolCallStatus.OK and second.arguments == {
        "path": "a",
        "content": "line\n</parameter> in text\n",
    }
    assert completion[first.token_span[0]] == 151657 and completion[first.token_span[1] - 1] == 151658
    message = parsed.to_message()
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["force"] is True


def test_parse_without_tools_keeps_strings(coder) -> None:
    parsed = coder.parse_response(ids(call_text("configure", {"retries": "5", "force": "True"}) + "<|im_end|>"))
    (call,) = parsed.tool_calls
    assert call.status is ToolCallStatus.OK and call.arguments == {"retries": "5", "force": "True"}


@pytest.mark.parametrize(
    "body,status,error",
    [
        ("\n<function=>\n</function>\n", ToolCallStatus.MISSING_NAME, "malformed function tag"),
        ('\n{"name": "configure", "arguments": {}}\n', ToolCallStatus.MISSING_NAME, "expected <function=NAME>"),
        (
            "\n<function=configure\n<parameter=path>\nx\n</parameter>\n</function>\n",
            ToolCallStatus.MISSING_NAME,
            "malformed",
        ),
        (
            "\n<function=configure>\n<parameter=path>\nx\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "'path' of 'configure' is not closed",
        ),
        (
            "\n<function=configure>\n<parameter=path>\nx\n</parameter>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "not closed with </function>",
        ),
        (
            "\n<function=configure>\nstray\n<parameter=path>\nx\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "unexpected text",
        ),
        (
            "\n<function=configure>\n<parameter=>\nx\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "malformed parameter tag",
        ),
        (
            "\n<function=configure>\n<parameter=path>\nx\n</parameter>\n<parameter=path>\ny\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "given twice",
        ),
        ("\n<function=configure>\n</function>\ntrailing\n", ToolCallStatus.INVALID_ARGUMENTS, "text after </function>"),
        (
            "\n<function=configure>\n<parameter=retries>\nfive\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "'retries' of 'configure' must be integer",
        ),
        (
            "\n<function=configure>\n<parameter=retries>\n2.5\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "must be integer",
        ),
        (
            "\n<function=configure>\n<parameter=ratio>\ntrue\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "'ratio' of 'configure' must be number",
        ),
        (
            "\n<function=configure>\n<parameter=force>\nyes\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "must be boolean",
        ),
        (
            "\n<function=configure>\n<parameter=options>\n[1]\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "must be object",
        ),
        (
            "\n<function=configure>\n<parameter=targets>\n{'a': 1}\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "must be array",
        ),
        (
            "\n<function=configure>\n<parameter=nothing>\n0\n</parameter>\n</function>\n",
            ToolCallStatus.INVALID_ARGUMENTS,
            "must be null",
        ),
        (
            "\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n",
            ToolCallStatus.UNKNOWN_TOOL,
            "no tool named 'rm_rf'",
        ),
    ],
)
def test_malformed_call_statuses(coder, body, status, error) -> None:
    parsed = coder.parse_response(ids(f"text<tool_call>{body}</tool_call><|im_end|>"), tools=CODER_TOOLS)
    (call,) = parsed.tool_calls
    assert call.status is status
    assert error in call.error
    assert call.raw == body and parsed.content == "text"
    if status is ToolCallStatus.UNKNOWN_TOOL:
        assert call.arguments == {"path": "/"} and call.name == "rm_rf"
    else:
        assert call.arguments is None
    assert "tool_calls" not in parsed.to_message()


def test_unclosed_call_keeps_completed_parameters(coder) -> None:
    parsed = coder.parse_response(
        ids("<tool_call>\n<function=configure>\n<parameter=path>\nsrc\n</parameter>\n<parameter=retries>\n1"),
        tools=CODER_TOOLS,
    )
    (call,) = parsed.tool_calls
    assert call.status is ToolCallStatus.UNCLOSED and call.name == "configure"
    assert call.arguments == {"path": "src"} and parsed.stop_token_id is None
    parsed = coder.parse_response(ids("<tool_call>\n<function=conf"))
    assert parsed.tool_calls[0].status is ToolCallStatus.UNCLOSED and parsed.tool_calls[0].name is None


def test_parse_reasoning_and_marker_text(coder) -> None:
    parsed = coder.parse_response(ids("<think>\nplan\n</think>\n\nanswer<|im_end|>"))
    assert (parsed.reasoning_content, parsed.content, parsed.reasoning_complete) == ("plan", "answer", True)
    tok = coder.tokenizer  # text that spells the markers is content
    parsed = coder.parse_response(
        tok.encode_plain("<tool_call>\n<function=ping>\n</function>\n</tool_call>") + [151645]
    )
    assert parsed.tool_calls == [] and parsed.content.startswith("<tool_call>")
    parsed = coder.parse_response(ids("done<|endoftext|>" + call_text("ping", {})))
    assert parsed.content == "done" and parsed.tool_calls == [] and parsed.stop_token_id == 151643


def test_parse_xml_call_whitespace_rules() -> None:
    call = parse_xml_call("<function=f><parameter=a>x</parameter><parameter=b>\n\ny\n\n</parameter></function>", (0, 1))
    assert call.status is ToolCallStatus.OK and call.arguments == {"a": "x", "b": "\ny\n"}
    args, error = coerce_arguments(
        {"n": " 3 ", "u": "None", "v": "nan"},
        {"properties": {"n": {"type": "integer"}, "u": {"type": ["integer", "null"]}, "v": {"type": "number"}}},
        "f",
    )
    assert error is None and args["n"] == 3 and args["u"] is None and math.isnan(args["v"])
    # garbage a model can write never raises: nesting deeper than the JSON parser, digits past int()'s limit
    deep = {"type": "array"}
    assert (
        coerce_arguments({"a": "[" * 100_000}, {"properties": {"a": deep}}, "f")[1]
        == "parameter 'a' of 'f' must be array, got '" + "[" * 40 + "...'"
    )
    assert "must be integer" in coerce_arguments({"a": "9" * 5000}, {"properties": {"a": {"type": "integer"}}}, "f")[1]
    # a union with string keeps text that fits none of the other types; an unknown type keeps the text
    assert coerce_arguments(
        {"s": "big", "t": "x"},
        {"properties": {"s": {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "t": {"type": "file"}}},
        "f",
    ) == ({"s": "big", "t": "x"}, None)


def test_template_rejections_and_bad_input() -> None:
    r = FAMILY.renderer()
    with pytest.raises(renderers.TemplateRejected, match="message 1"):
        r.render([{"role": "user", "content": "q"}, {"role": "assistant"}])
    with pytest.raises(renderers.TemplateRejected, match="not a JSON object"):
        r.render(
            [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "[1]"}]}]
        )
    with pytest.raises(renderers.MessageError, match="tools"):
        r.parse_response(ids("x<|im_end|>"), tools="configure")


FRAGMENTS = (
    "<function=",
    "configure",
    ">",
    "\n",
    "<parameter=",
    "retries",
    "force",
    "options",
    "</parameter>",
    "</function>",
    "true",
    "None",
    "1e400",
    "[" * 3000,
    "{",
    "}",
    "x",
    " ",
    "<",
    "inf",
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5), max_size=30))
def test_xml_parser_never_raises(parts: list[str]) -> None:
    raw = "".join(parts)
    call = type_call(parse_xml_call(raw, (0, 2)), function_schemas(CODER_TOOLS))
    assert isinstance(call.status, ToolCallStatus) and (call.status is ToolCallStatus.OK) == (call.error is None)
    assert call.raw == raw
