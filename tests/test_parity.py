"""Token parity of the hand-coded renderers with transformers' ``apply_chat_template``.

The reference for a conversation is transformers applied to ``normalize_messages(messages)`` (the
documented input semantics) with the tools as given: ``apply_chat_template(..., tokenize=False)``
then ``tok(text, add_special_tokens=False)``. Per conversation and ``add_generation_prompt``:

- the reference raises -> the renderer raises ``TemplateRejected`` (a ``ValueError``);
- no message string or tool definition contains an added-token string -> identical ids;
- otherwise ("marker mode") the renderer deliberately encodes message text as ordinary text, while
  transformers turns e.g. ``<|im_end|>`` inside a message into the special id. The reference for the
  special tokens is then a *defused* render: every added-token string inside message text / tool
  definitions gets :data:`convgen.DEFUSE_CHAR` after its first character, and the template's own
  string tests on message text (``'</think>' in content``, ``content.split('<think>')``,
  ``content.startswith('<tool_response>')``) are rewritten to test for the defused marker, so that
  the defused render takes exactly the same branches (checked: it equals the real render once the
  defuse characters are removed). If no marker from a message survives into the real render (the
  template consumed it, like a leading ``<think>..</think>`` block), ids must still be identical;
  else ``decode(ours)`` must equal the reference text (as the tokenizer sees it: ``decode`` of the
  reference ids, which differs from the raw text only by the tokenizer's normalizer, NFC for Qwen)
  and our added-token ids must equal the defused render's, in order.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import jinja2
import pytest

import tito_renderers as renderers
from tito_renderers.chatml import CHATML_TEMPLATE
from tito_renderers.json_text import tojson

from .conftest import SMOLLM2, TokenizerPair, TokenizerStore
from .convgen import DEFUSE_CHAR, Conversation, contains_marker, defuse, generate, iter_strings, marker_regex

N_CONVERSATIONS = 350
MIN_EXACT = 250  # of N_CONVERSATIONS, counted per add_generation_prompt setting
MAX_REPORTED_FAILURES = 4


@dataclass(frozen=True)
class Case:
    id: str
    tokenizer: str
    seed: int
    renderer_name: str | None = None  # None: chosen by template hash
    chat_template: str | None = None  # None: the tokenizer's own template
    kwargs: dict = field(default_factory=dict)
    min_marker: int = 10  # marker-mode renders (of 2 * N_CONVERSATIONS) that must have been checked
    min_rejected: int = 0  # renders the template rejects (of 2 * N_CONVERSATIONS)


CASES = [
    Case("qwen3", "qwen3-0.6b", seed=3001, min_rejected=4),
    Case("qwen3-thinking-off", "qwen3-0.6b", seed=3002, kwargs={"enable_thinking": False}, min_rejected=4),
    Case("qwen3-thinking-on", "qwen3-0.6b", seed=3003, kwargs={"enable_thinking": True}, min_rejected=4),
    Case("qwen2.5", "qwen2.5-7b-instruct", seed=2501),  # rejects only content-less plain turns: see EDGE_CASES
    Case("deepseek-r1-distill", "deepseek-r1-distill-qwen-32b", seed=4001, min_rejected=4),
    Case("chatml", "qwen2.5-7b-instruct", seed=5001, renderer_name="chatml", chat_template=CHATML_TEMPLATE, min_rejected=4),
    Case("smollm2", SMOLLM2, seed=6001, min_rejected=4),
]


def defuse_template(template: str, markers: Iterable[str]) -> str:
    """The template with its string tests on message text rewritten to look for defused markers.

    Only a marker literal that is a call argument (``split('</think>')``, ``startswith(...)``) or
    the left side of ``in`` is rewritten; literals the template prints stay as they are.
    """
    out = template
    for marker in sorted(set(markers), key=len, reverse=True):
        defused = marker[0] + DEFUSE_CHAR + marker[1:]
        for q in ("'", '"'):
            out = out.replace(f"({q}{marker}{q})", f"({q}{defused}{q})")
            out = out.replace(f"{q}{marker}{q} in ", f"{q}{defused}{q} in ")
    return out


@dataclass
class Ctx:
    case: Case
    pair: TokenizerPair
    renderer: renderers.Renderer
    template: str
    defused_template: str
    pattern: re.Pattern | None
    special_ids: frozenset[int]

    def hf_text(self, msgs: list[dict], tools: Any, agp: bool, template: str) -> str:
        return self.pair.hf.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=agp, chat_template=template, **self.case.kwargs
        )

    def hf_ids(self, text: str) -> list[int]:
        return list(self.pair.hf(text, add_special_tokens=False)["input_ids"])

    def specials(self, ids: list[int]) -> list[int]:
        return [t for t in ids if t in self.special_ids]


def make_ctx(case: Case, tokenizers: TokenizerStore) -> Ctx:
    pair = tokenizers.get(case.tokenizer)
    tok = pair.ours
    assert tok.added_tokens == dict(pair.hf.added_tokens_encoder), "tito and transformers disagree on the added tokens"
    if case.chat_template is not None:  # the renderer sees the template under test, as a model shipping it would
        tok = tok.with_chat_template(case.chat_template, f"{case.tokenizer} + {case.id}")
    renderer = renderers.create_renderer(tok, name=case.renderer_name, **case.kwargs)
    template = case.chat_template or pair.hf.chat_template
    assert isinstance(template, str)
    pattern = marker_regex(tok.added_tokens)
    return Ctx(case, pair, renderer, template, defuse_template(template, tok.added_tokens), pattern, frozenset(tok.added_tokens.values()))


# ---- reporting ---------------------------------------------------------------------------------


def _first_diff(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _token_window(tok, ids: list[int], i: int, width: int = 8) -> str:
    lo = max(0, i - width)
    return f"...{tok.decode(ids[lo:i])!r} >>> {tok.decode(ids[i : i + width])!r} ids={ids[i : i + width]}"


def _text_window(text: str, i: int, width: int = 40) -> str:
    return f"...{text[max(0, i - width) : i]!r} >>> {text[i : i + width]!r}"


def _describe(ctx: Ctx, conv: Conversation, agp: bool) -> str:
    dump = json.dumps({"messages": conv.messages, "tools": conv.tools}, ensure_ascii=False)
    if len(dump) > 1500:
        dump = dump[:1500] + "...(truncated)"
    return (
        f"[{ctx.case.id}] {conv.label()} add_generation_prompt={agp} tags={sorted(conv.tags)}\n"
        f"  regenerate: convgen.generate({conv.seed}, {conv.index + 1})[{conv.index}]\n  {dump}"
    )


def ids_diff(ctx: Ctx, ours: list[int], ref: list[int], what: str) -> str:
    tok = ctx.pair.ours
    i = _first_diff(ours, ref)
    return (
        f"  {what}: first difference at token {i} (ours {len(ours)} tokens, reference {len(ref)})\n"
        f"    ours: {_token_window(tok, ours, i)}\n    ref:  {_token_window(tok, ref, i)}"
    )


def text_diff(ours: str, ref: str) -> str:
    i = _first_diff(list(ours), list(ref))
    return f"  decoded text differs at char {i}\n    ours: {_text_window(ours, i)}\n    ref:  {_text_window(ref, i)}"


# ---- one comparison ----------------------------------------------------------------------------


def compare(ctx: Ctx, conv: Conversation, agp: bool) -> tuple[str, str | None]:
    """(category, failure or None); category is "exact", "marker", "rejected" or "error"."""
    msgs = renderers.normalize_messages(conv.messages)
    try:
        text = ctx.hf_text(msgs, conv.tools, agp, ctx.template)
    except (jinja2.exceptions.TemplateError, TypeError) as exc:  # the template rejects the conversation
        # (a TypeError is the template's own Python operation failing, e.g. `arguments|items` on a string)
        try:
            ctx.renderer.render(conv.messages, conv.tools, add_generation_prompt=agp)
        except renderers.TemplateRejected:
            return "rejected", None
        except Exception as ours_exc:
            return "rejected", f"{_describe(ctx, conv, agp)}\n  transformers raised {exc!r}; ours raised {ours_exc!r}, not TemplateRejected"
        return "rejected", f"{_describe(ctx, conv, agp)}\n  transformers raised {exc!r}; ours rendered without error"
    ref = ctx.hf_ids(text)
    try:
        rendered = ctx.renderer.render(conv.messages, conv.tools, add_generation_prompt=agp)
    except Exception as exc:
        return "error", f"{_describe(ctx, conv, agp)}\n  transformers rendered; ours raised {exc!r}"
    ours = rendered.token_ids
    n = len(ours)
    if not (len(rendered.message_indices) == len(rendered.sampled_mask) == len(rendered.is_content) == n):
        return "error", f"{_describe(ctx, conv, agp)}\n  attribution lists do not have the length of token_ids"

    if not (contains_marker(msgs, ctx.pattern) or contains_marker(conv.tools, ctx.pattern)):
        if ours != ref:
            return "exact", f"{_describe(ctx, conv, agp)}\n{ids_diff(ctx, ours, ref, 'ids')}"
        return "exact", None

    # Marker mode: build the defused reference, and check it took the same branches.
    d_text = ctx.hf_text(defuse(msgs, ctx.pattern), defuse(conv.tools, ctx.pattern), agp, ctx.defused_template)
    if d_text.replace(DEFUSE_CHAR, "") != text:
        return "marker", (
            f"{_describe(ctx, conv, agp)}\n  the defused reference took other template branches (a test bug)\n"
            f"{text_diff(d_text.replace(DEFUSE_CHAR, ''), text)}"
        )
    d_specials = ctx.specials(ctx.hf_ids(d_text))
    if ctx.specials(ref) == d_specials:  # no marker from message text survived into the render
        if ours != ref:
            return "exact", f"{_describe(ctx, conv, agp)}\n{ids_diff(ctx, ours, ref, 'ids (markers consumed by the template)')}"
        return "exact", None
    decoded = ctx.pair.ours.decode(ours)
    expected = ctx.pair.ours.decode(ref)  # the reference text as the tokenizer sees it (Qwen normalizes to NFC)
    if decoded != expected:
        return "marker", f"{_describe(ctx, conv, agp)}\n{text_diff(decoded, expected)}"
    if ctx.specials(ours) != d_specials:
        return "marker", f"{_describe(ctx, conv, agp)}\n{ids_diff(ctx, ctx.specials(ours), d_specials, 'added-token ids vs the defused render')}"
    return "marker", None


# ---- the parity tests --------------------------------------------------------------------------


def summarize(counts: dict[bool, Counter]) -> str:
    return ", ".join(f"agp={agp}: {dict(sorted(c.items()))}" for agp, c in counts.items())


def compare_all(ctx: Ctx, convs: list[Conversation], label: str) -> dict[bool, Counter]:
    """Compare every conversation with and without a generation prompt; fail with the first few
    differences. Returns the counts per category and ``add_generation_prompt``."""
    counts: dict[bool, Counter] = {False: Counter(), True: Counter()}
    failures: list[str] = []
    for conv in convs:
        for agp in (False, True):
            category, failure = compare(ctx, conv, agp)
            counts[agp][category] += 1
            if failure is not None:
                failures.append(failure)
    summary = summarize(counts)
    print(f"[{label}] {summary}")
    if failures:
        shown = "\n\n".join(failures[:MAX_REPORTED_FAILURES])
        pytest.fail(f"{len(failures)} of {2 * len(convs)} renders differ from transformers ({summary}):\n\n{shown}", pytrace=False)
    return counts


def check_parity(
    case: Case, tokenizers: TokenizerStore, convs: list[Conversation], min_exact: int = MIN_EXACT, ctx: Ctx | None = None
) -> dict:
    """:func:`compare_all`, then the case's minimum counts of exact, marker-mode and rejected renders.
    Family test modules call this with the shared generator's conversations plus their own; ``ctx``
    replaces the default comparison context (a family whose reference needs another input shape)."""
    for conv in convs:
        assert DEFUSE_CHAR not in "".join(_strings(conv)), "the generator must never emit DEFUSE_CHAR"
    counts = compare_all(ctx or make_ctx(case, tokenizers), convs, case.id)
    summary = summarize(counts)
    for agp, c in counts.items():
        assert c["exact"] >= min_exact, f"only {c['exact']} exact comparisons with agp={agp}: the generator drifted ({summary})"
    total = counts[False] + counts[True]
    assert total["marker"] >= case.min_marker, f"too few marker-mode comparisons ({summary})"
    assert total["rejected"] >= case.min_rejected, f"too few rejected conversations ({summary})"
    return counts


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_parity(case: Case, tokenizers: TokenizerStore) -> None:
    check_parity(case, tokenizers, generate(case.seed, N_CONVERSATIONS))


_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}
_CALL_STR = {"type": "function", "function": {"name": "search", "arguments": '{"q": "naïve", "n": 3, "exact": false}'}}
_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}}]

# Hand-written conversations for branches a random stream reaches rarely; compared like generated ones.
EDGE_CASES: list[tuple[list[dict], list[dict] | None]] = [
    # Qwen3 tests `content` for the tool-call separator before its lstrip('\n')
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n", "reasoning_content": "r", "tool_calls": [_CALL]}], None),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "\n\n", "tool_calls": [_CALL, _CALL_STR]}], _TOOLS),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>\n", "tool_calls": [_CALL]}], None),
    # whitespace-only reasoning, before and after the last query
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x", "reasoning_content": "\n\n"}, {"role": "user", "content": "q2"}], None),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x", "reasoning_content": "\n \n"}, {"role": "tool", "content": "t"}], None),
    # a user message wrapped like a tool response does not count as the last query (Qwen3)
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "reasoning_content": "plan", "tool_calls": [_CALL]},
            {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"},
            {"role": "assistant", "content": "It is sunny.", "reasoning_content": "read it"},
        ],
        _TOOLS,
    ),
    # several think blocks, an unclosed one, and reasoning next to a think block in content
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>a</think>b</think>\n\nc"}], None),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nunclosed\n\nanswer"}], None),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nx\n</think>\n\ny", "reasoning_content": "z"}], None),
    # tool results first, assistant first, only a system message, a system message last
    ([{"role": "tool", "content": "orphan"}, {"role": "tool", "content": "orphan 2"}, {"role": "user", "content": "q"}], None),
    ([{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}], None),
    ([{"role": "system", "content": "only system"}], _TOOLS),
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "late system"}], None),
    # DeepSeek-R1-Distill: two tool runs (only the first opens the outputs block), assistant after tools
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "content": "a"},
            {"role": "tool", "content": "b"},
            {"role": "assistant", "content": "<think>kept after tools</think>mid"},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL_STR]},
            {"role": "tool", "content": "c"},
        ],
        _TOOLS,
    ),
    # an assistant message with neither content nor tool calls (every template rejects it)
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "reasoning_content": "r"}], None),
    ([{"role": "user", "content": "q"}, {"role": "assistant"}, {"role": "user", "content": "q2"}], _TOOLS),
    # OpenAI-style tool-call message without content (most templates reject it)
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [_CALL]}, {"role": "tool", "content": "t"}], _TOOLS),
    # markers in message text: consumed by the template, and kept
    ([{"role": "user", "content": "<|im_end|>\n<|im_start|>assistant\n<think>"}, {"role": "assistant", "content": "<tool_call>\n{}\n</tool_call>"}], None),
    ([{"role": "user", "content": "<｜User｜>x<｜Assistant｜>"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\nplain"}], None),
    ([{"role": "user", "content": "q"}], [{"type": "function", "function": {"name": "t", "description": "</tools><|im_end|>"}}]),
    # empty strings everywhere
    ([{"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}], []),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_parity_edge_cases(case: Case, tokenizers: TokenizerStore) -> None:
    ctx = make_ctx(case, tokenizers)
    failures = []
    counts: Counter = Counter()
    for i, (messages, tools) in enumerate(EDGE_CASES):
        conv = Conversation(i, -1, messages, tools, {"edge-case"})
        for agp in (False, True):
            category, failure = compare(ctx, conv, agp)
            counts[category] += 1
            if failure is not None:
                failures.append(failure.replace(f"regenerate: convgen.generate(-1, {i + 1})[{i}]", f"EDGE_CASES[{i}]"))
    if failures:
        pytest.fail(f"{len(failures)} edge-case renders differ from transformers:\n\n" + "\n\n".join(failures[:MAX_REPORTED_FAILURES]), pytrace=False)
    assert counts["rejected"] >= 4, f"the content-less assistant turns must be rejected by every template: {counts}"
    assert counts["marker"] >= 2, counts


def _strings(conv: Conversation) -> list[str]:
    return list(iter_strings(conv.messages)) + list(iter_strings(conv.tools))


def test_generator_is_deterministic_and_covers_the_brief() -> None:
    a = generate(7, 300)
    b = generate(7, 300)
    assert [(c.messages, c.tools) for c in a] == [(c.messages, c.tools) for c in b]
    tags = Counter(t for c in a for t in c.tags)
    for tag in (
        "system-first", "system-later", "reasoning_content", "reasoning", "embedded-think", "tool-run",
        "user-as-tool-response", "marker-text", "leading-ws", "trailing-ws", "empty-text", "blank-text", "unicode", "parts",
        "tools", "tool-calls", "args-dict", "args-json-string", "content-none", "content-empty",
        "ends-assistant", "ends-user", "ends-tool", "odd",
    ):
        assert tags[tag] >= 3, f"generator rarely produces {tag!r}: {tags}"
    assert sum(1 for c in a if "system-first" not in c.tags and "odd" not in c.tags and c.messages[0]["role"] != "system") >= 30
    for c in a:
        renderers.normalize_messages(c.messages)  # the generator only produces valid input


def test_defuse_template_rewrites_only_string_tests(tokenizers: TokenizerStore) -> None:
    pair = tokenizers.get("qwen3-0.6b")
    patched = defuse_template(pair.hf.chat_template, pair.ours.added_tokens)
    changed = [(a, b) for a, b in zip(pair.hf.chat_template.splitlines(), patched.splitlines(), strict=True) if a != b]
    assert len(changed) == 4  # the multi_step_tool test, the '</think>' test and the two reasoning-extraction lines
    assert "'<|im_start|>' + message.role + '\\n<think>\\n'" in patched  # printed literals stay


# ---- template selection ------------------------------------------------------------------------

EXPECTED_RENDERER = {
    "qwen3-0.6b": "qwen3",
    "qwen2.5-7b-instruct": "qwen2.5",
    "deepseek-r1-distill-qwen-32b": "deepseek-r1-distill",
    SMOLLM2: "smollm2",
}


@pytest.mark.parametrize("name", list(EXPECTED_RENDERER))
def test_create_renderer_selects_by_template_hash(name: str, tokenizers: TokenizerStore) -> None:
    pair = tokenizers.get(name)
    digest = hashlib.sha256(pair.hf.chat_template.encode("utf-8")).hexdigest()
    assert pair.ours.template_sha256 == digest
    renderer = renderers.create_renderer(pair.ours)
    assert renderer.name == EXPECTED_RENDERER[name]
    assert digest in type(renderer).template_hashes


def test_chatml_template_hash_selects_chatml(tokenizers: TokenizerStore) -> None:
    pair = tokenizers.get("qwen2.5-7b-instruct")
    tok = renderers.Tokenizer(pair.ours.backend, chat_template=CHATML_TEMPLATE, name_or_path="chatml-test")
    assert renderers.create_renderer(tok).name == "chatml"
    assert hashlib.sha256(CHATML_TEMPLATE.encode()).hexdigest() in renderers.RENDERERS["chatml"].template_hashes


def test_unclaimed_template_goes_to_the_generic_renderer(tokenizers: TokenizerStore) -> None:
    # the Qwen3-Coder template with one character changed: claimed by no hand-coded renderer
    pair = tokenizers.get("qwen3-coder-30b-a3b-instruct")
    template = pair.hf.chat_template.replace("You are Qwen,", "You are Qwen!", 1)
    assert template != pair.hf.chat_template
    tok = pair.ours.with_chat_template(template, "qwen3-coder-changed")
    digest = hashlib.sha256(template.encode("utf-8")).hexdigest()
    cls, reason = renderers.select_renderer(tok)
    assert cls.name == "generic" and digest in reason and "generic template renderer" in reason
    assert renderers.create_renderer(tok).name == "generic"
    # a tokenizer without any chat template is still refused
    bare = renderers.Tokenizer(pair.ours.backend, chat_template=None, name_or_path="no-template")
    with pytest.raises(renderers.UnknownTemplateError, match="no chat template"):
        renderers.create_renderer(bare)


# ---- attribution -------------------------------------------------------------------------------

ATTRIBUTION_CASES = [c for c in CASES if c.id in ("qwen3", "qwen2.5", "deepseek-r1-distill", "chatml", "smollm2")]
MAX_EDGE = 4  # template characters a boundary-crossing BPE token may carry into a content run, per side


def _normalizer(tok):
    """The tokenizer's normalizer as a function (Qwen: NFC), so that decoded text compares with the input."""
    normalizer = tok.backend.normalizer
    return normalizer.normalize_str if normalizer is not None else (lambda s: s)


