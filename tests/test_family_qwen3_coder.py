"""Qwen3-Coder: token parity with transformers, the bridge contract, XML tool-call parsing with schema
coercion, render -> parse round trips, marker injection and parse fuzzing.

The shared generator sends tool-call arguments as JSON strings in ~40% of its calls. transformers
cannot render those with this template (its ``arguments|items`` raises a ``TypeError``, which the
shared harness does not treat as a rejection), while the renderer decodes a JSON object string the
way vLLM does before applying this template. So the harness gets the conversations with those
arguments decoded, and ``test_json_string_arguments`` checks that the renderer's output for the
original conversation is the reference's for the decoded one (and that a string that is not a JSON
object is rejected, as the reference fails on it).
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from typing import Any

import pytest

import tito_renderers as renderers
from tito_renderers import Break, Bridged, ToolCallStatus
from tito_renderers.qwen3_coder import Qwen3CoderRenderer

from ._support import ours, reference
from .convgen import Conversation, contains_marker, generate, marker_regex
from .family_checks import Family, check_bridge_contract, check_marker_injection, check_parse_fuzz, check_round_trip
from .test_parity import N_CONVERSATIONS, Case, check_parity

TOK = "qwen3-coder-30b-a3b-instruct"
FAMILY = Family("qwen3-coder", TOK)
SEED = 7301

# ---- conversations exercising the family's features ------------------------------------------------

EVERY_TYPE_TOOL = {
    "type": "function",
    "function": {
        "name": "configure",
        "description": "  Configure the build.\nTwo lines, padded.  ",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "description": "A file path."},
                "retries": {"type": "integer", "minimum": 0, "default": 3},
                "ratio": {"type": "number", "default": 0.5},
                "force": {"type": "boolean", "default": False},
                "options": {"type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": True},
                "targets": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "nothing": {"type": "null"},
                "label": {"type": ["string", "null"], "default": None},
                "mode": {"type": "string", "enum": ["fast", "slow"]},
                "size": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                "untyped": {"description": "no type at all"},
            },
            "required": ["path"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
SECOND_TOOL = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a file.",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string", "description": "\nfile text\n"}},
            "required": ["path", "content"],
        },
    },
}
BARE_TOOL = {"name": "ping"}  # flat form, no description, no parameters
ODD_TOOL = {
    "type": "function",
    "function": {
        "name": "odd",
        "parameters": {
            "type": "object",
            "properties": {
                "x": "not-a-schema",
                "y": {"type": "integer", "examples": [1, {"a": None}], "deprecated": True, "default": 1e20},
            },
        },
    },
}
CODER_TOOLS = [EVERY_TYPE_TOOL, SECOND_TOOL]

MULTILINE = (
    "def f(x):\n    return x\n",
    "\nleading newline",
    "trailing newline\n",
    "\n\nboth\n\n",
    "a\r\nb",
    "",
    " ",
    "\n",
)


def typed_value(r: random.Random, kind: str) -> Any:
    """A value of one JSON-schema type, as a model's caller would pass it."""
    if kind == "string":
        return r.choice(
            (
                "src/main.py",
                "Zürich 東京 🙂",
                'say "hi"',
                "back\\slash",
                "</parameter> inside",
                "True",
                "42",
                *MULTILINE,
            )
        )
    if kind == "integer":
        return r.choice((0, 1, -7, 2**53 + 1, 10**20))
    if kind == "number":
        return r.choice((0.5, -2.0, 3.14159, 1e-7, 1e20, 0.1 + 0.2, 7))
    if kind == "boolean":
        return r.choice((True, False))
    if kind == "object":
        return r.choice(({}, {"k": "v", "n": [1, 2.5, None, True]}, {"nested": {"deep": {"x": "ü\n"}}}))
    if kind == "array":
        return r.choice(([], ["a", "b"], [1, {"k": False}, None, "x\ny"]))
    return None  # null


