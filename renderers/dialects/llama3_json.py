"""Llama 3 JSON tool calls, for fine-tunes on the Llama 3 vocabulary whose template is not Meta's (the
generic renderer): a reply that is ``{"name": ..., "parameters"/"arguments": {...}}`` JSON (several
objects in a row, separated by whitespace, ``,`` or ``;``, or one JSON array of them, as fine-tunes
emit parallel calls), optionally after ``<|python_tag|>``, whose builtin ``name.call(k="v")`` and
code forms read as in Meta's own format (:func:`renderers.llama3.python_tag_call`). The format has no
call markers, so the rule is Meta's: the whole reply (after the tag) must be the calls; any other JSON
answer is content. No reasoning channel.

Tried after hermes: a Llama 3 vocabulary with ``<think>`` / ``<tool_call>`` added (SmolLM3) is read as
those markers say.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from ..llama3 import _JSON_CALL_START, python_tag_call
from ..types import ParsedResponse, ToolCall, ToolCallStatus
from . import Dialect, Offered, register
from .json_calls import json_calls

PYTHON_TAG = "<|python_tag|>"
_ARRAY_CALL_START = re.compile(r'\s*\[\s*\{\s*"name"\s*:')


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
            if _JSON_CALL_START.match(text) or _ARRAY_CALL_START.match(text):
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