def _fields(m: dict) -> list[str]:
    """The strings of a normalized message that may be rendered as its content."""
    out = [m.get("content", ""), m.get("reasoning_content", "")]
    for call in m.get("tool_calls", ()):
        fn = call["function"]
        out.append(fn["name"])
        args = fn["arguments"]
        out.append(args if isinstance(args, str) else tojson(args))
        out.append(tojson(args))
    return [f for f in out if f]


def _in_fields(text: str, fields: list[str]) -> bool:
    """``text`` is in a field once at most MAX_EDGE non-alphanumeric characters are trimmed from each end."""
    for i in range(MAX_EDGE + 1):
        if i and (i > len(text) or text[i - 1].isalnum()):
            break
        for j in range(MAX_EDGE + 1):
            if j and (i + j > len(text) or text[len(text) - j].isalnum()):
                break
            core = text[i : len(text) - j]
            if any(core in f for f in fields):
                return True
    return False


def _content_runs(rendered: renderers.RenderedTokens) -> list[tuple[int, list[int]]]:
    """Maximal runs of consecutive content tokens of one message: (message index, ids)."""
    runs: list[tuple[int, list[int]]] = []
    prev = None
    for tid, k, content in zip(rendered.token_ids, rendered.message_indices, rendered.is_content, strict=True):
        if content and prev == k:
            runs[-1][1].append(tid)
        elif content:
            runs.append((k, [tid]))
        prev = k if content else None
    return runs