def every_type_arguments(r: random.Random) -> dict:
    args = {"path": typed_value(r, "string")}
    for key, kind in (
        ("retries", "integer"),
        ("ratio", "number"),
        ("force", "boolean"),
        ("options", "object"),
        ("targets", "array"),
        ("nothing", "null"),
    ):
        if r.random() < 0.7:
            args[key] = typed_value(r, kind)
    if r.random() < 0.5:
        args["label"] = r.choice(("tag", None))
    if r.random() < 0.3:
        args["size"] = r.choice((12, "large"))
    keys = list(args)
    r.shuffle(keys)
    return {k: args[k] for k in keys}


def coder_call(r: random.Random, j: int, as_string: bool = False) -> dict:
    if r.random() < 0.7:
        name, args = "configure", every_type_arguments(r)
    else:
        name, args = "write_file", {"path": "out.txt", "content": r.choice(MULTILINE + ("x = 1\n\n\ny = 2",))}
    call: dict[str, Any] = {
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args) if as_string else args},
    }
    if r.random() < 0.7:
        call["id"] = f"call_{j}"
    return call


def coder_conversations(seed: int, n: int) -> list[Conversation]:
    """Tool definitions with every schema type, calls with arguments of every type, several calls per
    message, multiline and newline-edged string values, content around the calls, results in a row."""
    r = random.Random(seed)
    out = []
    for index in range(n):
        tags = {"coder"}
        tools = r.choice((CODER_TOOLS, CODER_TOOLS + [BARE_TOOL, ODD_TOOL], [SECOND_TOOL], None))
        msgs: list[dict] = []
        if r.random() < 0.5:
            msgs.append({"role": "system", "content": r.choice(("You write code.", "", "  padded system \n"))})
        msgs.append(
            {
                "role": "user",
                "content": r.choice(("Set it up.", "Fix the bug\nplease", "  spaced  ", "<tool_call> is text")),
            }
        )
        for _ in range(r.randint(1, 3)):
            content = r.choice((None, "", "\n", "I will call the tools.", "  padded \n\n", "Line 1\nLine 2"))
            calls = [coder_call(r, j, as_string=False) for j in range(r.choice((1, 2, 3)))]
            message: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
            if content is not None:
                message["content"] = content
            msgs.append(message)
            for j in range(r.choice((1, len(calls), 3))):
                msgs.append(
                    {
                        "role": "tool",
                        "tool_call_id": f"call_{j}",
                        "content": r.choice(("ok", "", "line\nline\n", '{"exit": 0}')),
                    }
                )
            tags.add("tool-run")
        ending = r.choices(("assistant", "user", "tool", "nothing"), weights=(30, 30, 30, 4))[0]
        if ending == "assistant":
            msgs.append({"role": "assistant", "content": r.choice(("Done.", "\nDone.\n", ""))})
        elif ending == "nothing":
            msgs.append({"role": "assistant"})  # neither content nor calls: the template rejects it
            tags.add("content-none")
        elif ending == "user":
            msgs.append({"role": "user", "content": "and now?"})
        out.append(Conversation(index, seed, msgs, tools, tags))
    return out


def decode_string_arguments(messages: list[dict]) -> list[dict] | None:
    """``messages`` with every JSON-object string of tool-call arguments decoded; None when one is a
    string that does not hold a JSON object."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or ():
            fn = call.get("function", call)
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    return None
                if not isinstance(fn["arguments"], dict):
                    return None
    return out


def has_string_arguments(messages: list[dict]) -> bool:
    return any(
        isinstance(c.get("function", c).get("arguments"), str) for m in messages for c in m.get("tool_calls") or ()
    )


def harness_conversations(seed: int) -> list[Conversation]:
    """The shared generator's conversations (string arguments decoded; the few that hold no JSON
    object left out: see test_json_string_arguments) plus the family's own."""
    convs = []
    for conv in generate(seed, N_CONVERSATIONS):
        decoded = decode_string_arguments(conv.messages)
        if decoded is not None:
            convs.append(Conversation(conv.index, conv.seed, decoded, conv.tools, conv.tags))
    assert len(convs) >= 300, len(convs)
    return convs + coder_conversations(seed + 1, 120)


def ids(text: str) -> list[int]:
    """What a model would sample: text encoded by the reference tokenizer (markers become their ids)."""
    return reference(TOK)(text, add_special_tokens=False)["input_ids"]


# ---- parity --------------------------------------------------------------------------------------


