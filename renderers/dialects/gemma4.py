"""Gemma 4: reasoning in a ``<|channel>thought\\n...<channel|>`` block, tool calls as
``<|tool_call>call:NAME{key:VALUE,...}<tool_call|>``, and ``<|tool_response>`` as a stop (the template
closes a tool-calling turn with it: the model stops there and waits for the results).

The call body is the template's ``format_argument`` notation, not JSON: keys bare, strings between two
``<|"|>`` tokens (no escaping inside), numbers, ``true``/``false``, ``None`` (Jinja prints Python's
None), nested ``{k:v}`` and ``[v,...]``. Values carry their types, so the arguments are not typed by
schema. Strings are cut out by the ``<|"|>`` token ids, so a string value may hold any text: a ``}``
or a ``,`` in it is never structure. The template sorts keys (``dictsort``); a dict compares equal
whatever the order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Sequence
from typing import Any

from ..types import ParsedResponse, ToolCall, ToolCallStatus
from . import Dialect, Offered, register
from .json_calls import checked_call

QUOTE = '<|"|>'
CHANNEL_NAME = "thought"  # the only channel the template writes; the block's first line names it
_PUNCT = "{}[]:,"


@register
class Gemma4(Dialect):
    name = "gemma4"
    priority = 20
    markers = ("<|tool_call>", "<tool_call|>", "<|turn>", "<turn|>")
    think = ("<|channel>", "<channel|>")
    call = ("<|tool_call>", "<tool_call|>")
    stops = ("<turn|>", "<|tool_response>")

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: Any = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        stop_ids: Collection[int] | None = None,
    ) -> ParsedResponse:
        """The base scan with ``<|tool_response>`` always a stop (a caller's stop ids may lack it: the
        template's turn close is ``<turn|>``), and the channel's name line taken off the reasoning."""
        stops = self.stop_ids if stop_ids is None else tuple(dict.fromkeys([*stop_ids, *self.stop_ids]))
        parsed = super().parse(completion_ids, tools, prompt_ids=prompt_ids, stop_ids=stops)
        if parsed.reasoning_content is not None and parsed.reasoning_content.startswith(CHANNEL_NAME):
            rest = parsed.reasoning_content[len(CHANNEL_NAME) :]
            if not rest or rest[0].isspace():
                parsed.reasoning_content = rest.strip()
        return parsed

    def parse_call(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> ToolCall:
        decode = self.tokenizer.decode
        raw = decode(body_ids)
        quote = self.tokenizer.markers.get(QUOTE)
        if quote is not None:  # split on the token: string values are the odd pieces
            pieces, run = [], []
            for tid in body_ids:
                if tid == quote:
                    pieces.append(decode(run))
                    run = []
                else:
                    run.append(tid)
            pieces.append(decode(run))
        else:  # a vocabulary without the quote token: the same split on its text
            pieces = raw.split(QUOTE)
        return parse_gemma_call(pieces, span, raw, offered.names)


class _Malformed(ValueError):
    pass


def parse_gemma_call(pieces: list[str], span: tuple[int, int], raw: str, tool_names: set[str] | None) -> ToolCall:
    """``call:NAME{...}`` from the body split at its string quotes (even pieces: structure text, odd
    pieces: string values) -> a ToolCall with a status, never an exception."""
    if len(pieces) % 2 == 0:
        return ToolCall(None, None, ToolCallStatus.INVALID_ARGUMENTS, span, raw, f"a {QUOTE} string is not closed")
    head = pieces[0].lstrip()
    if not head.startswith("call:"):
        return ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, "expected call:NAME{...}")
    brace = head.find("{")
    name = (head[5:brace] if brace >= 0 else head[5:]).strip()
    if not name:
        return ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, "no function name after call:")
    if brace < 0:
        return ToolCall(name, None, ToolCallStatus.INVALID_ARGUMENTS, span, raw, f"no {{...}} arguments after {name!r}")
    tokens = _lex([head[brace:], *pieces[1:]])
    try:
        value, pos = _value(tokens, 0)
        if pos != len(tokens):
            raise _Malformed(f"text after the arguments: {tokens[pos][1]!r}")
    except (_Malformed, IndexError, RecursionError) as exc:
        error = str(exc) if isinstance(exc, _Malformed) else "the arguments end early"
        return ToolCall(name, None, ToolCallStatus.INVALID_ARGUMENTS, span, raw, error)
    return checked_call(name, value, span, raw, tool_names)


def _lex(pieces: list[str]) -> list[tuple[str, str]]:
    """Tokens: ("p", one of ``{}[]:,``), ("s", a quoted string), ("w", a bare word, stripped)."""
    out: list[tuple[str, str]] = []
    for k, piece in enumerate(pieces):
        if k % 2:
            out.append(("s", piece))
            continue
        word: list[str] = []
        for ch in piece:
            if ch in _PUNCT:
                if "".join(word).strip():
                    out.append(("w", "".join(word).strip()))
                word = []
                out.append(("p", ch))
            else:
                word.append(ch)
        if "".join(word).strip():
            out.append(("w", "".join(word).strip()))
    return out


_WORDS = {"true": True, "false": False, "None": None, "null": None}


def _scalar(word: str) -> Any:
    if word in _WORDS:
        return _WORDS[word]
    if word in ("inf", "-inf", "nan"):  # Python's str of a float the template printed
        return float(word)
    try:
        value = json.loads(word)
    except ValueError:
        raise _Malformed(f"not a value: {word!r}") from None
    if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        raise _Malformed(f"not a value: {word!r}")
    return value


def _value(tokens: list[tuple[str, str]], i: int) -> tuple[Any, int]:
    kind, text = tokens[i]
    if kind == "s":
        return text, i + 1
    if kind == "w":
        return _scalar(text), i + 1
    if text == "{":
        obj: dict[str, Any] = {}
        i += 1
        if tokens[i] == ("p", "}"):
            return obj, i + 1
        while True:
            key_kind, key = tokens[i]
            if key_kind == "p" or tokens[i + 1] != ("p", ":"):
                raise _Malformed(f"expected KEY: in an object, got {key!r}")
            obj[key], i = _value(tokens, i + 2)
            if tokens[i] == ("p", ","):
                i += 1
            elif tokens[i] == ("p", "}"):
                return obj, i + 1
            else:
                raise _Malformed(f"expected , or }} after {key!r}, got {tokens[i][1]!r}")
    if text == "[":
        items: list[Any] = []
        i += 1
        if tokens[i] == ("p", "]"):
            return items, i + 1
        while True:
            item, i = _value(tokens, i)
            items.append(item)
            if tokens[i] == ("p", ","):
                i += 1
            elif tokens[i] == ("p", "]"):
                return items, i + 1
            else:
                raise _Malformed(f"expected , or ] in a list, got {tokens[i][1]!r}")
    raise _Malformed(f"unexpected {text!r}")
