"""Content mutants of the gap-finding corpus's conversations (tests/bridge_gaps.py; issue 43).

A mutant is a corpus conversation with one text changed: a message's content (user, assistant, system or
tool), an assistant turn's reasoning, or a string argument of a tool call. The changes (:data:`KINDS`):

- ``lead:K`` / ``trail:K`` / ``both:K``: whitespace ``K`` (one of ``bridge_gaps.EDGES``: spaces, a tab,
  LF, CRLF, no-break and ideographic spaces) opening, closing or around the text;
- ``mixed``: several kinds at both edges at once; ``blank``: the text is whitespace only; ``empty``;
- ``inner:U``: every space inside the text replaced by a unicode space ``U`` (:data:`INNER`);
- ``delimiter:D``: the text is exactly the text of a delimiter the template writes (one of its added
  tokens, or a plain-text marker such as ``[INST]`` or ``<<SYS>>``: :func:`delimiters`).

Each mutant is measured as the corpus is (``bridge_gaps.measure_conversations``): parity of the
renderer's render with transformers', and for every assistant turn the bridge from ids alone on a fresh
renderer: no needless break, no wrong bridge, no drift. Expected ids come from transformers only.
tests/test_mutants.py runs a seeded sample; scripts/measure_mutants.py every mutant of more conversations
(figures in docs/fidelity.md).
"""

from __future__ import annotations

import copy
import functools
import json
import random
import re
from collections.abc import Iterator
from typing import Any

from .bridge_gaps import EDGES, Entry, conversations

# unicode spaces put inside a text: no-break, thin, narrow no-break, ideographic, and a zero-width space
INNER = ("\u00a0", "\u2009", "\u202f", "\u3000", "\u200b")
# plain-text markers templates write that a user may also type
PLAIN_DELIMITERS = ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>", "</s>", "<|im_end|>", "<|eot_id|>", "\n\n")