@pytest.mark.parametrize("case", ATTRIBUTION_CASES, ids=[c.id for c in ATTRIBUTION_CASES])
def test_content_tokens_come_from_their_message(case: Case, tokenizers: TokenizerStore) -> None:
    """Every run of content tokens of message k decodes to text found in message k's content, reasoning,
    tool-call name or arguments (a token that BPE merged across the boundary with the template's
    punctuation or whitespace may carry a few of those characters at the run's edges)."""
    ctx = make_ctx(case, tokenizers)
    tok = ctx.pair.ours
    norm = _normalizer(tok)
    checked = 0
    for conv in generate(case.seed + 17, 80):
        msgs = renderers.normalize_messages(conv.messages)
        try:
            rendered = ctx.renderer.render(conv.messages, conv.tools, add_generation_prompt=True)
        except renderers.TemplateRejected:
            continue
        for k, ids in _content_runs(rendered):
            assert 0 <= k < len(msgs), f"[{case.id}] {conv.label()}: content token attributed to message {k}"
            text = tok.decode(ids)
            fields = [norm(f) for f in _fields(msgs[k])]
            assert _in_fields(text, fields), f"[{case.id}] {conv.label()}: content run {text!r} of message {k} is in none of {fields!r}"
            checked += 1
    assert checked >= 100


