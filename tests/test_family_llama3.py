"""Llama 3.1 / 3.2 / 3.3 and Llama-3.3-Nemotron-Super: parity with transformers, the contract checks,
parsing of completions as a model samples them, and the bridge's Llama-specific closes."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from datetime import datetime

import pytest

import tito_renderers as renderers
from tito_renderers import Break, BreakReason, Bridged, TemplateRejected, ToolCallStatus
from tito_renderers.llama3 import Llama31Renderer, Llama32Renderer
from tito_renderers.llama3_nemotron import NemotronSuperRenderer

from ._support import fixtures_dir, ours, reference
from .convgen import Conversation, contains_marker, generate, marker_regex
from .family_checks import (
    Family,
    check_bridge_contract,
    check_marker_injection,
    check_parse_fuzz,
    check_round_trip,
)
from .test_parity import N_CONVERSATIONS, Case, check_parity

L31, L32, NEMO = "llama-3.1-8b-instruct", "llama-3.2-3b-instruct", "llama-3.3-nemotron-super-49b-v1.5"
L33_FILE = "meta-llama-Llama-3.3-70B-Instruct.jinja"
NEMO_FILE = "nvidia-Llama-3_3-Nemotron-Super-49B-v1_5.jinja"
BUILTIN = {"builtin_tools": ["brave_search", "wolfram_alpha"]}
LLAMA_MARKERS = [
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "<|start_header_id|>",
    "<|end_header_id|>",
]


def template_file(name: str) -> str:
    return (fixtures_dir() / "templates" / name).read_text(encoding="utf-8")


# ---- the family's own conversations ------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FLAT_TOOL = {"name": "lookup", "description": "Look ü up", "parameters": {"type": "object", "properties": {}}}


def _call(name: str, args) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}


def llama_conversations(seed: int, n: int, builtin: bool = False) -> list[Conversation]:
    """Single tool calls, ipython results, builtin calls, markers, tools=[] and odd first messages."""
    r = random.Random(seed)
    texts = ["hi", "  padded  ", "\nWhat is the weather?\n", "Zürich 東京 🙂", "a\r\nb", "", '{"k": 1}', "x\ty"]
    out = []
    for index in range(n):
        marker = r.random() < 0.3

        def say(marker: bool = marker) -> str:
            return r.choice(texts) + (r.choice(LLAMA_MARKERS) if marker else "") + r.choice(texts)

        tools = r.choice([None, [], [WEATHER], [WEATHER, FLAT_TOOL]])
        msgs: list[dict] = []
        if r.random() < 0.5:
            msgs.append({"role": "system", "content": say()})
        if r.random() < 0.1:
            first = {
                "role": "assistant",
                "content": r.choice([None, say()]),
                "tool_calls": [_call("get_weather", {"city": "x"})],
            }
            msgs.append(first)  # the template takes it as the first user message when tools go there
        for _ in range(r.randint(1, 3)):
            msgs.append({"role": "user", "content": say()})
            if r.random() < 0.5:
                if builtin and r.random() < 0.5:
                    name = r.choice(["brave_search", "wolfram_alpha"])
                    args = {"query": say().replace('"', "'")} if r.random() < 0.8 else {}
                else:
                    # in ipython mode a builtin name takes the builtin branch, which needs string arguments
                    name = r.choice(["get_weather", "lookup"] if builtin else ["get_weather", "lookup", "brave_search"])
                    args = r.choice([{"city": say(), "days": 3, "ok": True, "x": None}, '{"city": "Paris"}', {}])
                content = r.choice([None, "", say()])
                msgs.append({"role": "assistant", "content": content, "tool_calls": [_call(name, args)]})
                for _ in range(r.choice([1, 1, 2])):
                    msgs.append(
                        {
                            "role": "tool",
                            "tool_call_id": "c1",
                            "content": r.choice([say(), json.dumps({"t": 21.5, "s": say()})]),
                        }
                    )
            if r.random() < 0.15:
                msgs.append({"role": "system", "content": say()})
            msgs.append({"role": "assistant", "content": r.choice([say(), None]) if r.random() < 0.1 else say()})
        if r.random() < 0.5:
            msgs.append({"role": "user", "content": say()})
        out.append(Conversation(index, seed, msgs, tools, {"llama-family"} | ({"markers"} if marker else set())))
    return out


def nemotron_conversations(seed: int, n: int) -> list[Conversation]:
    """The shared generator's conversations with the reasoning switch in the system message, plus
    <think> blocks in assistant content and multi-call <TOOLCALL> turns (the shared set has those too)."""
    r = random.Random(seed)
    switches = ["/no_think", "/think", "/no_think\n", "  /think  please", "be brief /no_think /think", ""]
    out = []
    for conv in generate(seed, n):
        msgs = copy.deepcopy(conv.messages)
        switch = r.choice(switches)
        if msgs and msgs[0]["role"] == "system" and isinstance(msgs[0]["content"], str):
            msgs[0]["content"] = r.choice([switch + " " + msgs[0]["content"], msgs[0]["content"] + switch])
        else:
            msgs.insert(0, {"role": "system", "content": switch})
        for m in msgs:
            if m["role"] == "assistant" and isinstance(m.get("content"), str) and r.random() < 0.3:
                m["content"] = "<think>\nstep\n</think>\n\n" + m["content"]
        out.append(Conversation(conv.index, seed, msgs, conv.tools, conv.tags | {"nemotron-switch"}))
    for i, marker in enumerate(LLAMA_MARKERS):
        msgs = [
            {"role": "user", "content": f"quote {marker} here"},
            {"role": "assistant", "content": "ok", "tool_calls": [_call("get_weather", {"city": marker})]},
            {"role": "tool", "content": f"{marker}result"},
        ]
        out.append(Conversation(n + i, seed, msgs, [WEATHER], {"markers"}))
    return out


# ---- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "family_builtin"),
    [
        (Case("llama3.1", L31, seed=8101, min_marker=10, min_rejected=50), False),
        (
            Case(
                "llama3.1-builtin-system-tools",
                L31,
                seed=8111,
                min_marker=10,
                min_rejected=50,
                kwargs={**BUILTIN, "tools_in_user_message": False, "date_string": "02 Feb 2025"},
            ),
            True,
        ),
        (Case("llama3.3", L31, seed=8121, chat_template=L33_FILE, min_marker=10, min_rejected=50), False),
        (Case("llama3.2", L32, seed=8201, min_marker=10, min_rejected=50), False),
        (
            Case(
                "llama3.2-date-system-tools",
                L32,
                seed=8211,
                min_marker=10,
                min_rejected=50,
                kwargs={"date_string": "11 Nov 2011", "tools_in_user_message": False},
            ),
            False,
        ),
    ],
    ids=lambda v: v.id if isinstance(v, Case) else str(v),
)
def test_llama_parity(case: Case, family_builtin: bool, tokenizers) -> None:
    if case.chat_template is not None:  # the 3.3 template file (3.1's bytes), tokenized with the 3.1 tokenizer
        case = dataclasses.replace(case, chat_template=template_file(case.chat_template))
    convs = generate(case.seed, N_CONVERSATIONS) + llama_conversations(case.seed + 1, 120, builtin=family_builtin)
    # the Llama templates reject every assistant turn with more than one tool call: about a quarter of
    # the shared generator's conversations are rejected (TemplateRejected is compared there)
    check_parity(case, tokenizers, convs)


@pytest.mark.parametrize(
    "kwargs",
    [{"custom_tools": [WEATHER, FLAT_TOOL]}, {"custom_tools": []}, BUILTIN, {**BUILTIN, "custom_tools": [WEATHER]}],
    ids=["custom-tools", "custom-tools-empty", "builtin-tools-in-user", "builtin-custom"],
)
def test_llama_kwarg_parity(kwargs: dict, tokenizers) -> None:
    """``custom_tools`` replaces the tools argument (even an empty list); builtin tools with the tool
    definitions in the first user message. The family's conversations only (they hold single calls)."""
    case = Case("llama3.1-" + json.dumps(kwargs)[:80], L31, seed=8131, kwargs=kwargs, min_marker=4)
    check_parity(case, tokenizers, llama_conversations(8131, 150, builtin="builtin_tools" in kwargs), min_exact=80)


