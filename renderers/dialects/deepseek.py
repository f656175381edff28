"""DeepSeek V3 / R1 / V3.1: full-width tool-call tokens inside a ``<｜tool▁calls▁begin｜>`` section,
reasoning in ``<think>``/``</think>`` where the vocabulary has them (R1, V3.1).

V3 and R1 write ``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```'', V3.1 writes ``NAME<｜tool▁sep｜>ARGS``;
the vocabularies are the same, so both bodies are accepted (:func:`renderers.deepseek_v3.parse_deepseek_call`)."""

from __future__ import annotations

from ..deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, EOS, TOOL_SEP, parse_deepseek_call
from ..types import ToolCall
from . import Dialect, Offered, register


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
