"""Dialects of Gemma 4, Mistral, Qwen3.5, Nemotron 3 Nano / Nano v2, SmolLM3 and Llama 3 JSON fine-tunes.

Oracle: an assistant turn with reasoning and tool calls (nested and non-string arguments, parallel
calls, a malformed or unoffered one) is rendered by transformers' ``apply_chat_template`` with the
family's template on its tokenizer; the ids after the prompt (the generation prompt's render) are
parsed by the generic renderer, which parses with the dialect the vocabulary selects; the recovered
message must equal the input. Every cut of those ids parses without raising, and a cut inside a call
is ``unclosed``. Parity: the generic renderer's ids equal transformers' on generated conversations.

Tokenizers: none of these families ships a tokenizer in the fixtures, so each is a clearly labelled
reconstruction (tests/reconstructed.py): a real base vocabulary from the fixtures plus the family's
added tokens. Mistral's templates are generated at test time by mistral-common's official generator
(PyPI ``mistral-common``, ``integrations.chat_templates``), the one source of Mistral's Jinja
templates; nothing of them is stored in this repository.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

import tito_renderers as renderers
from tito_renderers.dialects import dialect_for
from tito_renderers.types import ToolCallStatus

from ._support import fixtures_dir, ours, reference
from .reconstructed import load

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"}},
        "required": ["city"],
    }}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
        "type": "object",
        "properties": {"q": {"type": "string"}, "tags": {"type": "array"}, "exact": {"type": "boolean"}, "limit": {"type": "number"}},
    }}},
]
WEATHER = {"city": "Zürich, CH", "days": 3, "opts": {"units": "metric", "hours": [6, 12], "alerts": True}}
SEARCH = {"q": "a } b, {c}: d", "tags": ["x", "y z"], "exact": False, "limit": 2.5}
REASONING = "The user wants the weather.\nTwo calls are needed."
CONTENT = "Let me check."


def call(name: str, arguments: Any, call_id: str = "abcdefghi") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class Oracle:
    """One rendered assistant turn: the messages before it, the turn, what parsing must give back."""

    id: str
    family: str
    assistant: dict
    ok_calls: list[tuple[str, dict]]
    statuses: list[ToolCallStatus]
    content: str = CONTENT
    reasoning: str | None = REASONING
    kwargs: dict = field(default_factory=dict)
    after: list[dict] = field(default_factory=list)  # messages after the turn (templates that render the last turn apart)
    reasoning_prefix: bool = False  # the template never renders reasoning: the model's "R</think>" is prepended


def history() -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"}]


PARALLEL = [call("get_weather", WEATHER), call("search", SEARCH, "bcdefghij")]
JSON_PARALLEL = [call("get_weather", json.dumps(WEATHER, ensure_ascii=False)), call("search", json.dumps(SEARCH), "bcdefghij")]
OK2 = [("get_weather", WEATHER), ("search", SEARCH)]
S_OK2 = [ToolCallStatus.OK, ToolCallStatus.OK]


SMOL_TEXT = (
    f"<think>\n{REASONING}\n</think>\n{CONTENT}\n<tool_call>\n"
    + json.dumps({"name": "get_weather", "arguments": WEATHER}, ensure_ascii=False)
    + "\n</tool_call>\n<tool_call>\n"
    + json.dumps({"name": "search", "arguments": SEARCH})
    + "\n</tool_call>"
)

SMOL_BAD = '\n<tool_call>\n{"name": "search", "arguments": {"q": \n</tool_call>'


def turn(calls: list[dict], content: str = CONTENT, reasoning: str | None = REASONING) -> dict:
    m: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


ORACLES = [
    # Gemma 4: thinking on (the prompt then ends at "<|turn>model\n"); content follows the calls in its render
    Oracle("gemma4", "gemma4", turn(PARALLEL), OK2, S_OK2, kwargs={"enable_thinking": True}),
    Oracle("gemma4-malformed", "gemma4", turn([call("get_weather", WEATHER), call("search", "q:<|\"|>open")]),
           [("get_weather", WEATHER)], [ToolCallStatus.OK, ToolCallStatus.INVALID_ARGUMENTS], kwargs={"enable_thinking": True}),
    Oracle("gemma4-unknown", "gemma4", turn([call("lookup", {"k": None, "n": -1})], content=""),
           [], [ToolCallStatus.UNKNOWN_TOOL], content="", kwargs={"enable_thinking": True}),
    # Mistral: v7 takes arguments as JSON strings (a dict goes through |tojson|safe and transformers'
    # Jinja then HTML-escapes the concatenated quotes); v11 with call ids; v13 / v15 with [THINK]
    Oracle("mistral-v7", "mistral-v7", turn(JSON_PARALLEL, reasoning=None), OK2, S_OK2, reasoning=None),
    Oracle("mistral-v11", "mistral-v11", turn(PARALLEL, reasoning=None), OK2, S_OK2, reasoning=None),
    Oracle("mistral-v13", "mistral-v13", turn(PARALLEL), OK2, S_OK2),
    Oracle("mistral-v13-malformed", "mistral-v13", turn([call("search", '{"q": "x", '), call("get_weather", WEATHER)]),
           [("get_weather", WEATHER)], [ToolCallStatus.INVALID_JSON, ToolCallStatus.OK]),
    Oracle("mistral-v15", "mistral-v15", turn(PARALLEL), OK2, S_OK2, kwargs={"reasoning_effort": "high"}),
    # Qwen3.5 and Nemotron 3 Nano: Qwen3-Coder XML calls (typed back by the tools' schemas) and <think>
    Oracle("qwen3.5", "qwen3.5", turn(PARALLEL), OK2, S_OK2),
    Oracle("qwen3.5-unknown", "qwen3.5", turn([call("lookup", {"k": "v"}), call("get_weather", WEATHER)]),
           [("get_weather", WEATHER)], [ToolCallStatus.UNKNOWN_TOOL, ToolCallStatus.OK]),
    Oracle("nemotron3", "nemotron3", turn(PARALLEL), OK2, S_OK2),
    # Nemotron Nano v2 renders the last assistant turn apart and never renders reasoning: the turn is
    # taken from history (a tool result follows) and the model's reasoning close is prepended
    Oracle("nemotron-v2", "nemotron-v2", turn(PARALLEL, reasoning=None), OK2, S_OK2,
           after=[{"role": "tool", "content": "sunny"}], reasoning_prefix=True),
    Oracle("nemotron-v2-malformed", "nemotron-v2", turn([call("get_weather", WEATHER), call("search", '{"q": ')], reasoning=None),
           [], [ToolCallStatus.INVALID_JSON], after=[{"role": "tool", "content": "sunny"}], reasoning_prefix=True),
    # SmolLM3's template renders content verbatim and has no tool-call field: the model's own text is the turn
    Oracle("smollm3", "smollm3", {"role": "assistant", "content": SMOL_TEXT}, OK2, S_OK2),
    Oracle("smollm3-malformed", "smollm3", {"role": "assistant", "content": SMOL_TEXT + SMOL_BAD}, OK2,
           [*S_OK2, ToolCallStatus.INVALID_JSON]),
    # Llama 3: Meta's 3.3 template with its default date changed (a fine-tune's copy: the generic renderer)
    Oracle("llama3-json", "llama3-json", turn([call("get_weather", WEATHER)], content="", reasoning=None),
           [("get_weather", WEATHER)], [ToolCallStatus.OK], content="", reasoning=None),
    Oracle("llama3-json-parallel", "llama3-json-parallel", turn(PARALLEL, content="", reasoning=None), OK2, S_OK2,
           content="", reasoning=None),
    Oracle("llama3-json-malformed", "llama3-json-parallel",
           turn([call("get_weather", WEATHER), call("search", '{"q": ')], content="", reasoning=None),
           [("get_weather", WEATHER)], [ToolCallStatus.OK, ToolCallStatus.INVALID_ARGUMENTS], content="", reasoning=None),
]


# ---- the oracle --------------------------------------------------------------------------------


# A fine-tune's template on the Llama 3 vocabulary (written here, not a model's): parallel JSON calls after
# <|python_tag|>, separated by "; ", closed by <|eom_id|>.
LLAMA_PARALLEL = (
    "{{- bos_token }}{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{%- if m.tool_calls %}<|python_tag|>{%- for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}{%- if not loop.last %}; {% endif %}"
    "{%- endfor %}<|eom_id|>{%- else %}{{ m.content | trim }}<|eot_id|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)


def mistral_template(version: str) -> str:
    """mistral-common's official chat template for a Tekken tokenizer version (thinking from v13 on)."""
    from mistral_common.integrations.chat_templates.chat_templates import generate_chat_template
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    return generate_chat_template(
        spm=False, tokenizer_version=TokenizerVersion(version), image_support=False, audio_support=False,
        thinking_support=version in ("v13", "v15"), default_system_prompt=None, plain_thinking_support=False,
        use_special_token_variables=True,
    )