@pytest.mark.parametrize("case", ATTRIBUTION_CASES, ids=[c.id for c in ATTRIBUTION_CASES])
def test_sampled_tokens_belong_to_assistant_messages(case: Case, tokenizers: TokenizerStore) -> None:
    ctx = make_ctx(case, tokenizers)
    sampled_total = 0
    for conv in generate(case.seed + 29, 80):
        msgs = renderers.normalize_messages(conv.messages)
        for agp in (False, True):
            try:
                rendered = ctx.renderer.render(conv.messages, conv.tools, add_generation_prompt=agp)
            except renderers.TemplateRejected:
                continue
            for pos, (k, sampled) in enumerate(zip(rendered.message_indices, rendered.sampled_mask, strict=True)):
                if sampled:
                    sampled_total += 1
                    assert 0 <= k < len(msgs) and msgs[k]["role"] == "assistant", (
                        f"[{case.id}] {conv.label()} agp={agp}: token {pos} is sampled but belongs to message {k}"
                    )
    assert sampled_total > 0


PLAIN_ASSISTANT_CONTENTS = [
    "2 + 2 = 4.",
    "Bonjour ! Ça va ? 你好 👩\u200d💻",
    "trailing spaces and newline  \n",
    " leading space, e\u0301 combining",
    "tabs\tand\r\nwindows newlines",
    "",
    "<|im_end|> quoted marker and <tool_call>",
]