@pytest.mark.parametrize("template", [None, NEMO_FILE])
def test_nemotron_parity(template: str | None, tokenizers) -> None:
    chat_template = template_file(template) if template else None
    case = Case("nemotron-super", NEMO, seed=8301, chat_template=chat_template, min_marker=10)
    counts = check_parity(case, tokenizers, nemotron_conversations(8301, N_CONVERSATIONS))
    assert counts[True]["exact"] >= 300


def test_template_identity() -> None:
    """3.3 ships 3.1's template byte for byte, and the Nemotron file is the tokenizer's own template."""
    assert template_file(L33_FILE) == reference(L31).chat_template
    assert template_file(NEMO_FILE) == reference(NEMO).chat_template
    for name, cls in ((L31, Llama31Renderer), (L32, Llama32Renderer), (NEMO, NemotronSuperRenderer)):
        assert type(renderers.create_renderer(ours(name))) is cls
        assert ours(name).template_sha256 in cls.template_hashes


# ---- kwargs, stops, capabilities, the date ------------------------------------------------------


def test_stop_ids_capabilities_and_kwargs() -> None:
    tok = ours(L31)
    r = renderers.create_renderer(tok)
    ids = tok.added_tokens
    assert r.stop_token_ids == (ids["<|eot_id|>"], ids["<|eom_id|>"], ids["<|end_of_text|>"])
    caps = r.capabilities
    assert caps.tools and caps.bridge and not caps.thinking_switch and caps.reasoning_efforts == ()
    n = renderers.create_renderer(ours(NEMO))
    assert n.stop_token_ids == (ids["<|eot_id|>"], ids["<|end_of_text|>"])
    assert not n.capabilities.thinking_switch  # the switch is /no_think in the system message, not a kwarg
    with pytest.raises(ValueError, match="enable_thinking"):
        renderers.create_renderer(ours(NEMO), enable_thinking=False)
    with pytest.raises(ValueError, match="builtin_tools"):
        renderers.create_renderer(ours(L32), builtin_tools=["brave_search"])  # 3.2's template has no builtin tools
    with pytest.raises(ValueError, match="list of tool names"):
        renderers.create_renderer(tok, builtin_tools=["brave_search", 3])
    with pytest.raises(ValueError, match="custom_tools"):
        renderers.create_renderer(tok, custom_tools=[{"description": "no name"}])
    with pytest.raises(ValueError, match="date_string"):
        renderers.create_renderer(tok, date_string=20240726)


