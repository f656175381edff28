"""A harness that looks for gaps of the ids-only bridge on templates no test was written for.

For each template of a corpus (:func:`corpus`: the fixtures' own templates, mistral-common's generated
Mistral templates across every ``TemplateConfig`` version, a Llama-2-style ``[INST]`` template, and
mechanical mutations of them), multi-turn conversations from a seeded generator
(:func:`conversations`: with and without a system prompt, tools, tool calls and reasoning) are bridged
turn by turn as verifiers' TrainClient and prime-rl call a renderer: the previous prompt and the
completion are transformers' ``apply_chat_template`` ids, and a fresh renderer (which never saw the
prompt) bridges them with ids only, no history.

Counted per template (:func:`measure`):

- ``needless``: a Break where transformers' render of the conversation with the new messages *is*
  an append-only extension of previous prompt + completion (the turn could have been bridged);
- ``ambiguous``: such a Break where the ids cannot tell: two or more conversations render (by
  transformers) to the previous prompt's ids exactly, and, with the sampled turn and the new messages,
  render differently (Mistral v2/v3 write ``[INST]`` + system + ``"\n\n"`` + user text, so a user text
  ending in ``"\n\n"`` also reads as a system prompt and an empty user text). No ids-only bridge is
  right for both, so the contract is a Break; counted apart from ``needless``;
- ``wrong``: a bridge where that render is append-only and the bridged ids differ from it;
- ``unequal``: the renderer's own render of that conversation differs from transformers' (parity);
- ``drift``: a bridge where it is not (the template rewrites the previous prompt or the sampled turn):
  the generic renderer keeps the sampled prefix only on its splice path, for a template the probe
  found append-only; where the probe found it not append-only the turn must Break.

Everything expected comes from transformers, never from the code under test.
"""

from __future__ import annotations

import copy
import functools
import json
import random
import re
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2

import tito_renderers as renderers
from tito_renderers import Break

from ._support import fixtures_dir, ours, reference
from .family_checks import BridgeCase

# ---- templates ----------------------------------------------------------------------------------

# Meta's Llama-2-chat template as it shipped in the HF tokenizer_config (system prompt folded into the
# first user turn between <<SYS>> markers, BOS before every user turn): the archetype of ``[INST]``
# templates, whose generation prompt is empty.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def mistral_template(version: str, **config: Any) -> str:
    """mistral-common's generated chat template (``TemplateConfig(version=..., **config)``)."""
    from mistral_common.integrations.chat_templates.template_generator import TemplateConfig, build_chat_template
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    return build_chat_template(TemplateConfig(version=TokenizerVersion(version), **config))


def mistral_configs() -> list[tuple[str, dict]]:
    """Every TemplateConfig mistral-common accepts for text: each version, SentencePiece spacing where
    allowed, thinking where allowed, BOS as a literal or as ``bos_token``."""
    from mistral_common.integrations.chat_templates.template_generator import TemplateConfig
    from mistral_common.tokens.tokenizers.base import TokenizerVersion

    out = []
    for version in TokenizerVersion:
        for spm in (False, True):
            for thinking in (False, True):
                for variables in (True, False):
                    config = dict(spm=spm, thinking_support=thinking, use_special_token_variables=variables)
                    try:
                        TemplateConfig(version=version, **config)
                    except ValueError:
                        continue
                    name = f"mistral-{version.value}" + ("-spm" if spm else "") + ("-think" if thinking else "")
                    out.append((name + ("" if variables else "-literal-bos"), {"version": version.value, **config}))
    return out


# ---- mutations: mechanical edits of a template's source -------------------------------------------


def no_generation_prompt(source: str, markers: list[str]) -> str | None:
    """The model writes its own assistant header: ``add_generation_prompt`` is forced off."""
    return "{%- set add_generation_prompt = false %}" + source


def newline_after_markers(source: str, markers: list[str]) -> str | None:
    """A newline after every added token the template writes (a fine-tune's formatting change)."""
    used = [m for m in markers if m in source]
    if not used:
        return None
    pattern = re.compile("|".join(re.escape(m) for m in sorted(used, key=len, reverse=True)))
    return pattern.sub(lambda m: m.group() + "\\n" if _in_literal(source, m.start()) else m.group() + "\n", source)


