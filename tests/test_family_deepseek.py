"""DeepSeek-V3 and DeepSeek-R1: parity with transformers, the bridge, parse_response, markers.

Two places where the shared checks do not fit these templates, and what this module does instead:

- R1 concatenates tool-call arguments as a string (``... + tool['function']['arguments'] + ...``), so a
  dict raises a plain ``TypeError`` inside jinja, which ``tests.test_parity.compare`` does not count as
  the template rejecting the conversation (it catches ``jinja2.TemplateError`` only). The parity tests
  here treat that ``TypeError`` as a rejection (``reference_type_errors_reject``), and run R1 a second
  time on the same kind of conversations with every argument dict turned into a JSON string, so that
  its tool-call rendering is compared on hundreds of conversations, not only rejected.
- ``family_checks.check_marker_injection`` puts a dict in the tool call's arguments: R1 rejects that, so
  R1 runs ``check_marker_injection_string_args`` below, the same check with the arguments as a string.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jinja2
import pytest

import tito_renderers as renderers
from tito_renderers import Break, BreakReason, Bridged, ToolCallStatus

from . import test_parity as parity_harness
from ._support import reference
from .convgen import Conversation, ConvGen, contains_marker, generate, marker_regex
from .family_checks import (
    Family,
    check_bridge_contract,
    check_marker_injection,
    check_parse_fuzz,
    check_round_trip,
)
from .test_parity import EDGE_CASES, N_CONVERSATIONS, Case, check_parity, compare, make_ctx

V3 = Family("deepseek-v3", "deepseek-v3")
R1 = Family("deepseek-r1", "deepseek-r1")

EOS = "<｜end▁of▁sentence｜>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "search", "description": "Search.", "parameters": {"type": "object"}}},
]
# Marker-shaped text specific to these vocabularies (the shared generator's MARKERS are mostly Qwen's).
DEEPSEEK_MARKERS = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜Assistant｜>",
    "<｜User｜>",
    "<｜tool▁sep｜>",
    "</think>",
    "<think>\n",
    "<｜end▁of▁sentence｜>",
)


def call(name: str, arguments: Any, i: int = 0) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


def string_arguments(messages: list[dict]) -> list[dict]:
    """A copy where every tool call's dict arguments are a JSON string (what R1's template needs)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function", c))
                if not isinstance(fn.get("arguments"), str):
                    fn["arguments"] = json.dumps(fn.get("arguments") or {}, ensure_ascii=False)
                calls.append({**c, "function": fn} if "function" in c else fn)
            m["tool_calls"] = calls
        out.append(m)
    return out


# ---- the family's own conversations ------------------------------------------------------------


def deepseek_conversations(seed: int, n: int) -> list[Conversation]:
    """Conversations for what these templates branch on: runs of tool outputs, assistants after tool
    outputs, several tool-call turns (R1 prints the header only for the first), content-less tool-call
    turns, several and late system messages, R1 reasoning (reasoning_content, embedded think blocks,
    after tool outputs too), and DeepSeek markers inside message text and arguments."""
    gen = ConvGen(seed)
    r = random.Random(seed)
    out = []
    for index in range(n):
        gen.tags = set()
        gen.markers = r.random() < 0.2
        gen.ascii_only = r.random() < 0.3
        tags = {"deepseek"}
        msgs: list[dict] = []
        if r.random() < 0.4:
            msgs.append(gen.system())
        for _ in range(r.choice((1, 2, 3))):
            msgs.append(gen.user())
            if r.random() < 0.15:
                msgs.append(gen.system())
                tags.add("system-later")
            for _ in range(r.choice((0, 1, 1, 2))):
                msgs.append(_tool_call_turn(gen, r, tags))
                msgs.extend(gen.tool_results(r.choice((1, 2, 3, 4))))
                tags.add("tool-outputs")
            if r.random() < 0.8:
                msgs.append(_plain_turn(gen, r, tags))
        if r.random() < 0.3:
            msgs.append(_tool_call_turn(gen, r, tags))
            if r.random() < 0.7:
                msgs.extend(gen.tool_results())
        tools = TOOLS if r.random() < 0.5 else None
        out.append(Conversation(index, seed, msgs, tools, tags | gen.tags))
    return out