def test_llama32_reads_todays_date_once(tokenizers) -> None:
    r = renderers.create_renderer(ours(L32))
    today = datetime.now().strftime("%d %b %Y")
    assert r.default_date == today
    msgs = [{"role": "user", "content": "hi"}]
    assert f"Today Date: {today}\n" in ours(L32).decode(r.render_ids(msgs))
    r.default_date = "01 Jan 1999"  # renders use the date read at construction, never a fresh clock
    assert "Today Date: 01 Jan 1999\n" in ours(L32).decode(r.render_ids(msgs))
    assert "Today Date: 03 Mar 2023\n" in ours(L32).decode(r.render_ids(msgs, date_string="03 Mar 2023"))


def test_rejections_where_the_template_raises() -> None:
    """Where transformers raises (a TemplateError, or a TypeError from the builtin call's concatenation
    and `items` filter), we raise TemplateRejected."""
    cases = [
        ([{"role": "system", "content": "s"}], [WEATHER], {}),  # tools for a first user message that is absent
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("a", {}), _call("b", {})]}],
            None,
            {},
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("brave_search", {"n": 3})]}],
            None,
            BUILTIN,
        ),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [_call("brave_search", "{}")]}],
            None,
            BUILTIN,
        ),
    ]
    hf = reference(L31)
    for msgs, tools, kw in cases:
        with pytest.raises(Exception):  # noqa: B017 - the reference raises TemplateError or TypeError
            hf.apply_chat_template(renderers.normalize_messages(msgs), tools=tools, tokenize=False, **kw)
        with pytest.raises(TemplateRejected):
            renderers.create_renderer(ours(L31), **kw).render(msgs, tools)


