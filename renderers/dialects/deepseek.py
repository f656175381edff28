"""DeepSeek V3 / R1 / V3.1: full-width tool-call tokens inside a ``<｜tool▁calls▁begin｜>`` section,
reasoning in ``<think>``/``</think>`` where the vocabulary has them (R1, V3.1).

V3 and R1 write ``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```'', V3.1 writes ``NAME<｜tool▁sep｜>ARGS``;
the vocabularies are the same, so both bodies are accepted (:func:`parse_deepseek_call`)."""

from __future__ import annotations

import json
from collections.abc import Callable

from ..types import ToolCall, ToolCallStatus
from . import Dialect, Offered, register
from .json_calls import checked_call

EOS = "<｜end▁of▁sentence｜>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"


def parse_deepseek_call(
    decode: Callable[[list[int]], str],
    sep_id: int,
    body_ids: list[int],
    span: tuple[int, int],
    tool_names: set[str] | None,
    v31: bool = False,
) -> ToolCall:
    """``TYPE<｜tool▁sep｜>NAME\\n```json\\nARGS\\n``` `` between the call markers (V3, R1). The fence is
    optional (bare JSON after the name line is accepted); the type before the separator is not checked.

    ``v31``: also DeepSeek-V3.1's ``NAME<｜tool▁sep｜>ARGS`` (no type, no fence), taken when the text
    after the separator starts with ``{`` (a V3 name line never does)."""
    raw = decode(body_ids)
    if sep_id not in body_ids:
        return ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, "no <｜tool▁sep｜> before the function name")
    cut = body_ids.index(sep_id)
    rest = decode(body_ids[cut + 1 :])
    if v31 and rest.lstrip().startswith("{"):
        name, args_text = decode(body_ids[:cut]).strip(), rest
    else:
        name, _, args_text = rest.partition("\n")
        name = name.strip()
    if not name:
        return ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, raw, "empty function name after <｜tool▁sep｜>")
    args_text = args_text.strip()
    if args_text.startswith("```"):
        newline = args_text.find("\n")
        if newline < 0 or not args_text.endswith("```") or len(args_text) - 3 < newline:
            return ToolCall(name, None, ToolCallStatus.INVALID_JSON, span, raw, "the ```json fence is not closed")
        args_text = args_text[newline + 1 : -3]
    try:
        args = json.loads(args_text)
    except ValueError as exc:
        return ToolCall(name, None, ToolCallStatus.INVALID_JSON, span, raw, f"arguments are not JSON: {exc}")
    return checked_call(name, args, span, raw, tool_names)


@register
class DeepSeek(Dialect):
    name = "deepseek"
    priority = 20
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP)
    call = (CALL_BEGIN, CALL_END)
    section = (CALLS_BEGIN, CALLS_END)
    restart = True  # a call begin (or the section's end) inside a call: the model moved on, the call is cut
    stops = (EOS,)

    def parse_call(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> ToolCall:
        sep = self.tokenizer.markers[TOOL_SEP]
        return parse_deepseek_call(self.tokenizer.decode, sep, body_ids, span, offered.names, v31=True)