def llama33_variant() -> str:
    """Meta's Llama 3.3 template with its fallback date changed: a fine-tune's copy, not a known template."""
    source = (fixtures_dir() / "templates" / "meta-llama-Llama-3.3-70B-Instruct.jinja").read_text(encoding="utf-8")
    assert '"26 Jul 2024"' in source
    return source.replace('"26 Jul 2024"', '"01 Dec 2026"')


# family -> (tokenizer: a reconstructed entry or "fixture:NAME", the template: a fixture file or a function)
SOURCES: dict[str, tuple[str, Any]] = {
    "gemma4": ("gemma-4", None),
    "mistral-v7": ("mistral-v11", lambda: mistral_template("v7")),
    "mistral-v11": ("mistral-v11", lambda: mistral_template("v11")),
    "mistral-v13": ("mistral-v13", lambda: mistral_template("v13")),
    "mistral-v15": ("mistral-v13", lambda: mistral_template("v15")),
    "qwen3.5": ("fixture:qwen3-0.6b", "Qwen-Qwen3.5-4B.jinja"),  # Qwen3's real tokenizer: the same marker names
    "nemotron3": ("nemotron-3-nano", None),
    "nemotron-v2": ("nemotron-nano-v2", None),
    "smollm3": ("smollm3", None),
    "llama3-json": ("fixture:llama-3.1-8b-instruct", llama33_variant),
    "llama3-json-parallel": ("fixture:llama-3.1-8b-instruct", lambda: LLAMA_PARALLEL),
}


