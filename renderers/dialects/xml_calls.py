"""Qwen3-Coder's XML tool calls (``<function=NAME>`` with ``<parameter=KEY>`` blocks), and typing their text
arguments by the offered tools' JSON schemas.

The template writes a string argument verbatim, a dict or list with ``tojson`` and any other value with
Python's ``str``, so the text of a call does not say which type a value had: :func:`parse_xml_call`
reads names and string values; :func:`type_call` coerces each value back with its parameter's schema.
Used by the Qwen3-Coder renderer and by every dialect whose arguments are text (``string_arguments``)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..types import ToolCall, ToolCallStatus

# ---- the XML call format -----------------------------------------------------------------------

_FUNCTION_OPEN = "<function="
_FUNCTION_CLOSE = "</function>"
_PARAMETER_OPEN = "<parameter="
_PARAMETER_CLOSE = "</parameter>"


def _snippet(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_xml_call(raw: str, span: tuple[int, int]) -> ToolCall:
    """One call body (the text between ``<tool_call>`` and ``</tool_call>``) -> name and string arguments.

    The body is ``<function=NAME>``, parameters, ``</function>``, separated by any whitespace (the
    template writes ``\\n``). A parameter is ``<parameter=KEY>`` + value + ``</parameter>``; the value
    loses exactly one leading and one trailing ``\\n`` (the template adds exactly those), so values
    that start or end with newlines round-trip. A value ends at the first ``</parameter>`` followed
    (after whitespace) by another ``<parameter=`` or the end of the function block, so a value may
    itself contain ``</parameter>`` elsewhere. Values stay strings here (see :func:`type_call`).

    Statuses: ``missing_name`` (no ``<function=NAME>`` tag, or an empty or malformed name),
    ``invalid_arguments`` (the function block is not closed, a parameter tag has no name or is not
    closed, text that is not a parameter inside the block or after it, a parameter given twice).
    The arguments parsed before a structural error are kept on the call (the caller drops them
    unless the call was cut off)."""
    args: dict[str, Any] = {}

    def fail(status: ToolCallStatus, error: str, name: str | None = None) -> ToolCall:
        return ToolCall(name, args, status, span, raw, error)

    pos = len(raw) - len(raw.lstrip())
    if not raw.startswith(_FUNCTION_OPEN, pos):
        return fail(ToolCallStatus.MISSING_NAME, f"expected <function=NAME>, got {_snippet(raw.strip())}")
    name_end = raw.find(">", pos)
    name = raw[pos + len(_FUNCTION_OPEN) : name_end] if name_end >= 0 else ""
    if not name.strip() or "<" in name or "\n" in name:
        return fail(ToolCallStatus.MISSING_NAME, f"malformed function tag {_snippet(raw[pos:])}")
    close = raw.rfind(_FUNCTION_CLOSE)
    block_end = close if close > name_end else len(raw)
    error = _parse_parameters(raw[name_end + 1 : block_end], args, name)
    if error:
        return fail(ToolCallStatus.INVALID_ARGUMENTS, error, name)
    if close <= name_end:
        return fail(
            ToolCallStatus.INVALID_ARGUMENTS, f"the function block of {name!r} is not closed with </function>", name
        )
    trailing = raw[close + len(_FUNCTION_CLOSE) :]
    if trailing.strip():
        return fail(ToolCallStatus.INVALID_ARGUMENTS, f"text after </function>: {_snippet(trailing.strip())}", name)
    return ToolCall(name, args, ToolCallStatus.OK, span, raw)


def _parse_parameters(block: str, args: dict[str, Any], name: str) -> str | None:
    """Fill ``args`` from the parameters of one function block; an error message, or None."""
    i = 0
    n = len(block)
    while True:
        while i < n and block[i].isspace():
            i += 1
        if i == n:
            return None
        if not block.startswith(_PARAMETER_OPEN, i):
            return (
                f"unexpected text in the function block of {name!r}: {_snippet(block[i:])} (expected <parameter=KEY>)"
            )
        key_end = block.find(">", i)
        key = block[i + len(_PARAMETER_OPEN) : key_end] if key_end >= 0 else ""
        if not key or "<" in key or "\n" in key:
            return f"malformed parameter tag in {name!r}: {_snippet(block[i:])}"
        value_start = key_end + 1
        close = block.find(_PARAMETER_CLOSE, value_start)
        while close >= 0:
            rest = block[close + len(_PARAMETER_CLOSE) :].lstrip()
            if not rest or rest.startswith(_PARAMETER_OPEN):
                break
            close = block.find(_PARAMETER_CLOSE, close + 1)
        if close < 0:
            return f"parameter {key!r} of {name!r} is not closed with </parameter>"
        value = block[value_start:close]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if key in args:
            return f"parameter {key!r} of {name!r} is given twice"
        args[key] = value
        i = close + len(_PARAMETER_CLOSE)


# ---- typing the arguments ----------------------------------------------------------------------


def function_schemas(tools: list[dict] | None) -> dict[str, dict] | None:
    """Offered function name -> its ``parameters`` schema ({} when it has none); None without tools."""
    if not tools:
        return None
    out = {}
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters")
        out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def type_call(call: ToolCall, schemas: dict[str, dict] | None) -> ToolCall:
    """Apply the offered tools to a structurally parsed call.

    - a call cut off by the end of the completion (``unclosed``) keeps the parameters completed
      before the cut, as strings; any other structural failure has no arguments;
    - without tools, every value stays the string the model wrote (a string ``"42"`` and an integer
      ``42`` are the same text: any guess could corrupt a string argument);
    - a name that is not offered is ``unknown_tool`` (values stay strings);
    - otherwise each value is coerced with its parameter's schema (:func:`coerce_arguments`); a value
      that is not of its declared type is ``invalid_arguments`` naming the parameter and the type.
    """
    if call.status is ToolCallStatus.UNCLOSED:
        return call
    if call.status is not ToolCallStatus.OK:
        call.arguments = None
        return call
    if schemas is None:
        return call
    if call.name not in schemas:
        call.status, call.error = ToolCallStatus.UNKNOWN_TOOL, f"no tool named {call.name!r} was offered"
        return call
    typed, error = coerce_arguments(call.arguments or {}, schemas[call.name], call.name or "")
    if error is not None:
        call.status, call.arguments, call.error = ToolCallStatus.INVALID_ARGUMENTS, None, error
    else:
        call.arguments = typed
    return call


def coerce_arguments(args: dict[str, str], parameters: dict, name: str) -> tuple[dict[str, Any], str | None]:
    """String values -> typed values by the ``parameters`` schema's ``properties``.

    A parameter whose schema declares ``string`` (or no type this function knows, or that is not in
    the schema at all) keeps its text verbatim. ``integer``, ``number``, ``boolean``, ``object``,
    ``array`` and ``null`` are read as JSON, and also as the template prints Python values
    (``True``/``False``, ``None``, ``inf``), so that render -> parse returns the original values. A
    union (``"type": [...]``, ``anyOf``/``oneOf``) tries its non-string types first, then keeps the
    string. Returns (arguments, None) or (partial, error)."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    out: dict[str, Any] = {}
    for key, text in args.items():
        types = _schema_types(properties.get(key))
        typed = _coerce(text, types)
        if typed is _NO_MATCH:
            return out, f"parameter {key!r} of {name!r} must be {' or '.join(types)}, got {_snippet(text)}"
        out[key] = typed
    return out, None


_NO_MATCH = object()
_ORDER = ("null", "boolean", "integer", "number", "object", "array")
_NON_FINITE = re.compile(r"[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types.extend(t for t in _schema_types(sub) if t not in types)
    return types


def _coerce(text: str, types: list[str]) -> Any:
    known = [t for t in _ORDER if t in types]
    if not known:
        return text  # a string, no type, or only types this parser does not know
    for kind in known:
        value = _as(kind, text.strip())
        if value is not _NO_MATCH:
            return value
    return text if "string" in types else _NO_MATCH


def _as(kind: str, text: str) -> Any:
    if kind == "null":
        return None if text in ("null", "None") else _NO_MATCH
    if kind == "boolean":
        return {"true": True, "True": True, "false": False, "False": False}.get(text, _NO_MATCH)
    if kind == "number" and _NON_FINITE.fullmatch(text):
        return float(text)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: a model can nest "[" deeper than the parser
        return _NO_MATCH
    if kind == "integer":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_MATCH
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO_MATCH
    if kind == "object":
        return value if isinstance(value, dict) else _NO_MATCH
    return value if isinstance(value, list) else _NO_MATCH  # array