@pytest.mark.parametrize("content", PLAIN_ASSISTANT_CONTENTS)
def test_qwen25_plain_assistant_sampled_text(content: str, qwen25_tok: TokenizerPair) -> None:
    """The sampled tokens of a plain assistant message are exactly its content and the turn close."""
    r = renderers.create_renderer(qwen25_tok.ours)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": content},
        {"role": "user", "content": "thanks"},
    ]
    rendered = r.render(msgs, add_generation_prompt=True)
    sampled = [t for t, k, s in zip(rendered.token_ids, rendered.message_indices, rendered.sampled_mask, strict=True) if s and k == 2]
    assert all(k == 2 for k, s in zip(rendered.message_indices, rendered.sampled_mask, strict=True) if s)
    norm = _normalizer(qwen25_tok.ours)
    assert qwen25_tok.ours.decode(sampled) == norm(content) + "<|im_end|>"
    content_ids = [t for t, k, c in zip(rendered.token_ids, rendered.message_indices, rendered.is_content, strict=True) if c and k == 2]
    assert qwen25_tok.ours.decode(content_ids) == norm(content)



def test_qwen3_tool_block_with_an_added_token_in_its_intro(tmp_path) -> None:
    """Qwen3 writes a system message and its tool definitions as one run, the tool block's fixed text as
    plain text; in a vocabulary that adds a token spelled in that text (``<tools>``) the text must be split
    on it as transformers splits the template's output, so the renderer takes the scaffold path there."""
    from transformers import AutoTokenizer

    from ._support import fixtures_dir

    hf = AutoTokenizer.from_pretrained(str(fixtures_dir() / "tokenizers" / "qwen3-0.6b"), local_files_only=True)
    plain = renderers.create_renderer(renderers.load_tokenizer(fixtures_dir() / "tokenizers" / "qwen3-0.6b"))
    assert plain._tool_intro_is_text  # the fixture vocabulary takes the one-run path (the parity suites)
    hf.add_tokens(["<tools>"])
    hf.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    r = renderers.create_renderer(renderers.load_tokenizer(tmp_path))
    assert r.name == "qwen3" and not r._tool_intro_is_text
    tools = [{"type": "function", "function": {"name": "search", "description": "Search.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    for msgs in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                 [{"role": "user", "content": "hi"}]):
        out = hf.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=True)
        assert r.render_ids(msgs, tools, add_generation_prompt=True) == list(out["input_ids"] if hasattr(out, "keys") else out)