def space_before_markers(source: str, markers: list[str]) -> str | None:
    """A space before every added token the template writes (SentencePiece-style spacing)."""
    used = [m for m in markers if m in source]
    if not used:
        return None
    pattern = re.compile("|".join(re.escape(m) for m in sorted(used, key=len, reverse=True)))
    return pattern.sub(lambda m: " " + m.group(), source)


def system_at_last_turn(source: str, markers: list[str]) -> str | None:
    """The system prompt moved from the first user turn to the last two messages' (``[INST]`` templates
    that fold it into a user turn by index)."""
    out = source.replace("loop.index0 == 0 and system_message", "loop.revindex0 <= 1 and system_message")
    return out if out != source else None


def no_bos(source: str, markers: list[str]) -> str | None:
    """BOS dropped."""
    out = re.sub(r"\{\{-?\s*bos_token\s*-?\}\}", "", source).replace("bos_token + ", "")
    return out if out != source else None


def bos_per_user_turn(source: str, markers: list[str]) -> str | None:
    """BOS before every ``[INST]`` (Llama 2's habit) instead of once."""
    if "'[INST]'" not in source:
        return None
    return no_bos(source, markers).replace("'[INST]'", "bos_token + '[INST]'")


MUTATIONS: dict[str, Callable[[str, list[str]], str | None]] = {
    "no-gp": no_generation_prompt,
    "nl-after-markers": newline_after_markers,
    "space-before-markers": space_before_markers,
    "system-at-last": system_at_last_turn,
    "no-bos": no_bos,
    "bos-per-user": bos_per_user_turn,
}


def _in_literal(source: str, at: int) -> bool:
    """Whether position ``at`` of a Jinja source is inside a quoted string of a ``{{ }}`` / ``{% %}`` tag."""
    opened = max(source.rfind("{{", 0, at), source.rfind("{%", 0, at))
    closed = max(source.rfind("}}", 0, at), source.rfind("%}", 0, at))
    if opened <= closed:
        return False
    inside = source[opened:at]
    quote = None
    i = 0
    while i < len(inside):
        c = inside[i]
        if quote is None and c in "'\"":
            quote = c
        elif c == quote:
            quote = None
        elif c == "\\" and quote is not None:
            i += 1
        i += 1
    return quote is not None