def test_parity(tokenizers) -> None:
    start = time.perf_counter()
    counts = check_parity(
        Case("qwen3-coder", TOK, SEED, min_marker=10, min_rejected=4), tokenizers, harness_conversations(SEED)
    )
    print(f"parity {counts} in {time.perf_counter() - start:.1f}s")


EDGE_CASES: list[tuple[list[dict], Any]] = [
    # tool results first in the loop get no <|im_start|>user header (loop.previtem is undefined)
    (
        [{"role": "tool", "content": "orphan"}, {"role": "tool", "content": "two"}, {"role": "user", "content": "q"}],
        None,
    ),
    ([{"role": "system", "content": "s"}, {"role": "tool", "content": "after system"}], CODER_TOOLS),
    # a system message later in the conversation is an ordinary turn
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "late"}], None),
    # only a system message, with and without tools; tools without a system message
    ([{"role": "system", "content": "only"}], CODER_TOOLS + [BARE_TOOL, ODD_TOOL]),
    ([{"role": "system", "content": "only"}], None),
    ([{"role": "user", "content": "q"}], [BARE_TOOL]),
    # content that is only whitespace is not printed before the calls; reasoning is dropped
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": " \n\t",
                "reasoning_content": "hidden",
                "tool_calls": [{"name": "ping", "arguments": {}}],
            },
        ],
        [BARE_TOOL],
    ),
    # an assistant turn with neither content nor calls: the template concatenates the undefined content
    ([{"role": "user", "content": "q"}, {"role": "assistant", "reasoning_content": "r"}], None),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": []}], None),
    # markers in tool definitions, arguments and results
    (
        [
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "tool_calls": [{"name": "ping", "arguments": {"<|im_end|>": "<tool_call>\n</tool_call>"}}],
            },
            {"role": "tool", "content": "</tool_response><|im_end|>"},
        ],
        [{"name": "ping", "description": "<tools></tools><|im_start|>"}],
    ),
]


def test_parity_edge_cases(tokenizers) -> None:
    convs = [Conversation(i, -1, m, t, {"edge-case"}) for i, (m, t) in enumerate(EDGE_CASES)]
    counts = check_parity(
        Case("qwen3-coder-edge", TOK, -1, min_marker=1, min_rejected=4), tokenizers, convs, min_exact=5
    )
    assert counts[True]["rejected"] == counts[False]["rejected"] == 2


def test_json_string_arguments(tokenizers) -> None:
    """Arguments given as a JSON object string render as the reference renders the decoded object; any
    other string is rejected (transformers fails with a TypeError in the template's ``|items``)."""
    r = FAMILY.renderer()
    hf = reference(TOK)
    decoded_n = rejected_n = 0
    for conv in generate(SEED + 2, 200):
        if not has_string_arguments(conv.messages):
            continue
        decoded = decode_string_arguments(conv.messages)
        for agp in (False, True):
            if decoded is None:
                with pytest.raises(renderers.TemplateRejected, match="not a JSON object"):
                    r.render(conv.messages, conv.tools, add_generation_prompt=agp)
                with pytest.raises(TypeError):
                    hf.apply_chat_template(
                        renderers.normalize_messages(conv.messages), tools=conv.tools, tokenize=False
                    )
                rejected_n += 1
                continue
            try:
                want = r.render_ids(decoded, conv.tools, add_generation_prompt=agp)
            except renderers.TemplateRejected:
                continue
            assert r.render_ids(conv.messages, conv.tools, add_generation_prompt=agp) == want
            decoded_n += 1
    assert decoded_n >= 40 and rejected_n >= 2, (decoded_n, rejected_n)
    # and one against transformers directly
    call = {
        "type": "function",
        "function": {"name": "configure", "arguments": '{"retries": 2, "force": true, "targets": ["a"]}'},
    }
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    want_text = hf.apply_chat_template(decode_string_arguments(msgs), tools=CODER_TOOLS, tokenize=False)
    assert "<parameter=force>\nTrue\n</parameter>" in want_text
    assert r.render_ids(msgs, CODER_TOOLS) == hf(want_text, add_special_tokens=False)["input_ids"]


# ---- selection, stop ids, capabilities --------------------------------------------------------------