@functools.cache
def pair(family: str):
    """(our tokenizer, transformers' tokenizer, template) of a family, loaded once per session."""
    name, template = SOURCES[family]
    if name.startswith("fixture:"):
        tok, hf = ours(name[8:]), reference(name[8:])
    else:
        tok, hf = load(name)
    if template is None:
        return tok, hf, hf.chat_template
    text = (fixtures_dir() / "templates" / template).read_text(encoding="utf-8") if isinstance(template, str) else template()
    hf = copy.copy(hf)  # shares the backend; only the template differs
    hf.chat_template = text
    return tok.with_chat_template(text, f"{tok.name_or_path} + {family}"), hf, text


def hf_ids(hf, msgs: list[dict], agp: bool, kwargs: dict) -> list[int]:
    out = hf.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=agp, tokenize=True, **kwargs)
    return list(out["input_ids"] if not isinstance(out, list) else out)


def assistant_part(case: Oracle) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids): transformers' render of the history with a generation prompt, and
    the ids of the full render after the part it shares with that prompt, through the turn's stop."""
    ours, hf, _ = pair(case.family)
    renderer = renderers.create_renderer(ours, name="generic", **case.kwargs)
    prompt = hf_ids(hf, history(), True, case.kwargs)
    full = hf_ids(hf, [*history(), copy.deepcopy(case.assistant), *case.after], False, case.kwargs)
    k = 0
    while k < min(len(prompt), len(full)) and prompt[k] == full[k]:
        k += 1
    rest = full[k:]
    stops = set(renderer.stop_token_ids) | set(dialect_for(ours).stop_ids)
    end = next(i for i, t in enumerate(rest) if t in stops)
    completion = rest[: end + 1]
    if case.reasoning_prefix:
        think_close = dialect_for(ours).think_ids[1]
        completion = ours.encode_plain(REASONING + "\n") + [think_close] + completion
    return prompt, completion


def recovered(parsed) -> tuple:
    message = parsed.to_message("object")
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    return message["content"], message.get("reasoning_content"), calls


@pytest.mark.parametrize("case", ORACLES, ids=[c.id for c in ORACLES])
def test_oracle_round_trip(case: Oracle) -> None:
    ours, _, _ = pair(case.family)
    renderer = renderers.create_renderer(ours, name="generic", **case.kwargs)
    prompt, completion = assistant_part(case)
    parsed = renderer.parse_response(completion, prompt, TOOLS)
    assert [c.status for c in parsed.tool_calls] == case.statuses, [(c.status, c.error, c.raw) for c in parsed.tool_calls]
    assert recovered(parsed) == (case.content, case.reasoning, case.ok_calls)
    assert parsed.stop_token_id == completion[-1]
    assert parsed.reasoning_complete is (None if case.reasoning is None else True)
    for c in parsed.tool_calls:  # spans lie inside the completion, in order
        assert 0 <= c.token_span[0] < c.token_span[1] <= len(completion)
    spans = [c.token_span for c in parsed.tool_calls]
    assert spans == sorted(spans)


