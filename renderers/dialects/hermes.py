"""The ``<tool_call>`` / ``<think>`` format of Qwen and the many fine-tunes that copy it (Hermes): a call
body is ``{"name": ..., "arguments": {...}}`` JSON, or Qwen3-Coder's XML ``<function=NAME>`` block
(whose text arguments are typed by schema). The last resort among the dialects: detected on a
vocabulary with either marker pair."""

from __future__ import annotations

from ..tokenizer import Tokenizer
from ..types import ToolCall
from . import Dialect, Offered, register
from .json_calls import parse_json_call
from .xml_calls import parse_xml_call

_XML_OPEN = "<function="


@register
class Hermes(Dialect):
    name = "hermes"
    priority = 90
    markers = ()
    call = ("<tool_call>", "</tool_call>")

    @classmethod
    def detect(cls, tokenizer: Tokenizer) -> Dialect | None:
        """Either pair (``<think>``/``</think>`` or ``<tool_call>``/``</tool_call>``) as marker tokens."""
        d = cls(tokenizer)
        return d if d.think_ids is not None or d.call_ids is not None else None

    def parse_call(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> ToolCall:
        raw = self.tokenizer.decode(body_ids)
        if raw.lstrip().startswith(_XML_OPEN):
            return parse_xml_call(raw, span)
        return parse_json_call(raw, span, offered.names)

    def types_arguments(self, call: ToolCall) -> bool:
        return call.raw.lstrip().startswith(_XML_OPEN)