def _plain_turn(gen: ConvGen, r: random.Random, tags: set[str]) -> dict:
    content = gen.text()
    k = r.random()
    if k < 0.25:
        tags.add("embedded-think")
        content = f"<think>\n{gen.text(marker_p=0.0)}\n</think>\n\n{content}"
    elif k < 0.4:
        tags.add("reasoning_content")
        return {"role": "assistant", "content": content, "reasoning_content": gen.text(allow_empty=False)}
    elif k < 0.45 and gen.markers:
        content = content + r.choice(DEEPSEEK_MARKERS)
    return {"role": "assistant", "content": content}


def _tool_call_turn(gen: ConvGen, r: random.Random, tags: set[str]) -> dict:
    calls = []
    for j in range(r.choice((1, 1, 2, 3))):
        args = gen.arguments()
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=r.random() < 0.5)
        if gen.markers and r.random() < 0.3:
            args = json.dumps({"q": r.choice(DEEPSEEK_MARKERS)})
        calls.append(call(r.choice(("get_weather", "search", "lookup")), args, j))
    msg: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
    k = r.random()
    if k < 0.1:
        tags.add("content-missing")  # V3 rejects it; R1 rejects it only on the conversation's first call turn
    elif k < 0.5:
        msg["content"] = ""
    else:
        msg["content"] = gen.text(allow_empty=False)
    if r.random() < 0.2:
        msg["reasoning_content"] = gen.text(allow_empty=False)
    return msg


# ---- parity ------------------------------------------------------------------------------------


