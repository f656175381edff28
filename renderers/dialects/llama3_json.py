"""Llama 3 JSON tool calls, for fine-tunes on the Llama 3 vocabulary whose template is not Meta's (the
generic renderer): a reply that is ``{"name": ..., "parameters"/"arguments": {...}}`` JSON (several
objects in a row, separated by whitespace, ``,`` or ``;``, or one JSON array of them, as fine-tunes
emit parallel calls), optionally after ``<|python_tag|>``, whose builtin ``name.call(k="v")`` and
code forms read as in Meta's own format (:func:`python_tag_call`, which Meta's renderer parses with too). The format has no
call markers, so the rule is Meta's: the whole reply (after the tag) must be the calls; any other JSON
answer is content. No reasoning channel.

Tried after hermes: a Llama 3 vocabulary with ``<think>`` / ``<tool_call>`` added (SmolLM3) is read as
those markers say.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Sequence
from typing import Any

from ..types import ParsedResponse, ToolCall, ToolCallStatus
from . import Dialect, Offered, register
from .json_calls import json_calls, parse_json_call

PYTHON_TAG = "<|python_tag|>"
# Meta's builtin tools: a call to one of them is never an unknown tool, whatever `tools` lists.
BUILTIN_TOOLS = frozenset({"brave_search", "wolfram_alpha", "code_interpreter"})
# The precise rule for a plain (no <|python_tag|>) tool call: the whole content is a JSON object whose
# first key is "name", as the template renders calls. Other JSON answers stay content.
JSON_CALL_START = re.compile(r'\s*\{\s*"name"\s*:')
_ARRAY_CALL_START = re.compile(r'\s*\[\s*\{\s*"name"\s*:')
_BUILTIN_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.call\((.*)\)", re.S)


@register
class Llama3Json(Dialect):
    name = "llama3_json"
    priority = 95
    markers = (PYTHON_TAG, "<|start_header_id|>", "<|eot_id|>")
    think = None
    stops = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: Any = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        stop_ids: Collection[int] | None = None,
    ) -> ParsedResponse:
        offered = Offered.of(tools)
        stops = self.stop_ids if stop_ids is None else stop_ids
        ids = list(completion_ids)
        end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        stop = ids[end] if end < len(ids) else None
        call_end = end + 1 if stop is not None else end  # a call's span covers its closing stop token
        decode = self.tokenizer.decode
        tag = self.tokenizer.markers[PYTHON_TAG]
        calls: list[ToolCall] = []
        if tag in ids[:end]:
            k = ids.index(tag)
            content = decode(ids[:k]).strip()
            body = ids[k + 1 : end]
            if decode(body).lstrip().startswith("{"):
                calls = json_calls(decode, body, (k, call_end), offered.names, array=False)
            else:
                calls = [python_tag_call(decode(body), (k, call_end), offered.names)]
        else:
            text = decode(ids[:end])
            if JSON_CALL_START.match(text) or _ARRAY_CALL_START.match(text):
                array = text.lstrip()[0] == "["
                calls = json_calls(decode, ids[:end], (0, call_end), offered.names, array=array, body_start=0)
                content = ""
            else:
                content = text.strip()
        if stop is None:
            for call in calls:
                call.status, call.error = ToolCallStatus.UNCLOSED, "the completion ended inside this tool call"
        return ParsedResponse(
            content=content, reasoning_content=None, tool_calls=calls, reasoning_complete=None, stop_token_id=stop
        )


def python_tag_call(raw: str, span: tuple[int, int], tool_names: set[str] | None) -> ToolCall:
    """What follows ``<|python_tag|>``: a JSON call, a builtin ``name.call(k="v")``, or (Meta's format) code
    for ``code_interpreter``."""
    body = raw.strip()
    if body.startswith("{"):
        return parse_json_call(raw, span, tool_names)
    if not body:
        return ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, "nothing follows <|python_tag|>")
    m = _BUILTIN_CALL.fullmatch(body)
    if m is None:  # Meta's format: bare code after <|python_tag|> is a code_interpreter call
        name, args, error = "code_interpreter", {"code": body}, _python_error(body)
    else:
        name = m.group(1)
        args, error = _call_keywords(m.group(2))
    if error is not None:
        return ToolCall(name, args, ToolCallStatus.INVALID_ARGUMENTS, span, raw, error)
    if tool_names is not None and name not in tool_names and name not in BUILTIN_TOOLS:
        return ToolCall(name, args, ToolCallStatus.UNKNOWN_TOOL, span, raw, f"no tool named {name!r} was offered")
    return ToolCall(name, args, ToolCallStatus.OK, span, raw)


def _python_error(code: str) -> str | None:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError) as exc:
        return f"not valid Python code: {exc}"
    return None


def _call_keywords(source: str) -> tuple[dict | None, str | None]:
    """``k="v", n=2`` -> ({"k": "v", "n": 2}, None), or (None, error) when it is not keyword literals."""
    try:
        call = ast.parse(f"f({source})", mode="eval").body
    except (SyntaxError, ValueError) as exc:
        return None, f"the builtin call's arguments are not Python keyword arguments: {exc}"
    assert isinstance(call, ast.Call)
    if call.args or any(kw.arg is None for kw in call.keywords):
        return None, "a builtin call takes keyword arguments only"
    try:
        return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}, None
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        return None, f"a builtin call argument is not a literal: {exc}"