def test_selected_by_hash_with_stop_ids() -> None:
    tok = ours(TOK)
    r = renderers.create_renderer(tok)
    assert isinstance(r, Qwen3CoderRenderer) and r.name == "qwen3-coder"
    assert tok.template_sha256 in Qwen3CoderRenderer.template_hashes
    assert r.stop_token_ids == (tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")) == (151645, 151643)
    assert r.tool_call_ids == (151657, 151658)
    caps = r.capabilities
    assert caps.tools and caps.bridge and not caps.thinking_switch and caps.reasoning_efforts == ()
    with pytest.raises(ValueError, match="enable_thinking"):
        renderers.create_renderer(tok, enable_thinking=True)


def test_sampled_tokens_are_the_completion() -> None:
    """The sampled tokens of a tool-call turn are exactly what follows the generation prompt."""
    r = FAMILY.renderer()
    call = {"name": "write_file", "arguments": {"path": "a.py", "content": "\nprint(1)\n"}}
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": " I'll write it. ", "tool_calls": [call, call]},
        {"role": "tool", "content": "ok"},
    ]
    rendered = r.render(msgs, CODER_TOOLS)
    sampled = [t for t, s in zip(rendered.token_ids, rendered.sampled_mask, strict=True) if s]
    block = "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n\nprint(1)\n\n</parameter>\n</function>\n</tool_call>"
    assert r.tokenizer.decode(sampled) == f"I'll write it.\n\n{block}\n{block}<|im_end|>"
    prompt = r.render_ids(msgs[:1], CODER_TOOLS, add_generation_prompt=True)
    assert rendered.token_ids[: len(prompt)] == prompt
    assert not any(rendered.sampled_mask[: len(prompt)])


def test_sampled_mask_is_exactly_each_completion() -> None:
    """For every assistant turn whose render extends the generation prompt, the tokens marked sampled
    (and attributed to it) are exactly the tokens after that prompt, through the turn's close."""
    r = FAMILY.renderer()
    checked = 0
    for conv in coder_conversations(SEED + 6, 30) + generate(SEED + 7, 40):
        messages = decode_string_arguments(conv.messages)
        if messages is None:
            continue
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or k == 0:
                continue
            try:
                full = r.render(messages[: k + 1], conv.tools)
            except renderers.TemplateRejected:
                break
            prompt = r.render_ids(messages[:k], conv.tools, add_generation_prompt=True)
            if full.token_ids[: len(prompt)] != prompt:
                continue  # content with leading whitespace merges with the prompt's "\n"
            sampled = [i for i, s in enumerate(full.sampled_mask) if s and i >= len(prompt)]
            assert sampled == list(range(len(prompt), len(full) - 1)), conv.label()
            assert full.token_ids[-2] == r.turn_close_id and not full.sampled_mask[-1]
            assert all(full.message_indices[i] == k for i in sampled)
            assert all(
                messages[j]["role"] == "assistant"
                for j, s in zip(full.message_indices, full.sampled_mask, strict=True)
                if s
            )
            checked += 1
    assert checked >= 60, checked


# ---- bridge --------------------------------------------------------------------------------------


def bridge_conversations() -> list[tuple[list[dict], Any]]:
    """Conversations without marker text (the contract compares ids exactly; markers in message text
    are encoded as text on purpose: test_marker_injection covers them) that do not start with an
    assistant turn (transformers refuses to render the empty history before it)."""
    pattern = marker_regex(ours(TOK).added_tokens)
    convs = []
    for c in coder_conversations(SEED + 3, 40) + generate(SEED + 4, 60):
        decoded = decode_string_arguments(c.messages)
        if decoded is None or decoded[0]["role"] == "assistant":
            continue
        if not contains_marker(decoded, pattern) and not contains_marker(c.tools, pattern):
            convs.append((decoded, c.tools))
    return convs


def test_bridge_contract() -> None:
    convs = bridge_conversations()
    counts = check_bridge_contract(FAMILY, convs, min_exact=40)
    assert counts["truncated"] >= 20 and counts["break"] == 0, counts
    # "template": the reference's own turns re-render identically, except where parsing trims content
    counts = check_bridge_contract(FAMILY, convs, min_exact=40, thinking_retention="template")
    assert counts["break"] >= 1, counts