@pytest.fixture
def reference_type_errors_reject(monkeypatch):
    """A ``TypeError`` raised inside the template (R1: ``str + dict`` arguments) is the template
    rejecting the conversation, like jinja's own errors: count it as such (see the module docstring)."""
    original = parity_harness.Ctx.hf_text

    def hf_text(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except TypeError as exc:
            raise jinja2.exceptions.TemplateError(f"TypeError in the template: {exc}") from exc

    monkeypatch.setattr(parity_harness.Ctx, "hf_text", hf_text)


def _string_args(convs: list[Conversation]) -> list[Conversation]:
    return [Conversation(c.index, c.seed, string_arguments(c.messages), c.tools, c.tags) for c in convs]


PARITY = [
    # (case, conversations, min_exact per add_generation_prompt)
    (
        Case("deepseek-v3", "deepseek-v3", seed=7001, min_rejected=20),
        lambda: generate(7001, N_CONVERSATIONS) + deepseek_conversations(7101, 150),
        300,
    ),
    # the shared generator passes dicts as arguments in most tool calls: R1 rejects those conversations
    (
        Case("deepseek-r1", "deepseek-r1", seed=7002, min_rejected=100),
        lambda: generate(7002, N_CONVERSATIONS) + deepseek_conversations(7102, 150),
        200,
    ),
    (
        Case("deepseek-r1-string-args", "deepseek-r1", seed=7003, min_rejected=10),
        lambda: _string_args(generate(7003, N_CONVERSATIONS) + deepseek_conversations(7103, 150)),
        300,
    ),
]


@pytest.mark.parametrize("case,convs,min_exact", PARITY, ids=[c.id for c, _, _ in PARITY])
def test_parity(case, convs, min_exact, tokenizers, reference_type_errors_reject) -> None:
    counts = check_parity(case, tokenizers, convs(), min_exact=min_exact)
    assert counts[True]["marker"] + counts[False]["marker"] >= 20, counts


@pytest.mark.parametrize("fixture", ["deepseek-v3", "deepseek-r1"])
def test_parity_edge_cases(fixture, tokenizers, reference_type_errors_reject) -> None:
    ctx = make_ctx(Case(fixture, fixture, seed=-1), tokenizers)
    cases = EDGE_CASES + [(string_arguments(m), t) for m, t in EDGE_CASES]
    failures = []
    for i, (messages, tools) in enumerate(cases):
        for agp in (False, True):
            _, failure = compare(ctx, Conversation(i, -1, messages, tools, {"edge-case"}), agp)
            if failure is not None:
                failures.append(failure)
    assert not failures, "\n\n".join(failures[:4])


def test_family_conversations_cover_the_features() -> None:
    convs = deepseek_conversations(7101, 150)
    tags = [t for c in convs for t in c.tags]
    for tag in (
        "tool-outputs",
        "embedded-think",
        "reasoning_content",
        "content-missing",
        "system-later",
        "marker-text",
    ):
        assert tags.count(tag) >= 5, (tag, sorted(set(tags)))
    runs = [c for c in convs if any(a["role"] == b["role"] == "tool" for a, b in zip(c.messages, c.messages[1:]))]
    after_tools = [
        c
        for c in convs
        if any(a["role"] == "tool" and b["role"] == "assistant" for a, b in zip(c.messages, c.messages[1:]))
    ]
    two_call_turns = [c for c in convs if sum(1 for m in c.messages if m.get("tool_calls")) >= 2]
    assert len(runs) >= 20 and len(after_tools) >= 20 and len(two_call_turns) >= 20


def test_templates_are_selected_by_hash() -> None:
    for family, name in ((V3, "deepseek-v3"), (R1, "deepseek-r1")):
        r = family.renderer()
        assert r.name == name and r.tokenizer.template_sha256 in type(r).template_hashes
        assert r.stop_token_ids == (r.tokenizer.token_id(EOS),) == (1,)
    assert R1.renderer().think_ids == (128798, 128799)
    assert V3.renderer().think_ids is None


# ---- exact renders of the features (read against the templates) --------------------------------


def test_r1_renders_tool_calls_in_deepseek_format() -> None:
    messages = [
        {"role": "system", "content": "S1"},
        {"role": "user", "content": "q"},
        {"role": "system", "content": "S2"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [call("get_weather", '{"city": "Paris"}'), call("search", "{}", 1)],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "nothing"},
        {"role": "assistant", "content": "<think>kept after tools</think>It is sunny."},
        {"role": "user", "content": "and now?"},
        {"role": "assistant", "content": "<think>\ncut\n</think>\n\nDone."},
    ]
    r = R1.renderer()
    text = r.tokenizer.decode(r.render_ids(messages, TOOLS, add_generation_prompt=True))
    assert text == (
        "<｜begin▁of▁sentence｜>S1\n\nS2<｜User｜>q<｜Assistant｜>Let me check.<｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>nothing<｜tool▁output▁end｜><｜tool▁outputs▁end｜><think>kept after tools</think>"
        "It is sunny.<｜end▁of▁sentence｜><｜User｜>and now?<｜Assistant｜>\n\nDone.<｜end▁of▁sentence｜><｜Assistant｜>"
    )
    assert text == R1.reference_text(messages, TOOLS, agp=True)
    # the think block kept after tool outputs is message text: ordinary tokens, where transformers has the ids
    assert not set(r.tokenizer.token_id(t) for t in ("<think>", "</think>")) & set(r.render_ids(messages, TOOLS))


def test_v3_drops_tool_calls_and_rejects_content_less_assistants() -> None:
    r = V3.renderer()
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "x", "tool_calls": [call("search", "{}")]},
    ]
    assert (
        r.tokenizer.decode(r.render_ids(messages))
        == "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜>x<｜end▁of▁sentence｜>"
    )
    with pytest.raises(renderers.TemplateRejected, match="content"):
        r.render(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [call("search", "{}")]},
            ]
        )
    with pytest.raises(jinja2.exceptions.UndefinedError):  # the reference agrees
        V3.reference_text(
            [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call("search", "{}")]}]
        )


def test_r1_rejects_dict_arguments_like_the_template() -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call("search", {"q": 1})]},
    ]
    with pytest.raises(renderers.TemplateRejected, match="JSON string"):
        R1.renderer().render(messages)
    with pytest.raises(TypeError):
        R1.reference_text(messages)


@pytest.mark.parametrize("fixture", ["deepseek-v3", "deepseek-r1"])
def test_attribution(fixture: str, tokenizers) -> None:
    case = Case(fixture, fixture, seed=7301)
    parity_harness.test_content_tokens_come_from_their_message(case, tokenizers)
    parity_harness.test_sampled_tokens_belong_to_assistant_messages(case, tokenizers)


@pytest.mark.parametrize("family", [V3, R1], ids=["deepseek-v3", "deepseek-r1"])
def test_sampled_tokens_are_what_follows_the_generation_prompt(family: Family) -> None:
    """Where the reference is append-stable, an assistant turn's sampled tokens are exactly what its full
    render adds to the prompt (tool-call turns, answers after tool outputs, plain turns)."""
    r = family.renderer()
    checked = 0
    for messages in (
        TOOL_ROUNDS,
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>a"}],
    ):
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = family.reference_ids(messages[:k], TOOLS, agp=True)
            rendered = r.render(messages[: k + 1], TOOLS)
            assert rendered.token_ids == family.reference_ids(messages[: k + 1], TOOLS)
            if rendered.token_ids[: len(prompt)] != prompt:
                continue
            n = len(prompt)
            assert all(rendered.sampled_mask[n:]), (family.id, k)
            assert not any(
                s for s, i in zip(rendered.sampled_mask[:n], rendered.message_indices[:n], strict=True) if i == k
            )
            assert set(rendered.message_indices[len(prompt) :]) == {k}
            checked += 1
    assert checked == 4