@pytest.mark.parametrize("case", ORACLES, ids=[c.id for c in ORACLES])
def test_truncations_never_raise(case: Oracle) -> None:
    """Every cut of the completion parses; a cut inside a call leaves that call ``unclosed``, a cut
    inside reasoning leaves it incomplete (``reasoning_complete is False``), and no cut invents an ok call."""
    ours, _, _ = pair(case.family)
    renderer = renderers.create_renderer(ours, name="generic", **case.kwargs)
    prompt, completion = assistant_part(case)
    whole = renderer.parse_response(completion, prompt, TOOLS)
    n_ok = sum(c.status is ToolCallStatus.OK for c in whole.tool_calls)
    inside = {cut for c in whole.tool_calls for cut in range(c.token_span[0] + 1, c.token_span[1])}
    assert inside
    thinking: set[int] = set()  # cuts inside the reasoning block (opened by the prompt or the completion)
    think = dialect_for(ours).think_ids
    if whole.reasoning_content and think and think[1] in completion:
        opened = completion.index(think[0]) if think[0] in completion else -1
        thinking = set(range(opened + 1, completion.index(think[1]) + 1))
    for cut in range(len(completion)):
        parsed = renderer.parse_response(completion[:cut], prompt, TOOLS)
        assert parsed.stop_token_id is None
        assert sum(c.status is ToolCallStatus.OK for c in parsed.tool_calls) <= n_ok
        if cut in inside and case.family == "llama3-json" and not parsed.tool_calls:
            # no call markers: until the text reads {"name": it is an ordinary answer (Meta's rule)
            assert parsed.content == ours.decode(completion[:cut]).strip()
        elif cut in inside:
            assert parsed.tool_calls[-1].status is ToolCallStatus.UNCLOSED, (cut, parsed.tool_calls[-1])
        if cut in thinking:
            assert parsed.reasoning_complete is False and not parsed.tool_calls, cut


# ---- detection: a channel only where the vocabulary has its marker pair -------------------------

EXPECTED_DIALECT = {
    "gemma4": "gemma4", "mistral-v11": "mistral", "mistral-v13": "mistral", "qwen3.5": "hermes", "nemotron3": "hermes",
    "nemotron-v2": "nemotron_toolcall", "smollm3": "hermes", "llama3-json": "llama3_json",
}


@pytest.mark.parametrize("family", list(EXPECTED_DIALECT))
def test_detected_dialect(family: str) -> None:
    tok, _, _ = pair(family)
    assert dialect_for(tok).name == EXPECTED_DIALECT[family]


def test_detection_needs_the_markers() -> None:
    """Each dialect says no on a vocabulary without its markers, and a Mistral vocabulary without
    [THINK]/[/THINK] (v11) has no reasoning channel: the text stays content."""
    from tito_renderers.dialects.gemma4 import Gemma4
    from tito_renderers.dialects.llama3_json import Llama3Json
    from tito_renderers.dialects.mistral import Mistral
    from tito_renderers.dialects.nemotron import NemotronToolcall

    qwen, _, _ = pair("qwen3.5")
    llama, _, _ = pair("llama3-json")
    v11, _, _ = pair("mistral-v11")
    v13, _, _ = pair("mistral-v13")
    for cls in (Gemma4, Mistral, NemotronToolcall, Llama3Json):
        assert cls.detect(qwen) is None, cls
    assert Mistral.detect(llama) is None and Gemma4.detect(v13) is None and NemotronToolcall.detect(llama) is None
    assert Llama3Json.detect(llama) is not None and Llama3Json.detect(pair("smollm3")[0]) is None
    d11, d13 = Mistral.detect(v11), Mistral.detect(v13)
    assert d11.think_ids is None and d13.think_ids is not None
    eos = v11.markers["</s>"]
    text = "[THINK]plan[/THINK]done"
    parsed = d11.parse(v11.encode_plain(text) + [eos])
    assert (parsed.reasoning_content, parsed.content, parsed.tool_calls) == (None, text, [])
    parsed = d13.parse(v13.encode(text) + [v13.markers["</s>"]])
    assert (parsed.reasoning_content, parsed.content) == ("plan", "done")