# ---- the corpus -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One template under test: ``tokenizer`` is a fixture name, ``reconstructed:NAME``
    (tests/reconstructed.py, a real base vocabulary with the family's added tokens) or ``shipped:NAME``
    (tests/shipped_mistral.py, a tokenizer file mistral-common ships, converted)."""

    id: str
    tokenizer: str
    source: Callable[[], str] = field(compare=False)  # the template's text
    kind: str = "fixture"  # fixture / mistral / llama2 / mutated
    string_args: bool = False  # tool-call arguments as JSON strings (see _Gen.arguments)

    @functools.cached_property
    def template(self) -> str:
        return self.source()

    @functools.cached_property
    def pair(self) -> tuple[renderers.Tokenizer, Any]:
        """(tito's tokenizer, transformers') carrying this entry's template."""
        tok, hf = _tokenizers(self.tokenizer)
        hf = copy.copy(hf)  # shares the backend; only the template differs
        hf.chat_template = self.template
        return tok.with_chat_template(self.template, f"{self.tokenizer} + {self.id}"), hf

    def renderer(self) -> renderers.Renderer:
        return renderers.create_renderer(self.pair[0])

    def reference_ids(self, messages: list[dict], tools: Any, agp: bool) -> list[int]:
        hf = self.pair[1]
        text = hf.apply_chat_template(renderers.normalize_messages(messages), tools=tools, tokenize=False,
                                      add_generation_prompt=agp)
        return list(hf(text, add_special_tokens=False)["input_ids"])


@functools.cache
def _tokenizers(name: str):
    if name.startswith("reconstructed:"):
        from .reconstructed import load

        return load(name.removeprefix("reconstructed:"))
    if name.startswith("shipped:"):
        from .shipped_mistral import load

        return load(name.removeprefix("shipped:"))
    return ours(name), reference(name)


def _fixture_template(tokenizer: str, file: str | None = None) -> Callable[[], str]:
    if file is None:
        return lambda: reference(tokenizer).chat_template
    return lambda: (fixtures_dir() / "templates" / file).read_text(encoding="utf-8")


# fixture tokenizers and their own templates, plus the template-only fixtures they tokenize
FIXTURES = [
    ("qwen3", "qwen3-0.6b", None),
    ("qwen2.5", "qwen2.5-7b-instruct", None),
    ("qwen3-coder", "qwen3-coder-30b-a3b-instruct", None),
    ("deepseek-r1-distill", "deepseek-r1-distill-qwen-32b", None),
    ("llama-3.1", "llama-3.1-8b-instruct", None),
    ("llama-3.2", "llama-3.2-3b-instruct", None),
    ("llama-3.3", "llama-3.1-8b-instruct", "meta-llama-Llama-3.3-70B-Instruct.jinja"),
    ("nemotron-super", "llama-3.3-nemotron-super-49b-v1.5", None),
    ("gpt-oss", "gpt-oss-20b", None),
    ("gemma-3", "gemma-3-it", None),
    ("deepseek-v3", "deepseek-v3", None),
    ("deepseek-r1", "deepseek-r1", None),
    ("deepseek-v3.1", "deepseek-v3", "deepseek-ai-DeepSeek-V3.1.jinja"),
    ("qwen3.5", "qwen3-0.6b", "Qwen-Qwen3.5-4B.jinja"),
]
# Tekken (tests/reconstructed.py): Mistral's control tokens on a real tiktoken-style vocabulary
TEKKEN = "reconstructed:mistral-v11"
TEKKEN_THINK = "reconstructed:mistral-v13"


def corpus(mutate: bool = True) -> list[Entry]:
    """Every template of the harness: fixtures, mistral-common's, Llama-2-style ones, and mutations of
    the ``[INST]`` ones and of a ChatML and a Llama 3 one (``mutate``)."""
    entries = [Entry(name, tok, _fixture_template(tok, file)) for name, tok, file in FIXTURES]
    for name, config in mistral_configs():
        tok = TEKKEN_THINK if config["version"] in ("v13", "v15") else TEKKEN
        entries.append(Entry(name, tok, functools.partial(mistral_template, **config), kind="mistral", string_args=True))
    entries += shipped_entries()
    entries.append(Entry("llama-2", TEKKEN, lambda: LLAMA2, kind="llama2"))
    entries.append(Entry("llama-2-on-llama-3-vocab", "llama-3.1-8b-instruct", lambda: LLAMA2, kind="llama2"))
    if mutate:
        bases = [e for e in entries if e.id in ("mistral-v1", "mistral-v3", "mistral-v7", "mistral-v1-spm",
                                                "llama-2", "qwen2.5", "llama-3.1")]
        for base in bases:
            for label, mutation in MUTATIONS.items():
                entries.append(Entry(f"{base.id}+{label}", base.tokenizer, functools.partial(_mutated, base, mutation),
                                     kind="mutated", string_args=base.string_args))
    return entries


def shipped_entries() -> list[Entry]:
    """mistral-common's template of each version on the shipped tokenizer files of that version (``NAME@FILE``):
    SentencePiece templates (``spm=True``) on the v1/v2/v3/v7 .model files, Tekken ones on the two v3 Tekken
    files. No v7+ Tekken file ships with mistral-common 1.12: v7-v15 Tekken stay on the reconstructed one."""
    from .shipped_mistral import FILES

    out = []
    for name, config in mistral_configs():
        for short, (_, kind, version) in FILES.items():
            if version == config["version"] and (kind == "spm") == config["spm"]:
                out.append(Entry(f"{name}@{short}", f"shipped:{short}", functools.partial(mistral_template, **config),
                                 kind="mistral", string_args=True))
        # the later [INST] templates on the v1 file, where [INST] and [/INST] are plain text (issue 43: a reply
        # opening with a space there read without it, and broke)
        if config["version"] in ("v2", "v3", "v7", "v11"):
            out.append(Entry(f"{name}@spm-v1-text", "shipped:spm-v1", functools.partial(mistral_template, **config),
                             kind="mistral", string_args=True))
    return out


def _mutated(base: Entry, mutation: Callable[[str, list[str]], str | None]) -> str:
    tok, _ = _tokenizers(base.tokenizer)
    out = mutation(base.template, sorted(tok.added_tokens))
    if out is None:
        raise NotApplicable(f"{mutation.__name__} does not apply to {base.id}")
    return out


class NotApplicable(Exception):
    """A mutation that finds nothing to change in a template."""


# ---- conversations --------------------------------------------------------------------------------

WORDS = ("What", "is", "2+2?", "And", "3+3?", "Paris", "weather", "résumé", "数据", "🙂", "ok.", "x = 1", "(a)",
         "don't", "100%", "e.g.", "C++", "Zürich", "line\nbreak", "tab\there", "42")
TOOL_DEFS = [
    {"type": "function", "function": {
        "name": name, "description": f"{name} tool",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}},
                       "required": ["q"]}}}
    for name in ("search", "calculator")
]