# ---- bridge ------------------------------------------------------------------------------------


def _renderable(family: Family, convs: list[Conversation], limit: int) -> list[tuple[list[dict], Any]]:
    """Conversations the reference renders whose text holds no added-token string (the bridge contract
    compares ids exactly; marker text is covered by the parity tests' marker mode)."""
    pattern = marker_regex(family.tok.added_tokens)
    out = []
    for c in convs:
        if contains_marker(c.messages, pattern) or contains_marker(c.tools, pattern):
            continue
        try:
            family.reference_text(c.messages, c.tools)
        except (jinja2.exceptions.TemplateError, TypeError):
            continue
        out.append((c.messages, c.tools))
        if len(out) == limit:
            break
    return out


BRIDGE_CONVERSATIONS = {
    "deepseek-v3": lambda: _renderable(V3, deepseek_conversations(7201, 90) + generate(7202, 60), 120),
    "deepseek-r1": lambda: _renderable(R1, _string_args(deepseek_conversations(7203, 90) + generate(7204, 60)), 120),
}


@pytest.mark.parametrize("retention", ["keep", "template"])
@pytest.mark.parametrize("family", [V3, R1], ids=["deepseek-v3", "deepseek-r1"])
def test_bridge_contract(family: Family, retention: str) -> None:
    counts = check_bridge_contract(
        family, BRIDGE_CONVERSATIONS[family.id](), min_exact=40, thinking_retention=retention
    )
    assert counts["truncated"] >= 20, counts
    if retention == "keep":
        assert counts["kept"] + counts["break"] >= 5, counts  # R1's later tool-call turns, system messages...


def _turn(family: Family, messages: list[dict], k: int, tools=None) -> tuple[list[int], list[int]]:
    """(prompt, completion) for assistant message k, from the reference render."""
    prompt = family.reference_ids(messages[:k], tools, agp=True)
    full = family.reference_ids(messages[: k + 1], tools)
    assert full[: len(prompt)] == prompt
    return prompt, full[len(prompt) :]


TOOL_ROUNDS = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [call("get_weather", '{"city": "Paris"}'), call("get_weather", '{"city": "Rome"}', 1)],
    },
    {"role": "tool", "content": "sunny"},
    {"role": "tool", "content": "rain"},
    {"role": "tool", "content": "(late)"},
    {"role": "assistant", "content": "Paris sunny, Rome rain."},
    {"role": "user", "content": "And Oslo?"},
    {"role": "assistant", "content": "Asking again."},
    {"role": "tool", "content": "snow"},
]


@pytest.mark.parametrize("family", [V3, R1], ids=["deepseek-v3", "deepseek-r1"])
def test_tool_outputs_bridge_append_only(family: Family) -> None:
    """A run of tool outputs after a tool-call turn ends with <｜tool▁outputs▁end｜> and no generation
    prompt; the model answers after it; a later run (the block was opened before) has no block begin."""
    r = family.renderer()
    for k, stop in ((1, 5), (5, 7), (7, 9)):
        prompt, completion = _turn(family, TOOL_ROUNDS, k, TOOLS)
        bridged = r.bridge(prompt, completion, TOOL_ROUNDS[k + 1 : stop], TOOLS)
        assert isinstance(bridged, Bridged), bridged
        assert bridged.token_ids == family.reference_ids(TOOL_ROUNDS[:stop], TOOLS, agp=True)
    last = r.tokenizer.decode(bridged.appended.token_ids)
    sep = "\n" if family is V3 else ""
    assert last == f"{sep}<｜tool▁output▁begin｜>snow<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"


def test_system_message_in_new_messages_breaks() -> None:
    for family in (V3, R1):
        r = family.renderer()
        prompt, completion = _turn(family, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], 1)
        result = r.bridge(
            prompt, completion, [{"role": "system", "content": "new rules"}, {"role": "user", "content": "q2"}]
        )
        assert isinstance(result, Break) and result.reason is BreakReason.SYSTEM_MESSAGE_MOVES and result.position == 1


