"""MiniMax M2: ``<think>``/``</think>`` reasoning and a tool-call block (its two tags are added tokens)
holding one ``<invoke>`` per call, whose tags are text::

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>[e~[

The template prints a string value verbatim and anything else with ``tojson``, so values are read as
text and typed by the offered tools' schemas."""

from __future__ import annotations

from ..types import ToolCall, ToolCallStatus
from . import Dialect, Offered, register, token_index_at

BLOCK = ("<minimax:tool_call>", "</minimax:tool_call>")
_INVOKE_OPEN, _INVOKE_CLOSE = '<invoke name="', "</invoke>"
_PARAM_OPEN, _PARAM_CLOSE = '<parameter name="', "</parameter>"
_NAME_END = '">'


@register
class MiniMaxM2(Dialect):
    name = "minimax_m2"
    priority = 20
    markers = BLOCK
    call = BLOCK
    string_arguments = True
    several_per_block = True
    stops = ("[e~[",)

    def parse_block(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> list[ToolCall]:
        """Every ``<invoke>`` of the block, each with its own token span (the first starts at the block's
        open marker, the last ends at its close). Values end at the first ``</parameter>`` followed
        (after whitespace) by another parameter or ``</invoke>``, so a value may contain that tag.
        A structural error ends the block: that call is ``invalid_arguments`` (``missing_name`` for a
        bad ``<invoke>`` tag) and what follows it is not read."""
        decode = self.tokenizer.decode
        text = decode(body_ids)
        calls: list[ToolCall] = []
        bounds: list[tuple[int, int]] = []
        pos = 0
        while True:
            start = pos
            pos = _skip_space(text, pos)
            if pos == len(text) and calls:
                break
            call, pos = _invoke(text, pos)
            calls.append(call)
            bounds.append((start, pos))
            if call.status is not ToolCallStatus.OK:
                break
        body_start = span[0] + 1
        for k, (call, (a, b)) in enumerate(zip(calls, bounds)):
            lo = span[0] if k == 0 else body_start + token_index_at(decode, body_ids, a)
            hi = span[1] if k == len(calls) - 1 else body_start + token_index_at(decode, body_ids, b)
            call.token_span = (lo, hi)
            call.raw = text[a:b] if len(calls) > 1 else text
        return calls


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _invoke(text: str, pos: int) -> tuple[ToolCall, int]:
    """One ``<invoke>`` at ``pos`` -> (call with string arguments, the index after ``</invoke>``)."""
    args: dict[str, str] = {}

    def out(status: ToolCallStatus, error: str | None, name: str | None, end: int) -> tuple[ToolCall, int]:
        return ToolCall(name, args, status, (0, 0), text, error), end

    if not text.startswith(_INVOKE_OPEN, pos):
        return out(ToolCallStatus.MISSING_NAME, f"expected <invoke name=...>, got {text[pos:pos + 40]!r}", None, len(text))
    name_end = text.find(_NAME_END, pos)
    name = text[pos + len(_INVOKE_OPEN) : name_end] if name_end >= 0 else ""
    if not name.strip() or "\n" in name or "<" in name:
        return out(ToolCallStatus.MISSING_NAME, f"malformed invoke tag {text[pos:pos + 40]!r}", None, len(text))
    i = name_end + len(_NAME_END)
    while True:
        i = _skip_space(text, i)
        if text.startswith(_INVOKE_CLOSE, i):
            return out(ToolCallStatus.OK, None, name, i + len(_INVOKE_CLOSE))
        if i == len(text):
            return out(ToolCallStatus.INVALID_ARGUMENTS, f"the invoke of {name!r} is not closed with </invoke>", name, i)
        if not text.startswith(_PARAM_OPEN, i):
            return out(ToolCallStatus.INVALID_ARGUMENTS, f"unexpected text in the invoke of {name!r}: {text[i:i + 40]!r}", name, len(text))
        key_end = text.find(_NAME_END, i)
        key = text[i + len(_PARAM_OPEN) : key_end] if key_end >= 0 else ""
        if not key or "\n" in key or "<" in key:
            return out(ToolCallStatus.INVALID_ARGUMENTS, f"malformed parameter tag in {name!r}: {text[i:i + 40]!r}", name, len(text))
        value_start = key_end + len(_NAME_END)
        close = text.find(_PARAM_CLOSE, value_start)
        while close >= 0:
            rest = _skip_space(text, close + len(_PARAM_CLOSE))
            if text.startswith(_PARAM_OPEN, rest) or text.startswith(_INVOKE_CLOSE, rest):
                break
            close = text.find(_PARAM_CLOSE, close + 1)
        if close < 0:
            return out(ToolCallStatus.INVALID_ARGUMENTS, f"parameter {key!r} of {name!r} is not closed", name, len(text))
        if key in args:
            return out(ToolCallStatus.INVALID_ARGUMENTS, f"parameter {key!r} of {name!r} is given twice", name, len(text))
        args[key] = text[value_start:close]
        i = close + len(_PARAM_CLOSE)