def kinds(delims: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(label, function of a text) for every change."""
    out: list[tuple[str, Any]] = []
    for k in EDGES:
        out += [(f"lead:{k!r}", lambda t, k=k: k + t), (f"trail:{k!r}", lambda t, k=k: t + k),
                (f"both:{k!r}", lambda t, k=k: k + t + k)]
    out += [("mixed", lambda t: " \n\t" + t + "\r\n \u00a0"), ("blank", lambda t: " \n "), ("empty", lambda t: "")]
    out += [(f"inner:{u!r}", lambda t, u=u: t.replace(" ", u) if " " in t else f"a{u}{t}") for u in INNER]
    out += [(f"delimiter:{d!r}", lambda t, d=d: d) for d in delims]
    return out


KINDS = kinds(PLAIN_DELIMITERS)


def delimiters(entry: Entry) -> tuple[str, ...]:
    """The added tokens the entry's template writes, and the plain-text markers."""
    used = sorted(t for t in markers(entry.pair[1]) if t in entry.template)
    return tuple(dict.fromkeys([*used, *PLAIN_DELIMITERS]))


def slots(messages: list[dict]) -> Iterator[tuple[int, str, int | None]]:
    """Every text a mutant may change: (message index, field, tool-call index or None)."""
    for i, m in enumerate(messages):
        yield i, "content", None
        if "reasoning_content" in m:
            yield i, "reasoning_content", None
        for j, _ in enumerate(m.get("tool_calls") or ()):
            yield i, "arguments", j


def mutate(messages: list[dict], slot: tuple[int, str, int | None], change) -> list[dict]:
    """A copy of ``messages`` with the text at ``slot`` changed by ``change``. A tool result's content is
    the JSON the corpus writes, with the change made to its text; an argument is the ``q`` string."""
    out = copy.deepcopy(messages)
    i, field, j = slot
    m = out[i]
    if field == "arguments":
        function = m["tool_calls"][j]["function"]
        args = function["arguments"]
        parsed = json.loads(args) if isinstance(args, str) else args
        parsed["q"] = change(parsed.get("q", ""))
        function["arguments"] = json.dumps(parsed, ensure_ascii=False) if isinstance(args, str) else parsed
    elif m["role"] == "tool":
        m["content"] = change(m["content"])  # the whole result text: its edges are the message's edges
    else:
        m[field] = change(m.get(field) or "")
    return out


def mutants(entry: Entry, seed: int, n: int, per_conversation: int | None) -> Iterator[tuple[str, list[dict], Any]]:
    """(label, messages, tools) for mutants of ``conversations(seed, n)``: every (slot, change) of each
    conversation where ``per_conversation`` is None, else that many drawn with ``seed``."""
    r = random.Random(seed)
    changes = kinds(delimiters(entry))
    for c, (messages, tools) in enumerate(conversations(seed, n, entry.string_args)):
        pairs = [(s, k) for s in slots(messages) for k in changes]
        if per_conversation is not None:
            pairs = r.sample(pairs, min(per_conversation, len(pairs)))
        for slot, (label, change) in pairs:
            i, field, j = slot
            where = f"{messages[i]['role']}[{i}].{field}" + ("" if j is None else f"[{j}]")
            yield f"conv{c} {where} {label}", mutate(messages, slot, change), tools


# ---- the reference where a text holds a marker ------------------------------------------------------


class MarkersAsText:
    """``entry`` whose reference reads a marker inside message text as text, as tito's renderer does
    (docs/renderers.md "marker safety") and as mistral-common's own tokenizer does: transformers'
    ``apply_chat_template`` text is split on the template's markers only, and each run between them
    encoded by transformers' backend tokenizer without the markers as added tokens. Where no text holds a marker this is
    transformers' ids exactly; where one does, the run-by-run encoding is first checked to give
    transformers' own ids for the same render with the markers replaced by private-use placeholders
    (else :class:`NotFaithful`: the tokenizer does not encode run by run). Where the template renders the
    text with a marker otherwise than with its placeholder (it branched on the marker), the reference is
    transformers' ids: the template meant the marker."""

    def __init__(self, entry: Entry) -> None:
        self.entry = entry
        self.marker_ids = markers(entry.pair[1])
        self.markers = sorted(self.marker_ids, key=len, reverse=True)
        self.split = re.compile("(" + "|".join(re.escape(m) for m in self.markers) + ")") if self.markers else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.entry, name)

    def reference_ids(self, messages: list[dict], tools: Any, agp: bool) -> list[int]:
        marked = _with_placeholders(messages, self.markers)
        if marked == messages:
            return self.entry.reference_ids(messages, tools, agp)
        import tito_renderers as renderers

        hf = self.entry.pair[1]
        text = hf.apply_chat_template(renderers.normalize_messages(marked), tools=tools, tokenize=False,
                                      add_generation_prompt=agp)
        raw = hf.apply_chat_template(renderers.normalize_messages(messages), tools=tools, tokenize=False,
                                     add_generation_prompt=agp)
        if _restore(text, self.markers) != raw:
            # the template branched on the marker (Qwen3 splits a reply on "</think>"): its intent is the
            # marker, and the reference transformers' ids (docs/renderers.md, marker safety, case 3)
            return self.entry.reference_ids(messages, tools, agp)
        if self._runs(text, restore=False) != list(hf(text, add_special_tokens=False)["input_ids"]):
            raise NotFaithful(f"{self.entry.id}: the tokenizer does not encode a render run by run")
        return self._runs(text, restore=True)

    def _runs(self, text: str, restore: bool) -> list[int]:
        """The ids of ``text`` split on the template's markers, each run encoded alone (its placeholders
        back to the markers' text where ``restore``)."""
        ids: list[int] = []
        for part in self.split.split(text):
            if part in self.marker_ids:
                ids.append(self.marker_ids[part])
            elif part:
                part = _restore(part, self.markers) if restore else part
                ids += self._plain.encode(part, add_special_tokens=False).ids
        return ids

    @functools.cached_property
    def _plain(self):
        """transformers' backend tokenizer without the markers as added tokens (the ``tokenizers``
        library's own: a marker's text then encodes as the vocabulary spells it)."""
        from tokenizers import Tokenizer

        config = json.loads(self.entry.pair[1].backend_tokenizer.to_str())
        config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] not in self.marker_ids]
        return Tokenizer.from_str(json.dumps(config))


def markers(hf) -> dict[str, int]:
    """The added tokens of a transformers tokenizer that structure a conversation: all of them, except in
    a vocabulary that also has added tokens for ordinary text (whitespace or "▁" only, not special:
    Gemma's newline runs), where only the special ones (docs/renderers.md, "marker safety")."""
    decoder = hf.added_tokens_decoder
    text_level = any(not t.special and t.content and not t.content.replace("▁", " ").strip() for t in decoder.values())
    return {t.content: i for i, t in decoder.items() if t.content and (t.special or not text_level)}


class NotFaithful(Exception):
    """A tokenizer whose ids for a render are not its runs' ids between markers, joined."""


def _placeholder(k: int) -> str:
    return f"\ue000{k}\ue001"


def _with_placeholders(value: Any, markers: list[str]) -> Any:
    """``value`` (messages) with each marker inside a string replaced by its placeholder (roles kept)."""
    if isinstance(value, str):
        for k, m in enumerate(markers):
            if m in value:
                value = value.replace(m, _placeholder(k))
        return value
    if isinstance(value, list):
        return [_with_placeholders(v, markers) for v in value]
    if isinstance(value, dict):
        return {k: v if k == "role" else _with_placeholders(v, markers) for k, v in value.items()}
    return value


def _restore(text: str, markers: list[str]) -> str:
    for k, m in enumerate(markers):
        text = text.replace(_placeholder(k), m)
    return text