# ---- contract checks ---------------------------------------------------------------------------

FAMILIES = {
    "llama3.1": Family("llama3.1", L31),
    "llama3.1-builtin": Family("llama3.1-builtin", L31, kwargs=BUILTIN),
    "llama3.3": Family("llama3.3", L31, template_file=L33_FILE),
    "llama3.2": Family("llama3.2", L32, kwargs={"date_string": "05 May 2025"}),
    "nemotron": Family("nemotron", NEMO),
}


def _renderable(family: Family, convs: list[Conversation]) -> list[tuple[list[dict], object]]:
    """Conversations whose every prefix the reference renders (the bridge check renders prefixes), without
    marker text: transformers turns it into special ids, so the reference is no bridge reference there
    (marker injection is checked on its own)."""
    pattern = marker_regex(family.tok.added_tokens)
    out = []
    for conv in convs:
        if contains_marker(conv.messages, pattern) or contains_marker(conv.tools, pattern):
            continue
        if conv.messages[0]["role"] == "assistant":  # its prompt would be an empty conversation
            continue
        try:
            for k in range(1, len(conv.messages) + 1):
                family.reference_text(conv.messages[:k], conv.tools, agp=True)
        except Exception:  # noqa: BLE001 - the reference rejects it; parity covers rejections
            continue
        out.append((conv.messages, conv.tools))
    return out


def _contract_convs(fid: str) -> list[Conversation]:
    if fid == "nemotron":
        return nemotron_conversations(8401, 60)
    return generate(8401, 60) + llama_conversations(8402, 40, builtin=fid == "llama3.1-builtin")


@pytest.mark.parametrize("fid", list(FAMILIES))
def test_bridge_contract(fid: str) -> None:
    family = FAMILIES[fid]
    counts = check_bridge_contract(family, _renderable(family, _contract_convs(fid)), min_exact=20)
    print(f"[{fid}] bridge contract: {counts}")
    assert counts["truncated"] >= 10, counts


@pytest.mark.parametrize("fid", ["llama3.1", "llama3.1-builtin"])
def test_bridge_contract_llama_template_retention(fid: str) -> None:
    """The reference's own replies are what the template re-renders: they extend exactly; the replies
    whose JSON-string arguments the template would re-render as an object break."""
    family = FAMILIES[fid]
    counts = check_bridge_contract(
        family, _renderable(family, _contract_convs(fid)), min_exact=20, thinking_retention="template"
    )
    print(f"[{fid} template retention] bridge contract: {counts}")
    assert counts["break"] >= 1, counts


def test_bridge_llama_template_retention_breaks_on_rewrites() -> None:
    family = FAMILIES["llama3.1"]
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "more"},
    ]
    prompt = family.reference_ids(msgs[:1], agp=True)
    keep, strict = family.renderer(), family.renderer(thinking_retention="template")
    for text in (" Hello <|eot_id|>", "Hello<|end_of_text|>", '{"name": "f", "parameters": {"a":1}}<|eot_id|>'):
        sampled = _hf_ids(L31, text)
        kept = keep.bridge(prompt, sampled, msgs[2:])
        assert isinstance(kept, Bridged) and kept.token_ids[: kept.prefix_len] == prompt + sampled
        brk = strict.bridge(prompt, sampled, msgs[2:])
        assert isinstance(brk, Break) and brk.reason is BreakReason.TEMPLATE_REWRITES_HISTORY, (text, brk)
        assert brk.position is not None and brk.position >= len(prompt)
    canonical = strict.bridge(prompt, _hf_ids(L31, "Hello<|eot_id|>"), msgs[2:])
    assert isinstance(canonical, Bridged) and canonical.token_ids == family.reference_ids(msgs, agp=True)


