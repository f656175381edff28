"""Kimi K2 (Moonshot): tool calls in a section of added tokens::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}
    <|tool_call_end|>...<|tool_calls_section_end|><|im_end|>

The call id (``functions.NAME:IDX``) names the function; arguments are JSON. Reasoning is wired only
where the vocabulary has ``<think>``/``</think>`` (K2-Thinking); K2-Instruct's has not."""

from __future__ import annotations

import json

from ..types import ToolCall, ToolCallStatus
from . import Dialect, Offered, register
from .json_calls import checked_call

SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
CALL = ("<|tool_call_begin|>", "<|tool_call_end|>")
ARGUMENT = "<|tool_call_argument_begin|>"


@register
class KimiK2(Dialect):
    name = "kimi_k2"
    priority = 20
    markers = (*SECTION, *CALL, ARGUMENT)
    call = CALL
    section = SECTION
    restart = True  # a call begin (or the section's end) inside a call: that call was cut
    stops = ("<|im_end|>", "[EOS]")

    def parse_call(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> ToolCall:
        """``functions.NAME:IDX`` (the ``functions.`` prefix and ``:IDX`` suffix are optional), the
        argument marker, then a JSON object (a JSON string holding one is decoded once)."""
        decode = self.tokenizer.decode
        raw = decode(body_ids)
        arg_id = self.tokenizer.markers[ARGUMENT]
        cut = body_ids.index(arg_id) if arg_id in body_ids else len(body_ids)
        call_id = decode(body_ids[:cut]).strip()
        name = _function_name(call_id)
        if not name or "\n" in name:
            return ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, f"no function name in the call id {call_id!r}")
        if cut == len(body_ids):
            return ToolCall(name, None, ToolCallStatus.INVALID_ARGUMENTS, span, raw, f"{ARGUMENT} is missing")
        try:
            args = json.loads(decode(body_ids[cut + 1 :]))
        except (ValueError, RecursionError) as exc:
            return ToolCall(name, None, ToolCallStatus.INVALID_JSON, span, raw, f"arguments are not JSON: {exc}")
        return checked_call(name, args, span, raw, offered.names)


def _function_name(call_id: str) -> str:
    """``functions.NAME:IDX`` -> ``NAME`` (prefix and index optional); "" when no name is left."""
    name = call_id.removeprefix("functions.")
    head, sep, index = name.rpartition(":")
    if sep and index.isdigit():
        name = head
    return name.strip()
