"""Dialects (renderers/dialects) for GLM-4.6/4.7, Kimi K2, MiniMax M2 and DeepSeek V3.1.

Oracle: an assistant turn with reasoning and parallel tool calls (nested, typed and string arguments)
is rendered by transformers' ``apply_chat_template`` with the family's official template; the
assistant part's ids (the full render minus the generation-prompt render) are parsed back and must
give the same message. Every truncation of it parses without raising, a call cut off is ``unclosed``,
and marker text inside messages is never a marker. Parity: the generic renderer's render equals
transformers' on each template over generated conversations.

Tokenizers: GLM, Kimi K2 and MiniMax M2 are RECONSTRUCTED (tests/reconstructed.py: a real base
vocabulary from the shared fixtures + the family's added tokens by name; ids are not official).
DeepSeek V3.1 uses the real DeepSeek-R1 tokenizer fixture (the same vocabulary and added tokens,
``<think>``/``</think>`` included) with V3.1's template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache

import pytest

import tito_renderers as renderers
from tito_renderers.dialects import Dialect, detect_dialects, dialect_for, dialect_named, registered
from tito_renderers.types import ToolCallStatus

from ._support import fixtures_dir, ours, reference
from .conftest import TokenizerPair
from .convgen import Conversation, generate
from .reconstructed import load
from .test_parity import Case, check_parity


@dataclass(frozen=True)
class Family:
    id: str
    dialect: str
    reconstructed: str | None = None  # tests/reconstructed.py entry, else (tokenizer, template file)
    tokenizer: str | None = None
    template_file: str | None = None
    reasons: bool = True  # the vocabulary has a reasoning pair and the template renders reasoning
    json_arguments: bool = False  # the template concatenates arguments as a JSON string (DeepSeek V3.1)
    kwargs: tuple = ()


FAMILIES = [
    Family("glm-4.6", "glm", reconstructed="glm-4.6"),
    Family("glm-4.7-flash", "glm", reconstructed="glm-4.7-flash"),
    Family("kimi-k2-2507", "kimi_k2", reconstructed="kimi-k2-2507", reasons=False),
    Family("minimax-m2", "minimax_m2", reconstructed="minimax-m2"),
    Family("deepseek-v3.1", "deepseek", tokenizer="deepseek-r1", template_file="deepseek-ai-DeepSeek-V3.1.jinja",
           reasons=False, json_arguments=True),
]
# K2-Instruct's first template: parity only (transformers refuses its tool-call turns, see the last tests)
KIMI_K2_FIRST = Family("kimi-k2", "kimi_k2", reconstructed="kimi-k2", reasons=False)
BY_ID = {f.id: f for f in [*FAMILIES, KIMI_K2_FIRST]}


@cache
def pair(family_id: str) -> tuple[renderers.Tokenizer, object, str]:
    """(ours with the family's template, transformers' tokenizer, the template source)."""
    f = BY_ID[family_id]
    if f.reconstructed:
        tok, hf = load(f.reconstructed)
        return tok, hf, tok.chat_template
    template = (fixtures_dir() / "templates" / f.template_file).read_text(encoding="utf-8")
    return ours(f.tokenizer).with_chat_template(template, family_id), reference(f.tokenizer), template


@cache
def generic(family_id: str) -> renderers.Renderer:
    return renderers.create_renderer(pair(family_id)[0], name="generic")


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"},
            "ratio": {"type": "number"}, "hourly": {"type": "boolean"}, "opts": {"type": "object"},
            "fields": {"type": "array"}, "note": {"type": ["string", "null"]},
        }}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
CALLS = [
    ("get_weather", {"city": "São Paulo", "zip": "01000", "days": 3, "ratio": 0.5, "hourly": True,
                     "opts": {"units": "metric", "levels": [1, 2, {"deep": None}]}, "fields": ["temp", "wind"], "note": None}),
    ("search", {"query": 'line one\nline "two"', "limit": 10}),
    ("noop", {}),
]
REASONING = "The user wants weather.\nI will call three tools."
CONTENT = "Let me check."


def assistant_message(f: Family) -> dict:
    calls = [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a) if f.json_arguments else a}} for n, a in CALLS
    ]
    msg = {"role": "assistant", "content": CONTENT, "tool_calls": calls}
    if f.reasons:
        msg["reasoning_content"] = REASONING
    return msg


def expected_message(f: Family, reasoning: bool) -> dict:
    msg = {"role": "assistant", "content": CONTENT}
    if reasoning:
        msg["reasoning_content"] = REASONING
    msg["tool_calls"] = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(CALLS)
    ]
    return msg


def hf_encode(hf, text: str) -> list[int]:
    return list(hf(text, add_special_tokens=False)["input_ids"])


def assistant_part(family_id: str) -> tuple[list[int], list[int], bool]:
    """(prompt ids, completion ids, completion has reasoning) from transformers' renders."""
    f = BY_ID[family_id]
    _, hf, template = pair(family_id)
    msgs = [{"role": "user", "content": "Weather in São Paulo, and search for it?"}, assistant_message(f)]
    kwargs = dict(f.kwargs)
    full = hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False, chat_template=template, **kwargs)
    prompt = hf.apply_chat_template(msgs[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                    chat_template=template, **kwargs)
    assert full.startswith(prompt), "the template's generation prompt is not a prefix of the assistant turn"
    ids, prompt_ids = hf_encode(hf, full), hf_encode(hf, prompt)
    assert ids[: len(prompt_ids)] == prompt_ids
    completion = ids[len(prompt_ids):]
    if f.id == "deepseek-v3.1":
        # V3.1's template never renders reasoning (it keeps only what follows </think>): the thinking
        # prompt ends in <think>, and the model writes its reasoning and </think> before the turn the
        # template renders after "<｜Assistant｜></think>".
        think_prompt = hf.apply_chat_template(msgs[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                              chat_template=template, thinking=True)
        assert prompt.endswith("</think>") and think_prompt.endswith("<think>")
        return hf_encode(hf, think_prompt), hf_encode(hf, REASONING + "</think>") + completion, True
    return prompt_ids, completion, f.reasons


IDS = [f.id for f in FAMILIES]


# ---- detection ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family_id", IDS)
def test_the_vocabulary_selects_the_familys_dialect(family_id: str) -> None:
    f = BY_ID[family_id]
    tok = pair(family_id)[0]
    d = dialect_for(tok)
    assert d is not None and d.name == f.dialect
    assert (d.think_ids is not None) == (f.reasons or f.id == "deepseek-v3.1")
    # the dialect's channels are wired by marker pairs the vocabulary has, as added (marker) tokens
    for ids in (d.think_ids, d.call_ids, d.section_ids):
        assert ids is None or all(i in tok.markers.values() for i in ids)


def test_detection_needs_the_markers_as_added_tokens() -> None:
    # Llama 3.1 spells none of these formats' markers as added tokens
    llama = ours("llama-3.1-8b-instruct")
    assert not {d.name for d in detect_dialects(llama)} & {f.dialect for f in FAMILIES}
    # Qwen3 has <think> and <tool_call> but no <arg_key>: the plain scan, never GLM's
    assert [d.name for d in detect_dialects(ours("qwen3-0.6b"))] == ["hermes"]
    assert dialect_named("glm", ours("qwen3-0.6b")) is None
    with pytest.raises(KeyError, match="no dialect named"):
        dialect_named("nope", llama)
    order = [c.priority for c in registered()]
    assert order == sorted(order) and all(issubclass(c, Dialect) for c in registered())


# ---- the oracle: render -> parse -> the same message ----------------------------------------------


@pytest.mark.parametrize("family_id", IDS)
def test_render_then_parse_recovers_the_message(family_id: str) -> None:
    f = BY_ID[family_id]
    tok = pair(family_id)[0]
    prompt_ids, completion, reasoning = assistant_part(family_id)
    d = dialect_for(tok)
    parsed = d.parse(completion, TOOLS, prompt_ids=prompt_ids)
    assert parsed.to_message(arguments="object") == expected_message(f, reasoning), parsed
    assert [c.status for c in parsed.tool_calls] == [ToolCallStatus.OK] * len(CALLS)
    assert parsed.reasoning_complete is (True if reasoning else None)
    # spans: in order, disjoint, inside the completion; raw is the call's own text
    spans = [c.token_span for c in parsed.tool_calls]
    assert all(a < b for a, b in spans) and all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= len(completion)
    for (name, _), call in zip(CALLS, parsed.tool_calls):
        assert name in call.raw and name in tok.decode(completion[call.token_span[0] : call.token_span[1]])
    # the generic renderer parses the same way, with the stop ids its probe found
    assert generic(family_id).parse_response(completion, prompt_ids, TOOLS).to_message("object") == parsed.to_message("object")
    # without tools, text arguments stay text (a "3" cannot be told from 3) and JSON arguments are JSON
    untyped = d.parse(completion, None, prompt_ids=prompt_ids)
    assert [c.status for c in untyped.tool_calls] == [ToolCallStatus.OK] * len(CALLS)
    if d.string_arguments:
        assert untyped.tool_calls[0].arguments["days"] == "3" and untyped.tool_calls[0].arguments["zip"] == "01000"
    else:
        assert untyped.tool_calls[0].arguments == CALLS[0][1]


@pytest.mark.parametrize("family_id", IDS)
def test_every_truncation_parses_and_a_cut_call_is_unclosed(family_id: str) -> None:
    tok = pair(family_id)[0]
    prompt_ids, completion, reasoning = assistant_part(family_id)
    d = dialect_for(tok)
    full = d.parse(completion, TOOLS, prompt_ids=prompt_ids)
    for k in range(len(completion) + 1):
        cut = d.parse(completion[:k], TOOLS, prompt_ids=prompt_ids)  # never raises
        inside = [c for c in full.tool_calls if c.token_span[0] < k < c.token_span[1]]
        if inside:
            last = cut.tool_calls[-1] if cut.tool_calls else None
            # (MiniMax: cut after an invoke's own </invoke>, before the block's close, that call is complete)
            complete = d.several_per_block and last is not None and last.raw.rstrip().endswith("</invoke>")
            assert last is not None and (last.status is ToolCallStatus.UNCLOSED or complete), (k, cut)
        done = [c for c in full.tool_calls if c.token_span[1] <= k]
        assert [(c.name, c.arguments, c.status) for c in cut.tool_calls[: len(done)]] == [
            (c.name, c.arguments, c.status) for c in done
        ], k
        assert all(c.status is not ToolCallStatus.OK or c.token_span[1] <= k for c in cut.tool_calls)
        if reasoning and k <= full.tool_calls[0].token_span[0] and cut.reasoning_content is not None:
            # before the calls: reasoning is complete exactly when its close has been sampled
            assert cut.reasoning_complete is ("</think>" in tok.decode(completion[:k])), k
        assert cut.stop_token_id is None or k == len(completion) or completion[k - 1] == cut.stop_token_id


@pytest.mark.parametrize("family_id", IDS)
def test_no_structural_marker_is_an_engine_stop(family_id: str) -> None:
    """The stop ids an engine gets never hold a dialect's own think / call / section markers: GLM's
    template ends a tool-call turn with ``</tool_call>`` (it has no end-of-turn token), and the probe once
    took it for a stop, so an engine ended every turn after the first of several parallel calls."""
    tok = pair(family_id)[0]
    d = dialect_for(tok)
    structure = {*(d.think_ids or ()), *(d.call_ids or ()), *(d.section_ids or ())}
    stops = generic(family_id).stop_token_ids
    assert stops and not structure & set(stops), [tok.decode([i]) for i in structure & set(stops)]


def test_glm_parallel_calls_end_at_the_observation_tag() -> None:
    """A GLM turn with two calls, sampled until the next role tag: both calls parse, and the turn ends
    at ``<|observation|>`` (a stop the engine gets), not at the first ``</tool_call>``."""
    tok = pair("glm-4.6")[0]
    r = generic("glm-4.6")
    observation = tok.token_id("<|observation|>")
    assert observation in r.stop_token_ids
    text = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>")
    completion = [*tok.encode(text), observation]
    first_close = completion.index(tok.token_id("</tool_call>"))
    assert first_close < len(completion) - 2 and not set(completion[: first_close + 1]) & set(r.stop_token_ids)
    parsed = r.parse_response(completion, None, TOOLS)
    assert [(c.name, c.arguments["city"], c.status) for c in parsed.tool_calls] == [
        ("get_weather", "Paris", ToolCallStatus.OK), ("get_weather", "Oslo", ToolCallStatus.OK)]
    assert parsed.stop_token_id == observation


MALFORMED = {  # family -> [(completion text, expected statuses)], written as the model would sample them
    "glm-4.6": [
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>", [ToolCallStatus.INVALID_ARGUMENTS]),
        ("<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", [ToolCallStatus.MISSING_NAME]),
        ("<tool_call>launch\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", [ToolCallStatus.UNKNOWN_TOOL]),
        ("<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>soon</arg_value>\n</tool_call>"
         "\n<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>x</arg_value>\n<arg_key>query</arg_key>\n"
         "<arg_value>y</arg_value>\n</tool_call>", [ToolCallStatus.INVALID_ARGUMENTS, ToolCallStatus.INVALID_ARGUMENTS]),
        ("<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>par", [ToolCallStatus.UNCLOSED]),
    ],
    "kimi-k2-2507": [
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{\"query\": "
         "<|tool_call_end|><|tool_call_begin|>functions.launch:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
         "<|tool_call_begin|>:2<|tool_call_argument_begin|>{}<|tool_call_end|>"
         "<|tool_call_begin|>functions.search:3<|tool_call_argument_begin|>[1]<|tool_call_end|>"
         "<|tool_call_begin|>functions.search:4<|tool_call_begin|>functions.noop:5<|tool_call_argument_begin|>{}"
         "<|tool_calls_section_end|><|im_end|>",
         [ToolCallStatus.INVALID_JSON, ToolCallStatus.UNKNOWN_TOOL, ToolCallStatus.MISSING_NAME,
          ToolCallStatus.INVALID_ARGUMENTS, ToolCallStatus.UNCLOSED, ToolCallStatus.UNCLOSED]),
    ],
    "minimax-m2": [
        ('<minimax:tool_call>\n<invoke name="search">\n<parameter name="query">a</parameter> b</parameter>\n</invoke>\n'
         '<invoke name="launch">\n</invoke>\n<invoke name="get_weather">\n<parameter name="days">soon</parameter>\n</invoke>\n'
         "</minimax:tool_call>[e~[",
         [ToolCallStatus.OK, ToolCallStatus.UNKNOWN_TOOL, ToolCallStatus.INVALID_ARGUMENTS]),
        ('<minimax:tool_call>\n<invoke name="search">\nstray\n</invoke>\n</minimax:tool_call>', [ToolCallStatus.INVALID_ARGUMENTS]),
        ('<minimax:tool_call>\n<invoke>\n</invoke>\n</minimax:tool_call>', [ToolCallStatus.MISSING_NAME]),
        ('<minimax:tool_call>\n<invoke name="noop">\n</invoke>\n<invoke name="search">\n<parameter name="q', [
            ToolCallStatus.OK, ToolCallStatus.UNCLOSED]),
    ],
    "deepseek-v3.1": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"query\": <｜tool▁call▁end｜>"
         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{\"query\": \"v3 form\"}\n```<｜tool▁call▁end｜>"
         "<｜tool▁call▁begin｜>launch<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁call▁begin｜>search{}<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
         [ToolCallStatus.INVALID_JSON, ToolCallStatus.OK, ToolCallStatus.UNKNOWN_TOOL, ToolCallStatus.MISSING_NAME]),
    ],
}


@pytest.mark.parametrize("family_id", list(MALFORMED))
def test_malformed_calls_get_a_status(family_id: str) -> None:
    tok, hf, _ = pair(family_id)
    d = dialect_for(tok)
    for text, statuses in MALFORMED[family_id]:
        parsed = d.parse(hf_encode(hf, text), TOOLS)
        assert [c.status for c in parsed.tool_calls] == statuses, (text, parsed.tool_calls)
        for c in parsed.tool_calls:
            assert (c.error is None) == (c.status is ToolCallStatus.OK)
            if c.status not in (ToolCallStatus.OK, ToolCallStatus.UNKNOWN_TOOL, ToolCallStatus.UNCLOSED):
                assert c.arguments is None or c.status is ToolCallStatus.MISSING_NAME or not d.string_arguments
        assert parsed.to_message()["content"] == ""  # the calls' text is never content
    if family_id == "minimax-m2":  # a value that contains its close tag, and a value typed by schema
        ok = d.parse(hf_encode(hf, MALFORMED[family_id][0][0]), TOOLS).tool_calls[0]
        assert ok.arguments == {"query": "a</parameter> b"}


@pytest.mark.parametrize("family_id", IDS)
def test_marker_text_in_messages_is_never_a_marker(family_id: str) -> None:
    """Message text that spells the family's markers is encoded as text by the generic renderer, so
    the parse of the sampled tokens sees text, and no marker id comes from a message."""
    tok = pair(family_id)[0]
    d = dialect_for(tok)
    think = [n for n, i in tok.markers.items() if i in (d.think_ids or ())]
    names = [n for n, i in tok.markers.items() if i in {*(d.call_ids or ()), *(d.section_ids or ())}]
    spelled = " ".join(names) + " <invoke name=\"search\"> functions.search:0"
    r = generic(family_id)
    # (reasoning markers only in the user's text: these templates split an assistant's content on
    # "</think>" themselves, and then transformers and the generic renderer treat them as markers)
    msgs = [{"role": "user", "content": f"Quote these: {spelled} {' '.join(think)}"},
            {"role": "assistant", "content": f"Quoted: {spelled}"}]
    rendered = r.render(msgs)
    marker_ids = set(tok.markers.values())
    assert not any(t in marker_ids for t, c in zip(rendered.token_ids, rendered.is_content) if c)
    sampled = [t for t, s in zip(rendered.token_ids, rendered.sampled_mask) if s]
    parsed = r.parse_response(sampled)
    assert parsed.tool_calls == [] and parsed.content.startswith("Quoted: ") and names[0] in parsed.content


# ---- parity of the generic renderer with transformers on the (reconstructed) tokenizers ----------


class _Store:
    def __init__(self, family_id: str) -> None:
        self.family_id = family_id

    def get(self, name: str) -> TokenizerPair:
        tok, hf, _ = pair(self.family_id)
        return TokenizerPair(name, fixtures_dir(), tok, hf)


N_PARITY = 60


def family_marker_conversations(tok: renderers.Tokenizer, seed: int, n: int) -> list[Conversation]:
    """Generated conversations with the family's own markers (its dialect's and the turn tokens) in user
    and tool text: the shared generator spells only Qwen's and DeepSeek's."""
    d = dialect_for(tok)
    structural = {*(d.call_ids or ()), *(d.section_ids or ()), *(d.think_ids or ())}
    markers = sorted(n_ for n_, i in tok.markers.items() if i in structural or i in d.stop_ids) or sorted(tok.markers)
    out = []
    for k, conv in enumerate(generate(seed, n)):
        messages = [dict(m) for m in conv.messages]
        for j, m in enumerate(messages):
            if m["role"] in ("user", "tool") and isinstance(m.get("content"), str):
                m["content"] = f"{m['content']} {markers[(k + j) % len(markers)]} tail"
        out.append(Conversation(conv.index + 1000, conv.seed, messages, conv.tools, {*conv.tags, "family-markers"}))
    return out


PARITY_IDS = [*IDS, KIMI_K2_FIRST.id]


@pytest.mark.slow
@pytest.mark.parametrize("family_id", PARITY_IDS)
def test_generic_parity_on_the_familys_tokenizer(family_id: str) -> None:
    tok, _, template = pair(family_id)
    case = Case(f"dialect-{family_id}", family_id, 9100 + PARITY_IDS.index(family_id), renderer_name="generic",
                chat_template=template, min_marker=0)
    convs = generate(case.seed, N_PARITY) + family_marker_conversations(tok, case.seed + 1, 20)
    if family_id == "deepseek-v3.1":
        # V3.1's template tests `'</think>' in content` and then indexes the split, which the harness's
        # defused (marker-mode) reference cannot follow: conversations spelling </think> are left out
        convs = [c for c in convs if "</think>" not in json.dumps(c.messages, ensure_ascii=False)]
    if family_id == "minimax-m2":
        # a tool without a "function" key: MiniMax's template json-dumps an undefined value, which
        # transformers' Jinja2 cannot and minijinja renders as null (the known divergence that
        # test_generic_parity.test_template_only_text_parity counts as "undefined_tojson")
        convs = [c for c in convs if all("function" in t for t in c.tools or [])]
    counts = check_parity(case, _Store(family_id), convs, min_exact=N_PARITY // 4)
    print(family_id, {k: dict(v) for k, v in counts.items()})


def test_kimi_k2_original_template_is_rejected_like_transformers() -> None:
    """K2-Instruct's first template appends to a list (``tool_response_queue.ids.append``), which
    transformers' sandbox refuses: a conversation with tool calls is a template error there, and must
    be ``TemplateRejected`` here, never a different render."""
    import jinja2

    tok, hf = load("kimi-k2")
    msgs = [{"role": "user", "content": "hi"}, assistant_message(BY_ID["kimi-k2-2507"])]
    with pytest.raises(jinja2.exceptions.SecurityError):
        hf.apply_chat_template(msgs, tokenize=False)
    with pytest.raises(renderers.TemplateRejected):
        renderers.create_renderer(tok, name="generic").render(msgs)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello."}]
    assert renderers.create_renderer(tok, name="generic").render_ids(plain) == hf_encode(hf, hf.apply_chat_template(plain, tokenize=False))


_TEXT_PIECES = ['<invoke name="', '">', "</invoke>", '<parameter name="', "</parameter>", "functions.", ":0", "{",
                '"a": 1', "}", "[", "\n", "search", "get_weather", "```json\n", "```", "function"]


@pytest.mark.parametrize("family_id", IDS)
def test_parse_never_raises_on_random_ids(family_id: str) -> None:
    """Random sequences of the vocabulary's markers, the formats' text tags and real completion pieces:
    every parse returns, every call has a status and a span inside the completion."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    tok, hf, _ = pair(family_id)
    d = dialect_for(tok)
    prompt_ids, completion, _ = assistant_part(family_id)
    pieces = [hf_encode(hf, p) for p in _TEXT_PIECES] + [[t] for t in tok.markers.values()]
    chunk = st.one_of(st.sampled_from(pieces), st.integers(0, tok.vocab_size - 1).map(lambda t: [t]),
                      st.integers(0, len(completion)).map(lambda k: completion[k : k + 12]))

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.lists(chunk, max_size=24), st.booleans())
    def fuzz(parts: list[list[int]], with_prompt: bool) -> None:
        ids = [t for p in parts for t in p]
        parsed = d.parse(ids, TOOLS, prompt_ids=prompt_ids if with_prompt else None)
        assert isinstance(parsed.content, str)
        for call in parsed.tool_calls:
            assert isinstance(call.status, ToolCallStatus) and (call.status is ToolCallStatus.OK) == (call.error is None)
            assert 0 <= call.token_span[0] < call.token_span[1] <= len(ids)

    fuzz()


def test_a_hand_coded_renderer_opts_in_with_its_dialect_attribute() -> None:
    """``Renderer.dialect`` delegates parse_response to that dialect (with the renderer's stop ids) where
    the vocabulary has its markers, and keeps the base scan where it has not."""
    from tito_renderers.qwen import Qwen3Renderer

    tok = ours("qwen3-0.6b")
    text = ("<think>\nplan\n</think>\n\nOk.\n<tool_call>\n<function=search>\n<parameter=limit>\n3\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>")
    ids = hf_encode(reference("qwen3-0.6b"), text)

    class WithHermes(Qwen3Renderer):
        dialect = "hermes"

    class WithGLM(Qwen3Renderer):
        dialect = "glm"

    base = Qwen3Renderer(tok).parse_response(ids, tools=TOOLS)
    assert Qwen3Renderer.dialect is None and base.tool_calls[0].status is ToolCallStatus.INVALID_JSON  # JSON bodies only
    hermes = WithHermes(tok).parse_response(ids, tools=TOOLS)  # the dialect reads the XML body and types it
    assert [(c.name, c.arguments, c.status) for c in hermes.tool_calls] == [("search", {"limit": 3}, ToolCallStatus.OK)]
    assert (hermes.content, hermes.reasoning_content, hermes.stop_token_id) == ("Ok.", "plan", tok.token_id("<|im_end|>"))
    assert WithGLM(tok).parse_response(ids, tools=TOOLS) == base  # no <arg_key> in Qwen's vocabulary: the base scan
