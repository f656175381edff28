"""Several ``{"name": ..., "arguments": {...}}`` JSON calls in one run of text: a JSON array of them
(Mistral's ``[TOOL_CALLS][...]``, Nemotron Nano v2's ``<TOOLCALL>[...]</TOOLCALL>``) or objects one
after another, separated by whitespace, ``,`` or ``;`` (Llama 3 fine-tunes). Shared by those
dialects; each call is checked by :func:`renderers.base.parse_json_call` (double-encoded arguments
decoded once, non-objects invalid, unoffered names unknown) and gets its own token span."""

from __future__ import annotations

import json
from collections.abc import Callable

from ..base import parse_json_call
from ..types import ToolCall, ToolCallStatus
from . import token_index_at

_DECODER = json.JSONDecoder()
_SEPARATORS = " \t\r\n,;"


def value_spans(text: str, array: bool) -> list[tuple[int, int]] | None:
    """Character spans of the JSON values in ``text``: the elements of one array (``array``), else
    top-level values one after another (between them only whitespace, ``,`` or ``;``). None when the
    text is not that shape (a broken value, other text around them)."""
    spans: list[tuple[int, int]] = []
    i, n = 0, len(text)
    while i < n and text[i].isspace():
        i += 1
    if array:
        if i == n or text[i] != "[":
            return None
        i += 1
    while True:
        while i < n and (text[i] in _SEPARATORS if not array else text[i].isspace()):
            i += 1
        if i == n:
            return None if array else spans
        if array and text[i] == "]":
            return spans if not text[i + 1 :].strip() else None
        try:
            _, end = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        spans.append((i, end))
        i = end
        if array:
            while i < n and text[i].isspace():
                i += 1
            if i < n and text[i] == ",":
                i += 1
            elif i == n or text[i] != "]":
                return None


def json_calls(
    decode: Callable[[list[int]], str],
    body_ids: list[int],
    span: tuple[int, int],
    tool_names: set[str] | None,
    array: bool = True,
    body_start: int | None = None,
) -> list[ToolCall]:
    """The calls in ``body_ids``: a JSON array (``array``) or JSON objects in a row. ``span`` covers the
    block with its markers; the body starts at ``body_start`` (default ``span[0] + 1``, after an open
    marker). Each call's span runs to the next call's start. A body that is not that shape is one call
    with the status JSON gives it (``invalid_json`` for text that does not parse, ``not_an_object``
    for JSON that is not an array)."""
    raw = decode(body_ids)
    spans = value_spans(raw, array)
    if spans is None:
        if not array or raw.lstrip().startswith("{"):  # one object where an array was due: one call
            return [parse_json_call(raw, span, tool_names)]
        try:
            json.loads(raw)
        except (ValueError, RecursionError) as exc:
            return [ToolCall(None, None, ToolCallStatus.INVALID_JSON, span, raw, f"not JSON: {exc}")]
        return [ToolCall(None, None, ToolCallStatus.NOT_AN_OBJECT, span, raw, "expected a JSON array of calls")]
    if not spans:
        return []
    first = span[0] + 1 if body_start is None else body_start
    starts = [span[0]] + [first + token_index_at(decode, body_ids, s) for s, _ in spans[1:]]
    ends = starts[1:] + [span[1]]
    return [parse_json_call(raw[s:e], (a, b), tool_names) for (s, e), a, b in zip(spans, starts, ends)]