def test_bridge_contract_nemotron_template_retention() -> None:
    family = FAMILIES["nemotron"]
    convs = _renderable(family, nemotron_conversations(8411, 40))
    # the reference's own assistant turns have no reasoning left (the template strips it), so the
    # retention Breaks are exercised in test_bridge_nemotron_reasoning below
    counts = check_bridge_contract(family, convs, min_exact=5, thinking_retention="template")
    print(f"[nemotron template retention] bridge contract: {counts}")


ROUND_TRIP = {
    "llama3.1": [
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": " Hello there. "}], None),
        (
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [_call("get_weather", {"city": "Zürich", "n": [1, 2.5, None]})],
                },
            ],
            [WEATHER],
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", '{"city": "Paris"}')]},
            ],
            [WEATHER],
        ),
    ],
    "llama3.1-builtin": [
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [_call("brave_search", {"query": "llama 3 päper"})]},
            ],
            None,
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [_call("wolfram_alpha", {"query": "2+2", "units": "si"})]},
            ],
            None,
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [_call("get_weather", {"city": "Oslo"})]},
            ],
            [WEATHER],
        ),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "plain"}], None),
    ],
    "nemotron": [
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "Answer."}], None),
        (
            [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [
                        _call("get_weather", {"city": "Zürich"}),
                        _call("lookup", '{"a": [1, {"b": null}]}'),
                    ],
                },
            ],
            [WEATHER, FLAT_TOOL],
        ),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {})]},
            ],
            [WEATHER],
        ),
    ],
}


@pytest.mark.parametrize("fid", list(ROUND_TRIP))
def test_round_trip(fid: str) -> None:
    assert check_round_trip(FAMILIES[fid], ROUND_TRIP[fid]) == len(ROUND_TRIP[fid])


@pytest.mark.parametrize("fid", ["llama3.1", "llama3.1-builtin", "llama3.2", "nemotron"])
def test_marker_injection(fid: str) -> None:
    assert check_marker_injection(FAMILIES[fid], LLAMA_MARKERS) == len(LLAMA_MARKERS)
    assert check_marker_injection(FAMILIES[fid]) == 40  # the vocabulary's longest added tokens (reserved ones)


def _reference_completions(family: Family, cases) -> list[list[int]]:
    out = []
    for msgs, tools in cases:
        prompt = family.reference_ids(msgs[:-1], tools, agp=True)
        out.append(family.reference_ids(msgs, tools)[len(prompt) :])
    return out


@pytest.mark.parametrize("fid", ["llama3.1-builtin", "nemotron"])
def test_parse_fuzz(fid: str) -> None:
    family = FAMILIES[fid]
    completions = _reference_completions(family, ROUND_TRIP[fid])
    completions.append(
        _hf_ids(family.tokenizer, '<think>\nr\n</think>\n\n<TOOLCALL>[{"name": "x"}]</TOOLCALL><|eot_id|>')
    )
    check_parse_fuzz(family, completions)


# ---- parsing completions as a model samples them -----------------------------------------------


def _hf_ids(tokenizer: str, text: str) -> list[int]:
    return list(reference(tokenizer)(text, add_special_tokens=False)["input_ids"])


def _parse(text: str, tools=None, tokenizer: str = L31, **kw):
    r = renderers.create_renderer(ours(tokenizer), **kw)
    ids = _hf_ids(tokenizer, text)
    return r.parse_response(ids, tools=tools), ids


