"""The renderer contract checks every family module runs: bridge vs the reference's full render,
render -> parse round trip, marker injection, and parse_response fuzzing.

A family test module builds a :class:`Family` (a fixture tokenizer, optionally another template
from ``../shared/fixtures/templates`` and template kwargs) and calls the ``check_*`` functions with
its own conversations. The reference is always transformers' ``apply_chat_template`` on
``normalize_messages(messages)``, tokenized with ``add_special_tokens=False``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tito_renderers as renderers
from tito_renderers import Break, BreakReason, Bridged, ToolCallStatus

from ._support import fixtures_dir, ours, reference


@dataclass(frozen=True)
class Family:
    """One template under test: a fixture tokenizer, its own template or a fixture template file."""

    id: str
    tokenizer: str
    template_file: str | None = None  # a file in ../shared/fixtures/templates; None: the tokenizer's own
    renderer_name: str | None = None  # None: chosen by template hash
    kwargs: dict = field(default_factory=dict, hash=False)

    @functools.cached_property
    def template(self) -> str:
        if self.template_file is None:
            return reference(self.tokenizer).chat_template
        return (fixtures_dir() / "templates" / self.template_file).read_text(encoding="utf-8")

    @functools.cached_property
    def tok(self) -> renderers.Tokenizer:
        base = ours(self.tokenizer)
        if self.template_file is None:
            return base
        return base.with_chat_template(self.template, Path(self.template_file).stem)

    def renderer(self, **kw: Any) -> renderers.Renderer:
        return renderers.create_renderer(self.tok, name=self.renderer_name, **{**self.kwargs, **kw})

    def reference_text(self, messages: list[dict], tools: Any = None, agp: bool = False, **kw: Any) -> str:
        hf = reference(self.tokenizer)
        return hf.apply_chat_template(
            renderers.normalize_messages(messages), tools=tools, tokenize=False, add_generation_prompt=agp,
            chat_template=self.template, **{**self.kwargs, **kw},
        )

    def reference_ids(self, messages: list[dict], tools: Any = None, agp: bool = False, **kw: Any) -> list[int]:
        hf = reference(self.tokenizer)
        return list(hf(self.reference_text(messages, tools, agp, **kw), add_special_tokens=False)["input_ids"])


# ---- bridge ------------------------------------------------------------------------------------


def sampled_completion(renderer: renderers.Renderer, prompt: list[int], full: list[int]) -> list[int] | None:
    """What the model sampled for the turn that ``full`` adds to ``prompt``: up to and including the
    last stop token of the renderer in the added tokens (None when the reference is not append-stable
    at this turn or the turn has no stop token)."""
    if full[: len(prompt)] != prompt:
        return None
    rest = full[len(prompt) :]
    ends = [i for i, t in enumerate(rest) if t in renderer.stop_token_ids]
    return rest[: ends[-1] + 1] if ends else None


@dataclass(frozen=True)
class BridgeCase:
    """One assistant turn ``k`` followed by ``new`` messages, with the reference's ids: ``prompt`` (up to
    the turn, generation prompt included), ``completion`` (what the model sampled for it) and ``expected``
    (the render up to the next assistant turn); ``stable``: ``expected`` extends prompt + completion."""

    k: int
    messages: list[dict]
    tools: Any
    new: list[dict]
    prompt: list[int]
    completion: list[int]
    expected: list[int]

    @property
    def stable(self) -> bool:
        return self.expected[: len(self.prompt) + len(self.completion)] == self.prompt + self.completion


def bridge_cases(family: Family, r: renderers.Renderer, conversations: list[tuple[list[dict], Any]],
                 counts: dict | None = None) -> Iterator[BridgeCase]:
    """Every assistant turn of ``conversations`` followed by non-assistant messages that the reference can
    be compared on; each turn passed over for a reason is counted in ``counts["skipped"]``."""
    for messages, tools in conversations:
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            nxt = next((j for j in range(k + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
            new = messages[k + 1 : nxt]
            if not new:
                continue
            completion = None
            # a marker: transformers would turn it into its id (parity tests cover these)
            if not _has_marker(r.tokenizer, family.template, messages[:nxt], tools):
                try:
                    prompt = family.reference_ids(messages[:k], tools, agp=True)
                    full = family.reference_ids(messages[: k + 1], tools)
                    expected = family.reference_ids(messages[:nxt], tools, agp=True)
                    completion = sampled_completion(r, prompt, full)
                except (jinja2.exceptions.TemplateError, TypeError):
                    pass  # the template rejects a prefix (e.g. an empty history)
            if completion is None:
                if counts is not None:
                    counts["skipped"] += 1
                continue
            yield BridgeCase(k, messages, tools, new, prompt, completion, expected)


def check_bridge_contract(family: Family, conversations: list[tuple[list[dict], Any]], min_exact: int = 5, **kw: Any) -> dict:
    """For every assistant turn k followed by non-assistant messages: bridge(prompt_k, completion_k,
    new messages) must equal the reference's render of the conversation up to the next assistant turn
    wherever the reference itself is append-only there; elsewhere it must be a ``Break`` with a
    documented reason or keep the sampled prefix exactly. The same with the completion truncated
    before its close: the close is synthesized, marked, and the result still equals the reference.
    Returns counts."""
    r = family.renderer(**kw)
    counts = {"exact": 0, "break": 0, "kept": 0, "truncated": 0, "skipped": 0}
    for case in bridge_cases(family, r, conversations, counts):
        prompt, completion, new, expected = case.prompt, case.completion, case.new, case.expected
        result = r.bridge(prompt, completion, new, case.tools)
        if isinstance(result, Break):
            assert result.reason in set(BreakReason), result
            assert not case.stable or result.reason is not BreakReason.NO_SPECIAL_TOKEN_ANCHOR, result
            counts["break"] += 1
            continue
        assert isinstance(result, Bridged)
        assert result.token_ids[: result.prefix_len] == prompt + completion, "the bridge changed the prefix"
        assert result.prefix_len == len(prompt) + len(completion)
        assert len(result.appended) == len(result.token_ids) - result.prefix_len
        if not case.stable:
            counts["kept"] += 1
            continue
        assert result.token_ids == expected, _diff(r, result.token_ids, expected, f"{family.id} turn {case.k}")
        assert all(0 <= i < len(new) or i == -1 for i in result.appended.message_indices)
        assert not any(result.appended.sampled_mask), "appended tokens are never sampled"
        counts["exact"] += 1
        if completion[-1] == r.turn_close_id and len(completion) > 1:
            cut = r.bridge(prompt, completion[:-1], new, case.tools)
            assert isinstance(cut, Bridged), cut
            assert cut.synthesized >= 1 and cut.token_ids == expected, _diff(r, cut.token_ids, expected, "truncated")
            counts["truncated"] += 1
    assert counts["exact"] >= min_exact, f"[{family.id}] too few bridges compared exactly: {counts}"
    return counts


def _has_marker(tok: renderers.Tokenizer, template: str, messages: list[dict], tools: Any) -> bool:
    """Message text holds a marker: a special added token, or a non-blank added token the template
    itself uses (Qwen's ``<think>`` is not flagged special). Gemma's thousands of plain added tokens
    (``<b>``, tab runs) are ordinary text to the model and to tito alike."""
    text = json.dumps([messages, tools], ensure_ascii=False)
    decoder = tok.backend.get_added_tokens_decoder().values()
    markers = [t.content for t in decoder if t.special or (t.content.strip() and t.content in template)]
    return any(m in text for m in markers)


def _diff(r: renderers.Renderer, ours_ids: list[int], ref: list[int], what: str) -> str:
    i = next((j for j, (a, b) in enumerate(zip(ours_ids, ref, strict=False)) if a != b), min(len(ours_ids), len(ref)))
    dec = r.tokenizer.decode
    return (
        f"{what}: first difference at token {i} (ours {len(ours_ids)}, reference {len(ref)})\n"
        f"  ours: {dec(ours_ids[max(0, i - 6) : i])!r} >>> {dec(ours_ids[i : i + 8])!r}\n"
        f"  ref:  {dec(ref[max(0, i - 6) : i])!r} >>> {dec(ref[i : i + 8])!r}"
    )


# ---- round trip --------------------------------------------------------------------------------


def same_json(a: Any, b: Any) -> bool:
    """Equal values of equal JSON types: ``True`` is not ``1`` and ``1`` is not ``1.0`` here, unlike ``==``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _arguments(call: dict) -> Any:
    args = call["function"]["arguments"]
    return json.loads(args) if isinstance(args, str) else args


def check_round_trip(
    family: Family, cases: list[tuple[list[dict], Any]], normalize=lambda s: s, **kw: Any
) -> int:
    """Each case ends with an assistant message. Its tokens as our renderer renders them after the
    generation prompt (the completion a model would have sampled) must parse back into the message:
    content and reasoning (stripped), tool call names and arguments, status ok, and a stop token.
    ``normalize`` maps expected text the way the tokenizer's normalizer does. Returns cases checked."""
    r = family.renderer(**kw)
    checked = 0
    for messages, tools in cases:
        assert messages[-1]["role"] == "assistant"
        prompt = r.render_ids(messages[:-1], tools, add_generation_prompt=True)
        full = r.render_ids(messages, tools)
        assert full[: len(prompt)] == prompt, f"[{family.id}] the last assistant turn does not extend the generation prompt"
        completion = full[len(prompt) :]
        stop = [i for i, t in enumerate(completion) if t in r.stop_token_ids]
        assert stop, f"[{family.id}] the rendered assistant turn has no stop token"
        parsed = r.parse_response(completion[: stop[-1] + 1], prompt, tools)
        want = renderers.normalize_messages(messages)[-1]
        assert parsed.content == normalize(want.get("content") or "").strip(), (parsed, want)
        if want.get("reasoning_content"):
            assert parsed.reasoning_content == normalize(want["reasoning_content"]).strip(), (parsed, want)
        assert parsed.stop_token_id == completion[stop[-1]]
        calls = want.get("tool_calls", [])
        assert [c.name for c in parsed.tool_calls] == [c["function"]["name"] for c in calls], parsed
        got, expected = [c.arguments for c in parsed.tool_calls], [_arguments(c) for c in calls]
        assert same_json(got, expected), (got, expected)
        assert all(c.status is ToolCallStatus.OK for c in parsed.tool_calls), parsed
        checked += 1
    return checked


# ---- marker injection --------------------------------------------------------------------------


def check_marker_injection(family: Family, markers: list[str] | None = None, **kw: Any) -> int:
    """A literal added-token string (``<|eot_id|>``, ``<|channel|>``, ``<start_of_turn>``...) in user or
    tool content, or in tool-call arguments, is text: it never becomes the special id. The render with
    the marker has exactly the special ids of the render with a harmless word in its place, and
    decodes back to the marker. Returns the markers checked."""
    r = family.renderer(**kw)
    tok = r.tokenizer
    markers = markers or sorted(tok.added_tokens, key=len, reverse=True)[:40]
    tools = [{"type": "function", "function": {"name": "echo", "description": "Echo.", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]

    def conversation(s: str) -> list[dict]:
        call = {"id": "c0", "type": "function", "function": {"name": "echo", "arguments": {"text": f"x{s}y"}}}
        return [
            {"role": "user", "content": f"before {s} after"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c0", "content": f"{s}result"},
            {"role": "user", "content": f"{s}"},
        ]

    specials = set(tok.added_tokens.values())
    for marker in markers:
        with_marker = r.render(conversation(marker), tools if r.capabilities.tools else None, add_generation_prompt=True)
        plain = r.render(conversation("word"), tools if r.capabilities.tools else None, add_generation_prompt=True)
        got = [t for t in with_marker.token_ids if t in specials]
        want = [t for t in plain.token_ids if t in specials]
        assert got == want, f"[{family.id}] the literal {marker!r} in message text became a special token"
        assert marker in tok.decode(with_marker.token_ids)
        assert not any(c and t in specials for t, c in zip(with_marker.token_ids, with_marker.is_content, strict=True))
    return len(markers)


# ---- parse_response fuzz -----------------------------------------------------------------------


def check_parse_fuzz(family: Family, completions: list[list[int]], prompt_ids: list[int] | None = None, **kw: Any) -> None:
    """``parse_response`` never raises: on random token ids (biased to the vocabulary's added tokens,
    where the parser branches) and on every truncation of real completions; every tool call carries
    a status, and its token span lies inside the completion."""
    r = family.renderer(**kw)
    specials = sorted(r.tokenizer.added_tokens.values())
    vocab = r.tokenizer.vocab_size

    def check(ids: list[int]) -> None:
        parsed = r.parse_response(ids, prompt_ids)
        for call in parsed.tool_calls:
            assert isinstance(call.status, ToolCallStatus)
            assert 0 <= call.token_span[0] < call.token_span[1] <= len(ids)
            assert (call.status is ToolCallStatus.OK) == (call.error is None)
        assert isinstance(parsed.content, str)

    for ids in completions:
        for cut in range(len(ids) + 1):
            check(ids[:cut])

    token = st.one_of(st.sampled_from(specials), st.integers(0, vocab - 1))
    pieces = st.one_of(st.lists(token, max_size=40), st.sampled_from(completions or [[]]).map(list))

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.lists(pieces, max_size=4))
    def fuzz(parts: list[list[int]]) -> None:
        check([t for part in parts for t in part])

    fuzz()