def test_bridge_keeps_what_the_model_sampled() -> None:
    """A completion the template would re-render differently (padding around the calls, Hermes JSON
    instead of XML) is kept as sampled and extended; an assistant message in the new messages breaks."""
    r = FAMILY.renderer()
    hf = reference(TOK)
    msgs = [{"role": "user", "content": "q"}]
    prompt = r.render_ids(msgs, CODER_TOOLS, add_generation_prompt=True)
    completion = hf(
        "  padded\n<tool_call>\n<function=ping>\n</function>\n</tool_call>  <|im_end|>", add_special_tokens=False
    )["input_ids"]
    new = [{"role": "tool", "content": "pong"}, {"role": "tool", "content": "again"}]
    result = r.bridge(prompt, completion, new, CODER_TOOLS)
    assert isinstance(result, Bridged)
    assert result.token_ids[: result.prefix_len] == prompt + completion
    assert r.tokenizer.decode(result.appended.token_ids) == (
        "\n<|im_start|>user\n<tool_response>\npong\n</tool_response>\n<tool_response>\nagain\n</tool_response>\n"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert set(result.appended.message_indices) == {-1, 0, 1}
    brk = r.bridge(prompt, completion, [{"role": "assistant", "content": "x"}])
    assert isinstance(brk, Break) and brk.reason is renderers.BreakReason.ASSISTANT_IN_NEW_MESSAGES
    bad = r.bridge(prompt, completion, [{"role": "tool"}])
    assert isinstance(bad, Break) and bad.reason is renderers.BreakReason.INVALID_MESSAGES


def test_bridge_reasoning_breaks() -> None:
    """The template has no reasoning, but the vocabulary has think tokens: an unclosed think block
    cannot be closed by the turn's end; a closed one is kept ("keep") or breaks ("template")."""
    keep, template = FAMILY.renderer(), FAMILY.renderer(thinking_retention="template")
    prompt = keep.render_ids([{"role": "user", "content": "q"}], add_generation_prompt=True)
    new = [{"role": "user", "content": "next"}]
    unclosed = ids("<think>\nhmm<|im_end|>")
    assert keep.bridge(prompt, unclosed, new).reason is renderers.BreakReason.STOP_INSIDE_REASONING
    assert keep.bridge(prompt, unclosed[:-1], new).reason is renderers.BreakReason.TRUNCATED_INSIDE_REASONING
    closed = ids("<think>\nhmm\n</think>\n\nanswer<|im_end|>")
    assert isinstance(keep.bridge(prompt, closed, new), Bridged)
    brk = template.bridge(prompt, closed, new)
    assert isinstance(brk, Break) and brk.reason is renderers.BreakReason.TEMPLATE_REWRITES_HISTORY
    assert brk.position == len(prompt)
    assert isinstance(template.bridge(prompt, ids("answer<|im_end|>"), new), Bridged)


@pytest.mark.parametrize(
    "completion,rewritten",
    [
        (
            "<tool_call>\n<function=configure>\n<parameter=force>\nTrue\n</parameter>\n</function>\n</tool_call><|im_end|>",
            None,
        ),
        ("hi\n\n<tool_call>\n<function=configure>\n</function>\n</tool_call><|im_end|>", None),
        ("Hello there.<|im_end|>", None),
        ("Hello there.", None),  # truncated: the close is synthesized, as the template would write it
        # a JSON-style boolean comes back as Python's True: the drift the bridge exists to avoid
        (
            "<tool_call>\n<function=configure>\n<parameter=force>\ntrue\n</parameter>\n</function>\n</tool_call><|im_end|>",
            "force>\n",
        ),
        ("  hi  \n\n<tool_call>\n<function=configure>\n</function>\n</tool_call><|im_end|>", ""),
        ("Hello there.<|endoftext|>", "there."),  # another stop id: the template closes with <|im_end|>
        (
            "<tool_call>\n<function=configure>\n<parameter=retries>\nx\n</parameter>\n</function>\n</tool_call><|im_end|>",
            "",
        ),
    ],
)
def test_bridge_template_retention(completion: str, rewritten: str | None) -> None:
    """thinking_retention="template": a Break where re-rendering the parsed turn would not give back the
    sampled tokens (position: the first that differs); with "keep" every one of them is extended."""
    keep, template = FAMILY.renderer(), FAMILY.renderer(thinking_retention="template")
    prompt = keep.render_ids([{"role": "user", "content": "q"}], CODER_TOOLS, add_generation_prompt=True)
    sampled = ids(completion)
    new = [{"role": "tool", "content": "ok"}]
    assert isinstance(keep.bridge(prompt, sampled, new, CODER_TOOLS), Bridged)
    result = template.bridge(prompt, sampled, new, CODER_TOOLS)
    if rewritten is None:
        assert isinstance(result, Bridged) and result.token_ids[: result.prefix_len] == prompt + sampled
        return
    assert isinstance(result, Break) and result.reason is renderers.BreakReason.TEMPLATE_REWRITES_HISTORY
    assert keep.tokenizer.decode(sampled[: result.position - len(prompt)]).endswith(rewritten)


# ---- round trip ----------------------------------------------------------------------------------


def _typed(value: Any) -> Any:
    """A value with its types spelled out, so that True != 1 and 1 != 1.0 in comparisons."""
    if isinstance(value, dict):
        return {k: _typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return ("nan",)
    return (type(value).__name__, value)


def round_trip_cases() -> list[tuple[list[dict], Any]]:
    r = random.Random(SEED + 5)
    cases = []
    for _ in range(60):
        calls = [coder_call(r, j) for j in range(r.choice((1, 2, 3)))]
        content = r.choice(("", "Let me do that.", "Two\nlines"))
        cases.append(
            (
                [{"role": "user", "content": "go"}, {"role": "assistant", "content": content, "tool_calls": calls}],
                CODER_TOOLS,
            )
        )
    every = {
        "path": "\n\n x \n\n",
        "retries": 2**53 + 1,
        "ratio": 0.1 + 0.2,
        "force": False,
        "options": {"a": [1, None]},
        "targets": [],
        "nothing": None,
        "label": None,
        "size": 7,
    }
    cases.append(
        (
            [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [{"name": "configure", "arguments": every}]},
            ],
            CODER_TOOLS,
        )
    )
    cases.append(([{"role": "user", "content": "go"}, {"role": "assistant", "content": "plain answer"}], CODER_TOOLS))
    return cases


def test_round_trip_with_types() -> None:
    """render -> parse returns every call's arguments with their original types (the shared check
    compares with ==, where True == 1; this compares the types too)."""
    cases = round_trip_cases()
    assert check_round_trip(FAMILY, cases) == len(cases)
    r = FAMILY.renderer()
    for messages, tools in cases:
        prompt = r.render_ids(messages[:-1], tools, add_generation_prompt=True)
        completion = r.render_ids(messages, tools)[len(prompt) :]
        parsed = r.parse_response(completion, prompt, tools)
        want = [c["function"]["arguments"] for c in renderers.normalize_messages(messages)[-1].get("tool_calls", [])]
        assert [_typed(c.arguments) for c in parsed.tool_calls] == [_typed(a) for a in want]


def test_round_trip_of_non_finite_numbers() -> None:
    r = FAMILY.renderer()
    msgs = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "configure", "arguments": {"ratio": float("-inf"), "retries": 3.0}}],
        },
    ]
    prompt = r.render_ids(msgs[:1], CODER_TOOLS, add_generation_prompt=True)
    parsed = r.parse_response(r.render_ids(msgs, CODER_TOOLS)[len(prompt) :], prompt, CODER_TOOLS)
    (call,) = parsed.tool_calls
    assert call.status is ToolCallStatus.OK
    assert call.arguments == {"ratio": float("-inf"), "retries": 3} and type(call.arguments["retries"]) is int


# ---- marker injection and fuzz -----------------------------------------------------------------------


def test_marker_injection() -> None:
    assert check_marker_injection(FAMILY) >= 20


def test_parse_fuzz() -> None:
    r = FAMILY.renderer()
    completions = []
    for messages, tools in round_trip_cases()[:6]:
        prompt = r.render_ids(messages[:-1], tools, add_generation_prompt=True)
        completions.append(r.render_ids(messages, tools)[len(prompt) :])
    check_parse_fuzz(FAMILY, completions)