def test_parse_llama_json_calls() -> None:
    eot = ours(L31).added_tokens["<|eot_id|>"]
    parsed, ids = _parse('{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>', [WEATHER])
    (call,) = parsed.tool_calls
    assert (call.name, call.arguments, call.status) == ("get_weather", {"city": "Zürich"}, ToolCallStatus.OK)
    assert call.token_span == (0, len(ids)) and parsed.content == "" and parsed.stop_token_id == eot
    parsed, _ = _parse('{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}<|eot_id|>')
    assert parsed.tool_calls[0].arguments == {"city": "Oslo"}  # double-encoded arguments are decoded once
    statuses = {
        '{"name": "get_weather", "parameters": {"city": <|eot_id|>': ToolCallStatus.INVALID_JSON,
        '{"name": "", "parameters": {}}<|eot_id|>': ToolCallStatus.MISSING_NAME,
        '{"name": "get_weather", "parameters": [1]}<|eot_id|>': ToolCallStatus.INVALID_ARGUMENTS,
        '{"name": "delete_all", "parameters": {}}<|eot_id|>': ToolCallStatus.UNKNOWN_TOOL,
        '{"name": "get_weather", "parameters": {"city": "Par': ToolCallStatus.UNCLOSED,
    }
    for text, status in statuses.items():
        parsed, _ = _parse(text, [WEATHER])
        assert [c.status for c in parsed.tool_calls] == [status], text
        assert (parsed.tool_calls[0].error is None) == (status is ToolCallStatus.OK)
    # JSON that is not shaped like a call, and marker-shaped text, stay content
    parsed, _ = _parse('{"answer": 42}<|eot_id|>')
    assert parsed.content == '{"answer": 42}' and parsed.tool_calls == []
    r = renderers.create_renderer(ours(L31))
    quoted = ours(L31).encode_plain("say <|eot_id|> and <|python_tag|>x") + [eot]
    parsed = r.parse_response(quoted)
    assert (
        parsed.content == "say <|eot_id|> and <|python_tag|>x"
        and parsed.tool_calls == []
        and parsed.stop_token_id == eot
    )


def test_parse_llama_python_tag() -> None:
    eom = ours(L31).added_tokens["<|eom_id|>"]
    parsed, ids = _parse(
        '<|python_tag|>brave_search.call(query="llama 3.1 release", n="2")<|eom_id|>', [WEATHER], **BUILTIN
    )
    (call,) = parsed.tool_calls
    assert (call.name, call.arguments, call.status) == (
        "brave_search",
        {"query": "llama 3.1 release", "n": "2"},
        ToolCallStatus.OK,
    )
    assert call.token_span == (0, len(ids)) and parsed.stop_token_id == eom
    parsed, _ = _parse("<|python_tag|>import math\nprint(math.pi)<|eom_id|>")
    assert parsed.tool_calls[0].name == "code_interpreter"
    assert parsed.tool_calls[0].arguments == {"code": "import math\nprint(math.pi)"}
    parsed, _ = _parse(
        'Checking.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}<|eom_id|>', [WEATHER]
    )
    assert parsed.content == "Checking." and parsed.tool_calls[0].arguments == {"city": "Rome"}
    statuses = {
        '<|python_tag|>brave_search.call("positional")<|eom_id|>': ToolCallStatus.INVALID_ARGUMENTS,
        "<|python_tag|>brave_search.call(query=x.y)<|eom_id|>": ToolCallStatus.INVALID_ARGUMENTS,
        "<|python_tag|>def broken(:<|eom_id|>": ToolCallStatus.INVALID_ARGUMENTS,
        "<|python_tag|><|eom_id|>": ToolCallStatus.MISSING_NAME,
        '<|python_tag|>rm_rf.call(path="/")<|eom_id|>': ToolCallStatus.UNKNOWN_TOOL,
        '<|python_tag|>brave_search.call(query="cut': ToolCallStatus.UNCLOSED,
        '<|python_tag|>{"name": "get_weather", "parameters": 5}<|eom_id|>': ToolCallStatus.INVALID_ARGUMENTS,
    }
    for text, status in statuses.items():
        parsed, ids = _parse(text, [WEATHER])
        assert [c.status for c in parsed.tool_calls] == [status], (text, parsed)
        assert 0 <= parsed.tool_calls[0].token_span[0] < parsed.tool_calls[0].token_span[1] <= len(ids)


