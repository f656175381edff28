"""Mistral (Tekken vocabularies, mistral-common tokenizer versions v7 to v15): ``[TOOL_CALLS]``
opens each call and nothing closes it; the next ``[TOOL_CALLS]`` or the stop (``</s>``) ends it.

Supported call bodies, one per tokenizer version of mistral-common's official chat templates:

- v7 (Mistral Large 2411, Small 3.0/3.1, Pixtral Large): ``[TOOL_CALLS][{"name": ..., "arguments": {...},
  "id": ...}, ...]``: a JSON array, several calls after one marker;
- v11 (Small 3.2, Devstral, Magistral 2506): ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}``;
- v13 / v15 (Magistral 2507+, Mistral Medium/Small 2509+): ``[TOOL_CALLS]NAME[ARGS]{...}``, reasoning in
  ``[THINK]...[/THINK]``.

Older bodies (v1-v3 ``[TOOL_CALLS] [...]`` with SentencePiece spaces) read as v7's array. Reasoning is
wired only where the vocabulary has ``[THINK]``/``[/THINK]`` as added tokens (v13+); Magistral 2506
writes plain ``<think>`` text on a vocabulary without them, which stays content.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from ..scan import prompt_opens_reasoning, scan_ids
from ..types import ParsedResponse, ToolCall, ToolCallStatus
from . import Dialect, Offered, register
from .json_calls import checked_call, json_calls

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


@register
class Mistral(Dialect):
    name = "mistral"
    priority = 20
    markers = (TOOL_CALLS, "[INST]", "[/INST]")
    think = ("[THINK]", "[/THINK]")
    stops = ("</s>",)

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        markers = tokenizer.markers
        self.tool_calls_id = markers[TOOL_CALLS]
        self.args_id = markers.get(ARGS)
        self.call_id_id = markers.get(CALL_ID)

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: Any = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        stop_ids: Collection[int] | None = None,
    ) -> ParsedResponse:
        """The shared scan with ``[TOOL_CALLS]`` as an open marker that has no close: a call runs to the
        next ``[TOOL_CALLS]`` (``restart``) or to the stop. Only a call the completion's end cut off
        (no stop id) is ``unclosed``."""
        offered = Offered.of(tools)
        structure = {self.tool_calls_id, *(self.think_ids or ())}  # never a stop, as in Dialect.parse
        stops = frozenset(self.stop_ids if stop_ids is None else stop_ids) - structure
        ids = list(completion_ids)
        scan = scan_ids(
            ids,
            stop_ids=stops,
            think=self.think_ids,
            call=(self.tool_calls_id, -1),  # -1: no id closes a call
            restart=True,
            in_reasoning=prompt_opens_reasoning(prompt_ids, self.think_ids, stops),
        )
        calls: list[ToolCall] = []
        for start, end, _ in scan.calls:
            cut = end == scan.end and scan.stop is None
            for call in self.parse_block(ids[start + 1 : end], (start, end), offered):
                if cut:
                    call.status, call.error = ToolCallStatus.UNCLOSED, "the completion ended inside this tool call"
                calls.append(call)
        return scan.response(calls, self.tokenizer.decode)

    def parse_block(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> list[ToolCall]:
        decode = self.tokenizer.decode
        if self.args_id is not None and self.args_id in body_ids:  # v11+: NAME[CALL_ID]ID[ARGS]{json}
            k = body_ids.index(self.args_id)
            head, call_id = body_ids[:k], None
            if self.call_id_id is not None and self.call_id_id in head:
                at = head.index(self.call_id_id)
                head, call_id = head[:at], decode(head[at + 1 :]).strip() or None
            name, raw = decode(head).strip(), decode(body_ids[k + 1 :])
            if not name:
                return [ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, f"no function name before {ARGS}")]
            try:
                args = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                return [ToolCall(name, None, ToolCallStatus.INVALID_JSON, span, raw, f"arguments are not JSON: {exc}")]
            call = checked_call(name, args, span, raw, offered.names)
            call.id = call_id  # v11's [CALL_ID]: a re-render of the turn writes it back
            return [call]
        text = decode(body_ids).lstrip()
        if text.startswith(("[", "{")):  # v7 and older: a JSON array of calls
            return json_calls(decode, body_ids, span, offered.names)
        raw = decode(body_ids)
        error = f"expected NAME{ARGS}{{...}} or a JSON array of calls after {TOOL_CALLS}"
        return [ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, error)]