def _ids(family: Family, text: str) -> list[int]:
    return list(reference(family.tokenizer)(text, add_special_tokens=False)["input_ids"])


def test_r1_reasoning_keep_and_template_retention() -> None:
    prompt = R1.reference_ids([{"role": "user", "content": "2+2?"}], agp=True)
    completion = _ids(R1, "<think>\nadd them\n</think>\n\n4" + EOS)
    new = [{"role": "user", "content": "thanks"}]
    kept = R1.renderer().bridge(prompt, completion, new)
    assert isinstance(kept, Bridged) and kept.token_ids[: kept.prefix_len] == prompt + completion
    assert R1.renderer().tokenizer.decode(kept.appended.token_ids) == "<｜User｜>thanks<｜Assistant｜>"
    brk = R1.renderer(thinking_retention="template").bridge(prompt, completion, new)
    assert isinstance(brk, Break) and brk.reason is BreakReason.TEMPLATE_REWRITES_HISTORY
    assert brk.position == len(prompt)
    # the template indeed re-renders the turn without its reasoning
    rerendered = R1.reference_ids(
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            *new,
        ],
        agp=True,
    )
    assert rerendered[: len(prompt) + len(completion)] != prompt + completion
    stopped = R1.renderer().bridge(prompt, _ids(R1, "<think>\nstill thinking" + EOS), new)
    assert isinstance(stopped, Break) and stopped.reason is BreakReason.STOP_INSIDE_REASONING
    cut = R1.renderer().bridge(prompt, _ids(R1, "<think>\nstill thinking"), new)
    assert isinstance(cut, Break) and cut.reason is BreakReason.TRUNCATED_INSIDE_REASONING