def test_parse_nemotron() -> None:
    text = '<think>\nThe user wants weather.\n</think>\n\nSure.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "lookup", "arguments": {}}]</TOOLCALL><|eot_id|>'
    parsed, ids = _parse(text, [WEATHER, FLAT_TOOL], tokenizer=NEMO)
    assert parsed.reasoning_content == "The user wants weather." and parsed.reasoning_complete is True
    assert parsed.content == "Sure."
    assert [(c.name, c.arguments, c.status) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}, ToolCallStatus.OK),
        ("lookup", {}, ToolCallStatus.OK),
    ]
    start, end = parsed.tool_calls[0].token_span
    assert ours(NEMO).decode(ids[start:end]).startswith("<TOOLCALL>") or ours(NEMO).decode(ids[start:end]).endswith(
        "</TOOLCALL>"
    )
    assert ours(NEMO).decode(ids[start:end]).endswith("</TOOLCALL>") and "<TOOLCALL>" in ours(NEMO).decode(
        ids[start - 1 : end]
    )
    parsed, _ = _parse("<think>\nstill thinking", tokenizer=NEMO)
    assert parsed.reasoning_content == "still thinking" and parsed.reasoning_complete is False and parsed.content == ""
    parsed, _ = _parse("Plain answer.<|eot_id|>", tokenizer=NEMO)
    assert parsed.reasoning_content is None and parsed.content == "Plain answer."
    statuses = {
        '<TOOLCALL>[{"name": "get_weather", "arguments": {]</TOOLCALL><|eot_id|>': [ToolCallStatus.INVALID_JSON],
        '<TOOLCALL>"text"</TOOLCALL><|eot_id|>': [ToolCallStatus.NOT_AN_OBJECT],
        '<TOOLCALL>[{"arguments": {}}, 3]</TOOLCALL><|eot_id|>': [
            ToolCallStatus.MISSING_NAME,
            ToolCallStatus.NOT_AN_OBJECT,
        ],
        '<TOOLCALL>[{"name": "nope", "arguments": {}}]</TOOLCALL><|eot_id|>': [ToolCallStatus.UNKNOWN_TOOL],
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city"': [ToolCallStatus.UNCLOSED],
        '<TOOLCALL>[{"name": "get_weather"}]<|eot_id|>': [ToolCallStatus.UNCLOSED],
    }
    for text, want in statuses.items():
        parsed, ids = _parse(text, [WEATHER], tokenizer=NEMO)
        assert [c.status for c in parsed.tool_calls] == want, (text, parsed)
        assert all(0 <= c.token_span[0] < c.token_span[1] <= len(ids) for c in parsed.tool_calls)


# ---- bridge: the closes Llama adds --------------------------------------------------------------


def test_bridge_keeps_eom_and_synthesizes_it_for_a_truncated_builtin_call() -> None:
    family = FAMILIES["llama3.1-builtin"]
    r = family.renderer()
    eom = r.tokenizer.added_tokens["<|eom_id|>"]
    call = _call("brave_search", {"query": "q"})
    msgs = [
        {"role": "user", "content": "find"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "content": "res"},
    ]
    prompt = family.reference_ids(msgs[:1], agp=True)
    full = family.reference_ids(msgs, agp=True)
    completion = family.reference_ids(msgs[:2])[len(prompt) :]
    assert completion[-1] == eom
    got = r.bridge(prompt, completion, msgs[2:])
    assert isinstance(got, Bridged) and got.token_ids == full and got.synthesized == 0
    cut = r.bridge(prompt, completion[:-1], msgs[2:])
    assert isinstance(cut, Bridged) and cut.token_ids == full and cut.synthesized == 1
    assert cut.appended.token_ids[0] == eom
    # Llama 3.2 keeps an <|eom_id|> the model sampled instead of adding an <|eot_id|> after it
    r32 = FAMILIES["llama3.2"].renderer()
    kept = r32.bridge(prompt, completion, msgs[2:])
    assert isinstance(kept, Bridged) and kept.synthesized == 0 and kept.appended.token_ids[0] != r32.turn_close_id


