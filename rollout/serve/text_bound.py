"""The bytes bound: text that cannot fit ``max_model_len`` tokens is refused before anything tokenizes it.

No token of the vocabulary decodes to more than ``state.max_token_bytes`` bytes, so a text of B bytes (after
the tokenizer's normalizer, stripped) needs at least B / max_token_bytes tokens. A chat request is bounded by
every text it carries, not only those a template is sure to render: each message's strings whatever its role
(assistant content, ``reasoning_content``, tool calls' arguments, tool results) and the tool definitions,
keys included (a tool's parameter names render). A template may drop some of it (earlier reasoning), but
the renderers still read and tokenize what the client sent, so the bound is on the request: a 24 MB
assistant message is refused in milliseconds instead of tokenized into 12.6 M tokens first.

The count is cheap: characters alone below the bound, then UTF-8 bytes after the tokenizer's Unicode normal
form, computed with Python's ``unicodedata`` (C, and its quick check passes ASCII or already normal text
at once; the tokenizers library's ``normalize_str`` takes 2.8 s over 24 MB of ASCII, holding the GIL).
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from .schemas import BadRequest

UNICODE_FORMS = frozenset({"NFC", "NFD", "NFKC", "NFKD"})


def _steps(spec: Any) -> list[dict]:
    if not isinstance(spec, dict):
        return []
    if spec.get("type") == "Sequence":
        return [s for child in spec.get("normalizers") or [] for s in _steps(child)]
    return [spec]


def normalizer_forms(backend: Any) -> tuple[str, ...] | None:
    """The tokenizer's normalizer as the Unicode normal forms it applies, in order. Steps that never
    shorten a text (Prepend, a Replace of a string by one at least as long, Gemma's " " -> "▁") are left
    out, so the count stays a lower bound. None: a step that may shorten text some other way (Lowercase,
    BertNormalizer, a regex Replace...): the tokenizer's own normalizer is used then."""
    normalizer = backend.normalizer
    if normalizer is None:
        return ()
    forms = []
    for step in _steps(json.loads(normalizer.__getstate__())):
        kind, pattern = step.get("type"), step.get("pattern") or {}
        if kind in UNICODE_FORMS:
            forms.append(kind)
        elif kind == "Prepend" or (kind == "Replace" and isinstance(pattern.get("String"), str)
                                   and len(step.get("content", "").encode()) >= len(pattern["String"].encode())):
            continue
        else:
            return None
    return tuple(forms)


def strings(value: Any) -> list[str]:
    """Every string in a JSON value, dict keys included (iterative: the depth was bounded by decode)."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            out.extend(k for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def normalized_bytes(state: Any, text: str) -> int:
    """UTF-8 bytes of ``text`` stripped and normalized as the tokenizer does (a lower bound, see
    normalizer_forms)."""
    text = text.strip()
    forms = state.normalizer_forms
    if forms is None:
        text = state.parser.tokenizer.backend.normalizer.normalize_str(text)
    else:
        for form in forms:  # ASCII is the same in every form
            if not text.isascii() and not unicodedata.is_normalized(form, text):
                text = unicodedata.normalize(form, text)
    return len(text.encode("utf-8", "surrogatepass"))


def check_text(state: Any, parts: dict[str, list[str]], room: int, fits: str) -> None:
    """BadRequest when the texts of ``parts`` (request field -> its strings) need more than ``room``
    tokens by the bytes bound; it names the field holding most of the text."""
    limit = state.max_token_bytes * room
    if 4 * sum(len(t) for texts in parts.values() for t in texts) <= limit:  # a character is at most 4 bytes
        return
    sizes = {param: sum(normalized_bytes(state, t) for t in texts) for param, texts in parts.items()}
    total = sum(sizes.values())
    if total > limit:
        param = max(sizes, key=sizes.__getitem__)
        raise BadRequest(f"{param}: {total} bytes of text in {' and '.join(parts)} need more than {room} tokens "
                         f"(no token of this vocabulary is longer than {state.max_token_bytes} bytes), so {fits} "
                         f"cannot fit max_model_len {state.fleet.max_model_len}", param)


def check_chat_text(state: Any, messages: list[dict], tools: list[dict] | None) -> None:
    """The bound on a chat request: every text of ``messages`` and ``tools`` against max_model_len - 1 (a
    prompt must leave a token to sample)."""
    check_text(state, {"messages": strings(messages), "tools": strings(tools)}, state.fleet.max_model_len - 1,
               "the prompt")