def test_template_retention_breaks_where_tool_call_turns_are_rewritten() -> None:
    calls = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        + EOS
    )
    new = [{"role": "tool", "content": "r"}]
    # V3 does not render tool calls at all
    prompt = V3.reference_ids([{"role": "user", "content": "q"}], agp=True)
    assert isinstance(V3.renderer().bridge(prompt, _ids(V3, calls), new), Bridged)
    brk = V3.renderer(thinking_retention="template").bridge(prompt, _ids(V3, calls), new)
    assert isinstance(brk, Break) and brk.reason is BreakReason.TEMPLATE_REWRITES_HISTORY
    # R1: the first tool-call turn re-renders as sampled; a tool-call turn after tool outputs does not
    r = R1.renderer(thinking_retention="template")
    prompt = R1.reference_ids([{"role": "user", "content": "q"}], agp=True)
    first = r.bridge(prompt, _ids(R1, calls), new)
    assert isinstance(first, Bridged) and first.token_ids == R1.reference_ids(
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [call("search", "{}")]},
            *new,
        ],
        agp=True,
    )
    second = r.bridge(first.token_ids, _ids(R1, calls), [{"role": "tool", "content": "r2"}])
    assert isinstance(second, Break) and second.reason is BreakReason.TEMPLATE_REWRITES_HISTORY
    kept = R1.renderer().bridge(first.token_ids, _ids(R1, calls), [{"role": "tool", "content": "r2"}])
    assert isinstance(kept, Bridged)
    assert (
        r.tokenizer.decode(kept.appended.token_ids)
        == "<｜tool▁output▁begin｜>r2<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )


# ---- parse_response ----------------------------------------------------------------------------

CALL = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def _calls(*bodies: str) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(bodies) + "<｜tool▁calls▁end｜>"


@pytest.mark.parametrize("family", [V3, R1], ids=["deepseek-v3", "deepseek-r1"])
def test_parse_tool_calls(family: Family) -> None:
    r = family.renderer()
    text = (
        "I will check."
        + _calls(
            CALL.format(name="get_weather", args='{"city": "Zürich", "days": 2, "exact": false}'),
            CALL.format(name="search", args='"{\\"q\\": \\"x\\"}"'),  # double-encoded
        )
        + EOS
    )
    completion = _ids(family, text)
    parsed = r.parse_response(completion, tools=TOOLS)
    assert parsed.content == "I will check."
    assert parsed.stop_token_id == 1 and parsed.reasoning_content is None
    first, second = parsed.tool_calls
    assert (first.name, first.arguments, first.status) == (
        "get_weather",
        {"city": "Zürich", "days": 2, "exact": False},
        ToolCallStatus.OK,
    )
    assert (second.name, second.arguments, second.status) == ("search", {"q": "x"}, ToolCallStatus.OK)
    tid = r.tokenizer.token_id
    assert completion[first.token_span[0]] == tid("<｜tool▁call▁begin｜>") and completion[
        first.token_span[1] - 1
    ] == tid("<｜tool▁call▁end｜>")
    assert first.raw.startswith("function<｜tool▁sep｜>get_weather\n```json\n")
    assert parsed.to_message()["tool_calls"][1]["function"] == {"name": "search", "arguments": '{"q": "x"}'}


@pytest.mark.parametrize(
    "body,status",
    [
        (CALL.format(name="get_weather", args='{"city": Paris}'), ToolCallStatus.INVALID_JSON),
        (CALL.format(name="get_weather", args="[1, 2]"), ToolCallStatus.INVALID_ARGUMENTS),
        (CALL.format(name="send_email", args="{}"), ToolCallStatus.UNKNOWN_TOOL),
        (CALL.format(name="", args="{}"), ToolCallStatus.MISSING_NAME),
        ("<｜tool▁call▁begin｜>get_weather\n```json\n{}\n```<｜tool▁call▁end｜>", ToolCallStatus.MISSING_NAME),
        (
            '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "x"}<｜tool▁call▁end｜>',
            ToolCallStatus.INVALID_JSON,
        ),
        ('<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n{"city": "x"}<｜tool▁call▁end｜>', ToolCallStatus.OK),
        ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{}", ToolCallStatus.UNCLOSED),
    ],
)
def test_parse_malformed_tool_calls(body: str, status: ToolCallStatus) -> None:
    r = R1.renderer()
    parsed = r.parse_response(_ids(R1, "ok" + _calls(body) + EOS), tools=TOOLS)
    (got,) = parsed.tool_calls
    assert got.status is status, got
    assert (got.error is None) == (status is ToolCallStatus.OK)
    assert parsed.content == "ok" and parsed.stop_token_id == 1


def test_parse_unclosed_calls() -> None:
    r = R1.renderer()
    tid = r.tokenizer.token_id
    # a call that meets the next call's begin: unclosed, and the next one still parses
    text = _calls(
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{"q": 1}\n```\n'
        + CALL.format(name="search", args="{}")
    )
    completion = _ids(R1, text + EOS)
    first, second = r.parse_response(completion).tool_calls
    assert first.status is ToolCallStatus.UNCLOSED and first.name == "search" and first.arguments == {"q": 1}
    assert completion[first.token_span[1]] == tid("<｜tool▁call▁begin｜>") and second.status is ToolCallStatus.OK
    # the completion ends (truncated, or at a stop id) inside a call
    truncated = _ids(R1, "<｜tool▁calls▁begin｜>" + CALL.format(name="search", args='{"q": 1}')[:-20])
    (call_,) = r.parse_response(truncated).tool_calls
    assert call_.status is ToolCallStatus.UNCLOSED and call_.token_span == (1, len(truncated))
    stopped = truncated + [1] + _ids(R1, "ignored after the stop")
    parsed = r.parse_response(stopped)
    assert parsed.tool_calls[0].status is ToolCallStatus.UNCLOSED and parsed.tool_calls[0].token_span == (
        1,
        len(truncated),
    )
    assert parsed.content == "" and parsed.stop_token_id == 1


def test_parse_r1_reasoning() -> None:
    r = R1.renderer()
    parsed = r.parse_response(_ids(R1, "<think>\nStep 1.\n</think>\n\nThe answer." + EOS))
    assert (parsed.reasoning_content, parsed.content, parsed.reasoning_complete) == ("Step 1.", "The answer.", True)
    # a prompt that opened the think block (later R1 templates end the generation prompt with "<think>\n")
    prompt = R1.reference_ids([{"role": "user", "content": "q"}], agp=True) + _ids(R1, "<think>\n")
    parsed = r.parse_response(_ids(R1, "continued\n</think>\n\nA." + EOS), prompt)
    assert (parsed.reasoning_content, parsed.content) == ("continued", "A.")
    parsed = r.parse_response(_ids(R1, "cut off mid-thought"), prompt)
    assert (
        parsed.reasoning_content == "cut off mid-thought"
        and parsed.reasoning_complete is False
        and parsed.content == ""
    )
    # markers inside reasoning are reasoning text, not calls
    parsed = r.parse_response(
        _ids(R1, "<think>" + _calls(CALL.format(name="search", args="{}")) + "</think>done" + EOS)
    )
    assert parsed.tool_calls == [] and parsed.content == "done"
    # V3's vocabulary has no think tokens: the text is content, also through the R1 class
    v3_tok = V3.tok
    for r_v3 in (V3.renderer(), renderers.create_renderer(v3_tok, name="deepseek-r1")):
        parsed = r_v3.parse_response(_ids(V3, "<think>\nx\n</think>\n\ny" + EOS))
        assert parsed.reasoning_content is None and parsed.content == "<think>\nx\n</think>\n\ny"


def test_parse_text_spelling_markers_is_content() -> None:
    r = R1.renderer()
    prompt_text = "quoted <｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{}\n```<｜tool▁call▁end｜> text"
    ids = r.tokenizer.encode_plain(prompt_text) + [1]
    parsed = r.parse_response(ids)
    assert parsed.tool_calls == [] and parsed.content == prompt_text


# ---- the shared contract checks ----------------------------------------------------------------

ROUND_TRIP_V3 = [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! 你好 👩\u200d💻"}], None),
    (
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "  spaced\n"},
        ],
        TOOLS,
    ),
    (TOOL_ROUNDS[:6], TOOLS),  # the answer after tool outputs
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "b"},
        ],
        None,
    ),
]
ROUND_TRIP_R1 = ROUND_TRIP_V3 + [
    (TOOL_ROUNDS[:2], TOOLS),
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": "Calling.",
                "tool_calls": [call("search", '{"q": "naïve", "n": [1, 2.5, null]}')],
            },
        ],
        TOOLS,
    ),
]


