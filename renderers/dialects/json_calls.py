"""JSON tool calls: one ``{"name": ..., "arguments": {...}}`` body (:func:`parse_json_call`), a named call's
decoded arguments (:func:`checked_call`, which every JSON-carrying format ends in), and several calls in
one run of text (:func:`json_calls`): a JSON array of them (Mistral's ``[TOOL_CALLS][...]``, Nemotron Nano
v2's ``<TOOLCALL>[...]</TOOLCALL>``) or objects one after another, separated by whitespace, ``,`` or
``;`` (Llama 3 fine-tunes). Each call gets a status instead of an exception, and its own token span."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..types import ToolCall, ToolCallStatus
from . import token_index_at


def parse_json_call(raw: str, span: tuple[int, int], tool_names: set[str] | None) -> ToolCall:
    """A ``{"name": ..., "arguments": {...}}`` tool call body, with a status instead of an exception.

    Arguments that arrive double-encoded (a JSON string holding an object) are decoded once, a
    failure mode of real models; anything else that is not an object is ``invalid_arguments``.
    """
    text = raw.strip()
    try:
        obj = json.loads(text)
    except ValueError as exc:
        return ToolCall(None, None, ToolCallStatus.INVALID_JSON, span, raw, f"not JSON: {exc}")
    if not isinstance(obj, dict):
        return ToolCall(
            None, None, ToolCallStatus.NOT_AN_OBJECT, span, raw, f"expected an object, got {type(obj).__name__}"
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, "no string 'name' field")
    call = checked_call(name, obj.get("arguments", obj.get("parameters", {})), span, raw, tool_names)
    if isinstance(obj.get("id"), str):  # Mistral v2-v7 write the call's id in the object
        call.id = obj["id"]
    return call


def checked_call(name: str, args: Any, span: tuple[int, int], raw: str, tool_names: set[str] | None) -> ToolCall:
    """A named call's decoded arguments, checked: arguments that arrive double-encoded (a JSON string
    holding an object, a failure mode of real models) are decoded once; anything else that is not an
    object is ``invalid_arguments``; a name not among ``tool_names`` is ``unknown_tool``."""
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except ValueError:
            decoded = None
        if isinstance(decoded, dict):
            args = decoded
    if not isinstance(args, dict):
        error = f"arguments must be an object, got {type(args).__name__}"
        return ToolCall(name, None, ToolCallStatus.INVALID_ARGUMENTS, span, raw, error)
    if tool_names is not None and name not in tool_names:
        return ToolCall(name, args, ToolCallStatus.UNKNOWN_TOOL, span, raw, f"no tool named {name!r} was offered")
    return ToolCall(name, args, ToolCallStatus.OK, span, raw)


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