def test_bridge_nemotron_reasoning() -> None:
    family = FAMILIES["nemotron"]
    msgs = [
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "more"},
    ]
    prompt = family.reference_ids(msgs[:1], agp=True)
    sampled = _hf_ids(NEMO, "<think>\nplan\n</think>\n\nx<|eot_id|>")
    keep = family.renderer().bridge(prompt, sampled, msgs[2:])
    assert isinstance(keep, Bridged) and keep.token_ids[: keep.prefix_len] == prompt + sampled
    assert (
        keep.token_ids[keep.prefix_len :] == family.reference_ids(msgs, agp=True)[len(family.reference_ids(msgs[:2])) :]
    )
    brk = family.renderer(thinking_retention="template").bridge(prompt, sampled, msgs[2:])
    assert (
        isinstance(brk, Break) and brk.reason is BreakReason.TEMPLATE_REWRITES_HISTORY and brk.position == len(prompt)
    )
    plain = family.renderer(thinking_retention="template").bridge(prompt, _hf_ids(NEMO, "x<|eot_id|>"), msgs[2:])
    assert isinstance(plain, Bridged) and plain.token_ids == family.reference_ids(msgs, agp=True)


def test_bridge_nemotron_no_think() -> None:
    family = FAMILIES["nemotron"]
    msgs = [
        {"role": "system", "content": "/no_think"},
        {"role": "user", "content": "w?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "warm"},
    ]
    prompt = family.reference_ids(msgs[:2], [WEATHER], agp=True)
    sampled = reference(NEMO)(
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL><|eot_id|>',
        add_special_tokens=False,
    )["input_ids"]
    keep = family.renderer().bridge(prompt, list(sampled), msgs[3:], [WEATHER])
    assert isinstance(keep, Bridged)
    reference_full = family.reference_ids(msgs, [WEATHER], agp=True)
    # the template drops the pre-filled empty think block from history, so only the tail is comparable
    assert keep.appended.token_ids == reference_full[-len(keep.appended.token_ids) :]
    assert ours(NEMO).decode(keep.appended.token_ids).endswith("assistant<|end_header_id|>\n\n<think>\n\n</think>\n\n")
    brk = family.renderer(thinking_retention="template").bridge(prompt, list(sampled), msgs[3:], [WEATHER])
    assert isinstance(brk, Break) and brk.reason is BreakReason.TEMPLATE_REWRITES_HISTORY
    open_think = _hf_ids(NEMO, "<think>\nhmm")
    stopped = family.renderer().bridge(prompt, open_think + [ours(NEMO).added_tokens["<|eot_id|>"]], msgs[3:])
    assert isinstance(stopped, Break) and stopped.reason is BreakReason.STOP_INSIDE_REASONING
    cut = family.renderer().bridge(prompt, open_think, msgs[3:])
    assert isinstance(cut, Break) and cut.reason is BreakReason.TRUNCATED_INSIDE_REASONING


def test_attribution() -> None:
    """Sampled tokens are exactly the assistant replies after their headers (close included); tool
    definitions and the dated system header belong to no message; message text is content."""
    tok = ours(L31)
    r = renderers.create_renderer(tok, **BUILTIN)
    msgs = [
        {"role": "system", "content": " Be terse. "},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [_call("brave_search", {"query": "oslo"})]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "  Sunny.  "},
    ]
    out = r.render(msgs, [WEATHER])
    by_message = {}
    for tid, index, sampled, content in zip(
        out.token_ids, out.message_indices, out.sampled_mask, out.is_content, strict=True
    ):
        by_message.setdefault(index, []).append((tid, sampled, content))
    sampled_text = tok.decode([t for t, s in zip(out.token_ids, out.sampled_mask, strict=True) if s])
    assert sampled_text == '<|python_tag|>brave_search.call(query="oslo")<|eom_id|>Sunny.<|eot_id|>'
    minus_one = tok.decode([t for t, _, _ in by_message[-1]])
    assert "Today Date: 26 Jul 2024" in minus_one and '"name": "get_weather"' in minus_one
    assert not any(c for _, _, c in by_message[-1])
    assert tok.decode([t for t, _, c in by_message[0] if c]) == "Be terse."
    assert tok.decode([t for t, _, c in by_message[3] if c]) == '"sunny"'  # the template JSON-encodes results
    assert tok.decode([t for t, _, _ in by_message[1]]).startswith("<|start_header_id|>user<|end_header_id|>\n\n")