def test_round_trip() -> None:
    assert check_round_trip(V3, ROUND_TRIP_V3) == len(ROUND_TRIP_V3)
    assert check_round_trip(R1, ROUND_TRIP_R1) == len(ROUND_TRIP_R1)


def test_marker_injection_v3() -> None:
    assert check_marker_injection(V3) >= 20


def check_marker_injection_string_args(family: Family) -> int:
    """``family_checks.check_marker_injection`` with the tool call's arguments as a JSON string (R1's
    template rejects a dict there). Same assertions: a literal marker in user or tool content or in the
    arguments is text, never the special id."""
    r = family.renderer()
    tok = r.tokenizer
    markers = sorted(tok.added_tokens, key=len, reverse=True)[:40] + ["<think>", "</think>"]

    def conversation(s: str) -> list[dict]:
        return [
            {"role": "user", "content": f"before {s} after"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("echo", json.dumps({"text": f"x{s}y"}, ensure_ascii=False))],
            },
            {"role": "tool", "tool_call_id": "c0", "content": f"{s}result"},
            {"role": "user", "content": f"{s}"},
        ]

    specials = set(tok.added_tokens.values())
    for marker in markers:
        with_marker = r.render(conversation(marker), add_generation_prompt=True)
        plain = r.render(conversation("word"), add_generation_prompt=True)
        got = [t for t in with_marker.token_ids if t in specials]
        assert got == [t for t in plain.token_ids if t in specials], f"the literal {marker!r} became a special token"
        assert marker in tok.decode(with_marker.token_ids)
        assert not any(c and t in specials for t, c in zip(with_marker.token_ids, with_marker.is_content, strict=True))
    return len(markers)


def test_marker_injection_r1() -> None:
    assert check_marker_injection_string_args(R1) >= 20


@pytest.mark.parametrize("family", [V3, R1], ids=["deepseek-v3", "deepseek-r1"])
def test_parse_fuzz(family: Family) -> None:
    completions = [
        _ids(
            family,
            "<think>\nr\n</think>\n\nok"
            + _calls(CALL.format(name="search", args='{"q": 1}'), CALL.format(name="x", args="["))
            + EOS,
        ),
        _ids(family, "plain answer" + EOS),
        _ids(family, "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n{}<｜tool▁calls▁end｜>" + EOS),
    ]
    prompt = family.reference_ids([{"role": "user", "content": "q"}], agp=True)
    check_parse_fuzz(family, completions, prompt)
    check_parse_fuzz(family, completions[:1], prompt + _ids(family, "<think>\n"))