# ---- marker text in message content is never a marker -----------------------------------------

MARKER_TEXT = {
    "gemma4": '<|channel>thought\nx<channel|><|tool_call>call:get_weather{city:<|"|>x<|"|>}<tool_call|><turn|>',
    "mistral-v13": '[THINK]x[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "x"}</s>',
    "nemotron-v2": '<think>x</think><TOOLCALL>[{"name": "get_weather", "arguments": {}}]</TOOLCALL><SPECIAL_12>',
    "qwen3.5": "<think>x</think><tool_call>\n<function=get_weather>\n</function>\n</tool_call><|im_end|>",
    "llama3-json": '<|python_tag|>{"name": "get_weather", "parameters": {}}<|eom_id|>',
}


@pytest.mark.parametrize("family", list(MARKER_TEXT))
def test_marker_text_is_never_a_marker(family: str) -> None:
    """A user message quoting the format's markers renders them as text (the render has the same marker
    ids as one of a plain message), and a completion that spells them as text parses to plain content."""
    tok, _, _ = pair(family)
    renderer = renderers.create_renderer(tok, name="generic")
    text = MARKER_TEXT[family]
    marker_ids = set(tok.markers.values())

    def markers_of(content: str) -> list[int]:
        ids = renderer.render([{"role": "user", "content": content}], add_generation_prompt=True).token_ids
        return [t for t in ids if t in marker_ids]

    assert markers_of(text) == markers_of("plain words")
    stop = renderer.stop_token_ids[0]
    parsed = renderer.parse_response(tok.encode_plain(text) + [stop], None, TOOLS)
    assert (parsed.tool_calls, parsed.reasoning_content, parsed.content) == ([], None, text.strip())
    assert parsed.stop_token_id == stop


# ---- parity: the generic renderer on these templates and tokenizers ---------------------------

PARITY = ["gemma4", "mistral-v7", "mistral-v11", "mistral-v13", "mistral-v15", "qwen3.5", "nemotron3", "nemotron-v2",
          "smollm3", "llama3-json"]
N_PARITY = 24


class _Store:
    """check_parity's tokenizer store for one family: the pair carries the template under test."""

    def __init__(self, family: str) -> None:
        self.family = family

    def get(self, name: str):
        from .conftest import TokenizerPair

        tok, hf, _ = pair(self.family)
        return TokenizerPair(name, fixtures_dir(), tok, hf)


@pytest.mark.slow
@pytest.mark.parametrize("family", PARITY)
def test_generic_parity(family: str) -> None:
    """Token ids of the generic renderer equal transformers' apply_chat_template + encode on generated
    conversations (tests/convgen.py), with and without a generation prompt."""
    from .convgen import contains_marker, generate, marker_regex
    from .test_parity import Case, check_parity

    tok, _, template = pair(family)
    case = Case(f"dialect-{family}", family, seed=9100 + PARITY.index(family), renderer_name="generic",
                chat_template=template, min_marker=0)
    convs = generate(case.seed, N_PARITY)
    if family == "nemotron3":
        # Its template splits the reasoning it wrapped in <think> itself; the harness's defused reference
        # (marker-shaped message text) cannot follow that branch, so only marker-free conversations here.
        pattern = marker_regex(tok.added_tokens)
        convs = [c for c in convs if not (contains_marker(c.messages, pattern) or contains_marker(c.tools, pattern))]
    # Mistral's templates reject most generated conversations (role order, 9-character call ids)
    check_parity(case, _Store(family), convs, min_exact=4)


@pytest.mark.parametrize("family", ["gemma4", "mistral-v13", "nemotron-v2", "llama3-json"])
def test_any_ids_parse_without_raising(family: str) -> None:
    """Random sequences of the dialect's markers, stops and pieces of call syntax parse to a result."""
    import random

    tok, _, _ = pair(family)
    dialect = dialect_for(tok)
    pieces = [[t] for t in tok.markers.values()] + [
        tok.encode_plain(x) for x in ('{"name": "search", "arguments": {', "}", "]", "[", "call:search{", "q:", '"x"', ",", "get_weather", " ")
    ]
    rng = random.Random(4242)
    for _ in range(300):
        ids = [t for _ in range(rng.randrange(1, 14)) for t in rng.choice(pieces)]
        parsed = dialect.parse(ids, TOOLS)
        assert all(0 <= c.token_span[0] <= c.token_span[1] <= len(ids) for c in parsed.tool_calls)