# whitespace a content may open or close with: spaces, a tab, newlines (LF, CRLF), no-break and ideographic spaces
EDGES = (" ", "  ", "\t", "\n", "\n\n", "\r\n", " \n", "\u00a0", "\u3000")


class _Gen:
    def __init__(self, seed: int, string_args: bool = False) -> None:
        self.r = random.Random(seed)
        self.string_args = string_args

    def text(self) -> str:
        """Words, now and then empty or with whitespace at an edge (issue 43: each kind, alone or on both
        edges), where tokenizers that merge a space or newline into the next word break needlessly."""
        r = self.r
        if r.random() < 0.05:
            return ""
        s = " ".join(r.choice(WORDS) for _ in range(r.randint(1, 6)))
        if r.random() < 0.25:
            s = r.choice(EDGES) + s
        if r.random() < 0.25:
            s += r.choice(EDGES)
        return s

    def call_id(self) -> str:  # Mistral's templates take 9 alphanumerics
        return "".join(self.r.choice(string.ascii_letters + string.digits) for _ in range(9))

    def arguments(self) -> dict | str:
        """A dict, or the JSON string of the OpenAI wire form (``string_args``: only that; Mistral's
        v2-v7 templates concatenate a dict's ``tojson|safe`` and transformers then HTML-escapes the
        quotes around it, which no model samples)."""
        args = {"q": self.text(), "n": self.r.randint(0, 99)}
        if self.string_args:
            return json.dumps(args, ensure_ascii=False)
        return args

    def conversation(self) -> tuple[list[dict], list[dict] | None]:
        r = self.r
        tools = TOOL_DEFS if r.random() < 0.4 else None
        msgs: list[dict] = [{"role": "system", "content": self.text()}] if r.random() < 0.4 else []
        for _ in range(r.randint(2, 4)):
            msgs.append({"role": "user", "content": self.text()})
            if tools and r.random() < 0.5:
                calls = [{"id": self.call_id(), "type": "function",
                          "function": {"name": r.choice(TOOL_DEFS)["function"]["name"],
                                       "arguments": self.arguments()}}
                         for _ in range(r.choice((1, 1, 2)))]
                turn: dict[str, Any] = {"role": "assistant", "content": "" if r.random() < 0.6 else self.text(),
                                        "tool_calls": calls}
                if r.random() < 0.25:
                    turn["reasoning_content"] = self.text()
                msgs.append(turn)
                msgs.extend({"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"r": self.text()})}
                            for c in calls)
            turn = {"role": "assistant", "content": self.text()}
            if r.random() < 0.25:
                turn["reasoning_content"] = self.text()
            msgs.append(turn)
        msgs.append({"role": "user", "content": self.text()})
        return msgs, tools


def conversations(seed: int, n: int, string_args: bool = False) -> list[tuple[list[dict], list[dict] | None]]:
    """``n`` seeded conversations, each ending on a user message (the same seed gives the same ones)."""
    gen = _Gen(seed, string_args)
    fixed = [  # the simplest case, with and without tools
        ([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
          {"role": "user", "content": "And 3+3?"}], tools) for tools in (None, TOOL_DEFS)
    ]
    return fixed + [gen.conversation() for _ in range(n)]


# ---- measurement ----------------------------------------------------------------------------------


def cases(entry: Entry, convs, counts: dict) -> Iterator[BridgeCase]:
    """Every assistant turn followed by other messages that transformers renders (a template that rejects
    a conversation or a prefix of it skips the turn: counted in ``counts["skipped"]``)."""
    stops = set(entry.renderer().stop_token_ids)
    for messages, tools in convs:
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            nxt = next((j for j in range(k + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
            try:
                prompt = entry.reference_ids(messages[:k], tools, True)
                full = entry.reference_ids(messages[: k + 1], tools, False)
                expected = entry.reference_ids(messages[:nxt], tools, True)
            except (jinja2.TemplateError, TypeError, ValueError):
                counts["skipped"] += 1
                continue
            # what the model sampled: the turn's ids after the prompt, through its last stop token
            rest = full[len(prompt):] if full[: len(prompt)] == prompt else []
            ends = [i for i, t in enumerate(rest) if t in stops]
            if not ends:
                counts["skipped"] += 1
                continue
            yield BridgeCase(k, messages, tools, messages[k + 1 : nxt], prompt, rest[: ends[-1] + 1], expected)


def measure(entry: Entry, seed: int, n: int, examples: list | None = None) -> dict:
    """Bridge every case of ``conversations(seed, n)`` from ids alone on a fresh renderer; the counts (see
    the module docstring)."""
    return measure_conversations(entry, conversations(seed, n, entry.string_args), examples)


def measure_conversations(entry: Entry, convs, examples: list | None = None) -> dict:
    """:func:`measure` on these conversations (``(messages, tools)`` pairs)."""
    c = {"turns": 0, "stable": 0, "breaks": 0, "needless": 0, "ambiguous": 0, "exact": 0, "wrong": 0, "drift": 0,
         "skipped": 0, "unequal": 0}
    for case in cases(entry, convs, c):
        # parity first: the renderer's render of the conversation through the new messages
        try:
            mine = entry.renderer().render_ids(case.messages[: case.k + 1 + len(case.new)], case.tools, True)
        except ValueError:
            mine = None
        if mine != case.expected:
            c["unequal"] += 1
            if examples is not None:
                examples.append((entry.id, case.k, "render differs from transformers", ""))
        result = entry.renderer().bridge(case.prompt, case.completion, case.new, case.tools)
        c["turns"] += 1
        c["stable"] += case.stable
        if isinstance(result, Break):
            c["breaks"] += 1
            if case.stable and _ambiguous(entry, case):
                c["ambiguous"] += 1
            elif case.stable:
                c["needless"] += 1
                if examples is not None:
                    examples.append((entry.id, case.k, result.reason.value, result.detail[:160]))
            continue
        assert result.token_ids[: result.prefix_len] == case.prompt + case.completion, entry.id
        if not case.stable:
            c["drift"] += 1
        elif result.token_ids == case.expected:
            c["exact"] += 1
        else:
            c["wrong"] += 1
            if examples is not None:
                examples.append((entry.id, case.k, "wrong", ""))
    return c


def _ambiguous(entry: Entry, case: BridgeCase) -> bool:
    """Whether the previous prompt's ids fit several conversations that continue differently, checked
    with transformers: the readings come from the renderer's recovery, but each must render to the
    prompt's ids exactly, and their renders with the true sampled turn and the new messages must differ."""
    try:
        from tito_renderers.recover import recover_conversations
    except ImportError:  # an older checkout's renderers (scripts/measure_bridge_gaps.py --renderers)
        return False
    readings = recover_conversations(entry.renderer(), case.prompt, case.tools)
    try:
        if len(readings) < 2 or any(entry.reference_ids(r, case.tools, True) != case.prompt for r in readings):
            return False
        turn = [case.messages[case.k], *case.new]
        return len({tuple(entry.reference_ids([*r, *turn], case.tools, True)) for r in readings}) > 1
    except (jinja2.TemplateError, TypeError, ValueError):
        return False


def table(ids: list[str], seed: int, n: int, examples: list | None = None) -> dict:
    """Measure every corpus entry whose id contains one of ``ids`` (every entry where empty), printing a
    markdown row per entry as it goes; the totals, with ``bad`` = needless + wrong + unequal."""
    import time

    print("| template | turns | append-stable | breaks | needless | ambiguous | wrong | drift | exact | unequal | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals: dict[str, int] = {}
    for entry in corpus():
        if ids and not any(i in entry.id for i in ids):
            continue
        start = time.perf_counter()
        try:
            c = measure(entry, seed, n, examples)
        except NotApplicable:
            continue
        for key, value in c.items():
            totals[key] = totals.get(key, 0) + value
        print(f"| {entry.id} | {c['turns']} | {c['stable']} | {c['breaks']} | {c['needless']} | {c['ambiguous']} | "
              f"{c['wrong']} | {c['drift']} | {c['exact']} | {c['unequal']} | {time.perf_counter() - start:.1f} |",
              flush=True)
    totals["bad"] = totals.get("needless", 0) + totals.get("wrong", 0) + totals.get("unequal", 0)
    return totals
