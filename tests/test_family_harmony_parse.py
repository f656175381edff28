"""gpt-oss (Harmony): parse_response on completions as gpt-oss samples them (built with the
reference tokenizer), and the bridge's Harmony specifics against the reference: <|return|> vs
<|end|>, the analysis the template drops, tool results named after the call, truncated closes."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import tito_renderers as renderers
from tito_renderers import Break, BreakReason, Bridged, ToolCallStatus
from tito_renderers.harmony import HarmonyRenderer

from .test_family_harmony import CALL, EDGE_CASES, FAMILY, SCHEMA_TOOLS, Q, _call
from .test_family_harmony import completion_ids as _ids

# ---- parse_response: completions as gpt-oss samples them ---------------------------------------


@pytest.fixture(scope="module")
def harmony() -> HarmonyRenderer:
    r = FAMILY.renderer()
    assert isinstance(r, HarmonyRenderer)
    return r


WEATHER_TOOLS = SCHEMA_TOOLS[:1]


def test_stop_ids(harmony: HarmonyRenderer) -> None:
    tok = harmony.tokenizer
    assert set(harmony.stop_token_ids) == {tok.token_id("<|call|>"), tok.token_id("<|return|>")}
    assert tok.token_id("<|end|>") not in harmony.stop_token_ids
    caps = harmony.capabilities
    assert caps.reasoning_efforts == ("low", "medium", "high") and caps.tools and not caps.thinking_switch


def test_parse_analysis_then_tool_call_model_format(harmony: HarmonyRenderer) -> None:
    completion = _ids(
        "<|channel|>analysis<|message|>User wants weather. Call tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Zürich", "days": 2, "detailed": true}<|call|>'
    )
    prompt = harmony.render_ids([Q], WEATHER_TOOLS, add_generation_prompt=True)
    parsed = harmony.parse_response(completion, prompt, WEATHER_TOOLS)
    assert parsed.reasoning_content == "User wants weather. Call tool."
    assert parsed.reasoning_complete is True
    assert parsed.content == ""
    assert parsed.stop_token_id == harmony.tokenizer.token_id("<|call|>")
    (call,) = parsed.tool_calls
    assert (call.name, call.arguments, call.status) == (
        "get_weather",
        {"city": "Zürich", "days": 2, "detailed": True},
        ToolCallStatus.OK,
    )
    assert completion[call.token_span[0]] == harmony.tokenizer.token_id("<|start|>")
    assert call.token_span[1] == len(completion)
    assert parsed.to_message()["tool_calls"][0]["function"]["name"] == "get_weather"
    # the same without the prompt: the completion is taken to follow the generation prompt
    assert harmony.parse_response(completion, None, WEATHER_TOOLS) == parsed


def test_parse_template_format_and_final(harmony: HarmonyRenderer) -> None:
    call = harmony.parse_response(
        _ids(' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Bern"}<|call|>')
    )
    assert [(c.name, c.arguments, c.status) for c in call.tool_calls] == [
        ("get_weather", {"city": "Bern"}, ToolCallStatus.OK)
    ]
    assert call.tool_calls[0].token_span[0] == 0
    final = harmony.parse_response(
        _ids(
            "<|channel|>analysis<|message|>2+2.<|end|><|start|>assistant<|channel|>final<|message|> Four. <|return|>ignored"
        )
    )
    assert (final.content, final.reasoning_content, final.tool_calls) == ("Four.", "2+2.", [])
    assert final.stop_token_id == harmony.tokenizer.token_id("<|return|>")


def test_parse_commentary_preamble_is_content(harmony: HarmonyRenderer) -> None:
    parsed = harmony.parse_response(
        _ids(
            "<|channel|>commentary<|message|>Let me look that up.<|end|>"
            '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'
        ),
        tools=WEATHER_TOOLS,
    )
    assert parsed.content == "Let me look that up." and parsed.reasoning_content is None
    assert [c.status for c in parsed.tool_calls] == [ToolCallStatus.OK]


@pytest.mark.parametrize(
    "text,status,name",
    [
        (
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Bern}<|call|>',
            ToolCallStatus.INVALID_JSON,
            "get_weather",
        ),
        (
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>[1, 2]<|call|>",
            ToolCallStatus.INVALID_ARGUMENTS,
            "get_weather",
        ),
        (
            '<|channel|>commentary to=functions.<|constrain|>json<|message|>{"a": 1}<|call|>',
            ToolCallStatus.MISSING_NAME,
            None,
        ),
        (
            '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{"path": "/"}<|call|>',
            ToolCallStatus.UNKNOWN_TOOL,
            "rm_rf",
        ),
        (
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Be',
            ToolCallStatus.UNCLOSED,
            "get_weather",
        ),
        ("<|channel|>commentary to=functions.get_weather <|constrain|>", ToolCallStatus.UNCLOSED, "get_weather"),
        (
            '<|channel|>commentary to=functions.get_weather<|message|>{"city": "B"}<|start|>assistant<|channel|>final<|message|>x<|return|>',
            ToolCallStatus.UNCLOSED,
            "get_weather",
        ),
        (
            '<|channel|>commentary to=functions.get_weather json<|message|>"{\\"city\\": \\"Bern\\"}"<|call|>',
            ToolCallStatus.OK,
            "get_weather",
        ),
    ],
)
def test_tool_call_statuses(harmony: HarmonyRenderer, text: str, status: ToolCallStatus, name: str | None) -> None:
    completion = _ids(text)
    parsed = harmony.parse_response(completion, tools=WEATHER_TOOLS)
    call = parsed.tool_calls[0]
    assert (call.status, call.name) == (status, name)
    assert (call.error is None) == (status is ToolCallStatus.OK)
    assert 0 <= call.token_span[0] < call.token_span[1] <= len(completion)
    if status is ToolCallStatus.OK:
        assert call.arguments == {"city": "Bern"}  # double-encoded arguments are decoded once
    assert ("tool_calls" in parsed.to_message()) == (status is ToolCallStatus.OK)


def test_parse_truncated_reasoning_and_markers_as_text(harmony: HarmonyRenderer) -> None:
    cut = harmony.parse_response(_ids("<|channel|>analysis<|message|>Still thinking"))
    assert (cut.reasoning_content, cut.reasoning_complete, cut.content, cut.stop_token_id) == (
        "Still thinking",
        False,
        "",
        None,
    )
    # a final answer that quotes the markers: spelled out as text, they are plain tokens
    text_ids = harmony.tokenizer.encode_plain("quote <|call|> and <|return|>")
    completion = _ids("<|channel|>final<|message|>") + text_ids + _ids("<|return|>")
    parsed = harmony.parse_response(completion)
    assert parsed.content == "quote <|call|> and <|return|>" and parsed.tool_calls == []


def test_parse_prefilled_prompt_and_other_roles(harmony: HarmonyRenderer) -> None:
    prompt = harmony.render_ids([Q], add_generation_prompt=True) + _ids("<|channel|>final<|message|>")
    parsed = harmony.parse_response(_ids("Prefilled answer.<|return|>"), prompt)
    assert parsed.content == "Prefilled answer."
    # the model writing a tool's reply is not part of its answer
    hallucinated = _ids(
        '<|channel|>final<|message|>A<|end|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"x"<|end|>'
    )
    assert harmony.parse_response(hallucinated).content == "A"
    assert harmony.parse_response(hallucinated).tool_calls == []
    builtin = harmony.parse_response(
        _ids('<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"query": "q"}<|call|>')
    )
    assert [(c.name, c.arguments, c.status) for c in builtin.tool_calls] == [
        ("browser.search", {"query": "q"}, ToolCallStatus.OK)
    ]


# ---- bridge ------------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "Be brief."}


def _turn(r: HarmonyRenderer, messages: list[dict], tools: Any, completion_text: str) -> tuple[list[int], list[int]]:
    return r.render_ids(messages, tools, add_generation_prompt=True), _ids(completion_text)


def test_bridge_model_format_tool_call_names_the_result(harmony: HarmonyRenderer) -> None:
    """gpt-oss writes the recipient after the channel; the result is still named after the call, and
    the appended tokens are the reference's render of the tool message and the generation prompt."""
    prompt, completion = _turn(
        harmony,
        [SYSTEM, Q],
        WEATHER_TOOLS,
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>',
    )
    new = [{"role": "tool", "tool_call_id": "c", "name": "some_other_name", "content": "sunny"}]
    result = harmony.bridge(prompt, completion, new, WEATHER_TOOLS)
    assert isinstance(result, Bridged), result
    assert result.token_ids[: result.prefix_len] == prompt + completion and result.synthesized == 0
    full = FAMILY.reference_ids(
        [
            SYSTEM,
            Q,
            {
                "role": "assistant",
                "reasoning_content": "Call it.",
                "tool_calls": [_call("get_weather", {"city": "Zürich"})],
            },
            *new,
        ],
        WEATHER_TOOLS,
        agp=True,
    )
    assert result.appended.token_ids == full[-len(result.appended) :]
    assert harmony.tokenizer.decode(result.appended.token_ids).startswith("<|start|>functions.get_weather to=assistant")
    # the template form of the call in "template" mode would differ: a reasoned Break
    strict = FAMILY.renderer(thinking_retention="template").bridge(prompt, completion, new, WEATHER_TOOLS)
    assert isinstance(strict, Break) and strict.reason is BreakReason.TEMPLATE_REWRITES_HISTORY, strict
    assert strict.position is not None and strict.position >= len(prompt)


