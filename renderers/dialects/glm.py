"""GLM-4.5 / 4.6 / 4.7 (zai-org): ``<think>``/``</think>`` reasoning and XML-ish tool calls whose tags are
added tokens::

    <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>

(GLM-4.7 drops the newlines.) The template prints a string value verbatim and anything else with
``tojson``, so values are read as text and typed by the offered tools' schemas. Turns end where the
model writes the next role token: ``<|user|>`` or ``<|observation|>`` (a tool result follows)."""

from __future__ import annotations

from ..types import ToolCall, ToolCallStatus
from . import Dialect, Offered, register

KEY = ("<arg_key>", "</arg_key>")
VALUE = ("<arg_value>", "</arg_value>")


@register
class GLM(Dialect):
    name = "glm"
    priority = 30  # before the plain <tool_call> scan (hermes): GLM shares its call markers
    markers = ("<tool_call>", "</tool_call>", *KEY, *VALUE)
    call = ("<tool_call>", "</tool_call>")
    string_arguments = True
    stops = ("<|user|>", "<|observation|>", "<|endoftext|>")

    def parse_call(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> ToolCall:
        """``NAME`` up to the first ``<arg_key>``, then key/value pairs, whitespace between tags.

        ``missing_name``: no name, or a name spanning lines. ``invalid_arguments``: text outside the
        tags, a tag out of order or not closed, a key given twice (the pairs read before the error stay
        on the call, for a call cut off by the end of the completion)."""
        decode = self.tokenizer.decode
        ids = self.tokenizer.markers
        key_open, key_close, value_open, value_close = (ids[t] for t in (*KEY, *VALUE))
        raw = decode(body_ids)
        args: dict[str, str] = {}
        first = next((i for i, t in enumerate(body_ids) if t in (key_open, key_close, value_open, value_close)), len(body_ids))
        name = decode(body_ids[:first]).strip()
        if not name or "\n" in name:
            return ToolCall(None, args, ToolCallStatus.MISSING_NAME, span, raw, f"no function name before the arguments: {raw[:40]!r}")

        def fail(error: str) -> ToolCall:
            return ToolCall(name, args, ToolCallStatus.INVALID_ARGUMENTS, span, raw, error)

        i = first
        n = len(body_ids)
        while True:
            gap_start = i
            while i < n and body_ids[i] not in (key_open, key_close, value_open, value_close):
                i += 1
            if decode(body_ids[gap_start:i]).strip():
                return fail(f"text outside <arg_key>/<arg_value> in {name!r}: {decode(body_ids[gap_start:i]).strip()[:40]!r}")
            if i == n:
                return ToolCall(name, args, ToolCallStatus.OK, span, raw)
            if body_ids[i] != key_open:
                return fail(f"expected <arg_key> in {name!r}, got {decode([body_ids[i]])!r}")
            key, i = _tagged(body_ids, i + 1, key_close, (key_open, value_open, value_close))
            if key is None:
                return fail(f"an <arg_key> of {name!r} is not closed with </arg_key>")
            key_text = decode(key)
            if not key_text.strip():
                return fail(f"an empty <arg_key> in {name!r}")
            gap_start = i
            while i < n and body_ids[i] not in (key_open, key_close, value_open, value_close):
                i += 1
            if decode(body_ids[gap_start:i]).strip() or i == n or body_ids[i] != value_open:
                return fail(f"argument {key_text!r} of {name!r} has no <arg_value>")
            value, i = _tagged(body_ids, i + 1, value_close, (key_open, key_close, value_open))
            if value is None:
                return fail(f"the value of {key_text!r} in {name!r} is not closed with </arg_value>")
            if key_text in args:
                return fail(f"argument {key_text!r} of {name!r} is given twice")
            args[key_text] = decode(value)


def _tagged(ids: list[int], start: int, close: int, others: tuple[int, ...]) -> tuple[list[int] | None, int]:
    """The ids from ``start`` to ``close`` and the index after it; None when another tag or the end comes first."""
    for j in range(start, len(ids)):
        if ids[j] == close:
            return ids[start:j], j + 1
        if ids[j] in others:
            return None, j
    return None, len(ids)