def test_bridge_after_final_answer_keep_and_template(harmony: HarmonyRenderer) -> None:
    """keep: the sampled <|return|> and analysis stay, the next user turn is appended exactly as the
    template renders it. template: the template re-renders the answer with <|end|> and no analysis."""
    prompt, completion = _turn(
        harmony,
        [SYSTEM, Q],
        None,
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
    )
    new = [{"role": "user", "content": " And tomorrow?\n"}]
    kept = harmony.bridge(prompt, completion, new)
    assert isinstance(kept, Bridged) and kept.synthesized == 0
    assert harmony.tokenizer.decode(kept.token_ids[-12:]).endswith(
        "Sunny.<|return|><|start|>user<|message|> And tomorrow?\n<|end|><|start|>assistant"
    )
    full = FAMILY.reference_ids(
        [SYSTEM, Q, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."}, *new], agp=True
    )
    assert kept.appended.token_ids == full[-len(kept.appended) :]
    assert full[: len(prompt) + len(completion)] != prompt + completion  # the template rewrote the answer
    strict = FAMILY.renderer(thinking_retention="template").bridge(prompt, completion, new)
    assert isinstance(strict, Break) and strict.reason is BreakReason.TEMPLATE_REWRITES_HISTORY
    assert "<|return|>" in strict.detail


def test_bridge_template_mode_drops_tool_turn_analysis(harmony: HarmonyRenderer) -> None:
    """A final answer cut off (so its synthesized <|end|> is what the template writes) still breaks in
    "template" mode when the prompt holds analysis of a tool-call turn: the template drops it now."""
    strict = FAMILY.renderer(thinking_retention="template")
    msgs = [
        SYSTEM,
        Q,
        {"role": "assistant", "reasoning_content": "Call it.", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
    ]
    prompt = strict.render_ids(msgs, WEATHER_TOOLS, add_generation_prompt=True)
    completion = _ids("<|channel|>final<|message|>Sunny")
    new = [{"role": "user", "content": "thanks"}]
    result = strict.bridge(prompt, completion, new, WEATHER_TOOLS)
    assert isinstance(result, Break) and result.reason is BreakReason.TEMPLATE_REWRITES_HISTORY
    assert "drop the analysis" in result.detail and result.position < len(prompt)
    # without analysis in the prompt the same truncated answer bridges, and equals the reference
    plain = [SYSTEM, Q, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"}]
    prompt = strict.render_ids(plain, WEATHER_TOOLS, add_generation_prompt=True)
    ok = strict.bridge(prompt, completion, new, WEATHER_TOOLS)
    assert isinstance(ok, Bridged) and ok.synthesized == 1, ok
    assert ok.token_ids == FAMILY.reference_ids(
        [*plain, {"role": "assistant", "content": "Sunny"}, *new], WEATHER_TOOLS, agp=True
    )


def test_bridge_truncated_closes(harmony: HarmonyRenderer) -> None:
    tok = harmony.tokenizer
    prompt = harmony.render_ids([Q], WEATHER_TOOLS, add_generation_prompt=True)
    in_call = _ids('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Bern"}')
    result = harmony.bridge(prompt, in_call, [{"role": "tool", "content": "r"}], WEATHER_TOOLS)
    assert isinstance(result, Bridged) and result.synthesized == 1
    assert result.appended.token_ids[0] == tok.token_id("<|call|>")
    in_final = _ids("<|channel|>final<|message|>Half an ans")
    result = harmony.bridge(prompt, in_final, [{"role": "user", "content": "go on"}])
    assert isinstance(result, Bridged) and result.appended.token_ids[0] == tok.token_id("<|end|>")
    closed = _ids("<|channel|>analysis<|message|>hmm<|end|>")  # stopped by max tokens right after a close
    result = harmony.bridge(prompt, closed, [{"role": "user", "content": "go on"}])
    assert isinstance(result, Bridged) and result.synthesized == 0


@pytest.mark.parametrize(
    "completion_text,detail",
    [
        ("<|channel|>final<|message|>Done.<|return|>", "made no tool call"),
        ("<|channel|>analysis to=python<|message|>print(1)<|call|>", "'python', which the template cannot name"),
        ("<|channel|>commentary to=functions.<|constrain|>json<|message|>{}<|call|>", "no function name"),
    ],
)
def test_bridge_tool_result_without_a_name_breaks(harmony: HarmonyRenderer, completion_text: str, detail: str) -> None:
    prompt = harmony.render_ids([Q], WEATHER_TOOLS, add_generation_prompt=True)
    result = harmony.bridge(prompt, _ids(completion_text), [{"role": "tool", "content": "r"}], WEATHER_TOOLS)
    assert isinstance(result, Break) and result.reason is BreakReason.TEMPLATE_ERROR, result
    assert detail in result.detail


def test_bridge_other_breaks(harmony: HarmonyRenderer) -> None:
    prompt, completion = _turn(harmony, [Q], None, "<|channel|>final<|message|>Hi.<|return|>")
    assert (
        harmony.bridge(prompt, completion, [{"role": "assistant", "content": "x"}]).reason
        is BreakReason.ASSISTANT_IN_NEW_MESSAGES
    )
    assert (
        harmony.bridge(prompt, completion, [{"role": "robot", "content": "x"}]).reason is BreakReason.INVALID_MESSAGES
    )
    assert harmony.bridge(prompt, completion, []).reason is BreakReason.INVALID_MESSAGES
    bad = harmony.bridge(prompt, completion, [{"role": "user", "content": "x"}], reasoning_effort="extreme")
    assert bad.reason is BreakReason.INVALID_MESSAGES
    # a later system message renders nothing, as in the template
    sys_only = harmony.bridge(prompt, completion, [{"role": "system", "content": "ignored"}])
    assert isinstance(sys_only, Bridged)
    assert harmony.tokenizer.decode(sys_only.appended.token_ids) == "<|start|>assistant"


def test_build_training_sample_masks_the_model_tokens(harmony: HarmonyRenderer) -> None:
    msgs = [
        SYSTEM,
        Q,
        {"role": "assistant", "reasoning_content": "Call.", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "Done."},
    ]
    sample = renderers.build_training_sample(harmony, msgs, WEATHER_TOOLS)
    assert sample.token_ids == FAMILY.reference_ids(msgs, WEATHER_TOOLS)
    trained = harmony.tokenizer.decode([t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m])
    # the tool-call turn's analysis is dropped by the template (a final answer follows); the last turn keeps its own
    assert trained == (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Zürich", "days": 2}<|call|>'
        "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    )


def test_arguments_as_json_string_are_encoded_again(harmony: HarmonyRenderer) -> None:
    """The template applies tojson to arguments: a JSON string (the OpenAI wire form) is rendered as a
    JSON string literal, unlike a dict. Pass dicts to get what gpt-oss samples."""
    as_string = copy.deepcopy(EDGE_CASES[15][0])
    text = harmony.tokenizer.decode(harmony.render_ids(as_string))
    assert '<|message|>"{\\"city\\": \\"Bern\\"}"<|call|>' in text
