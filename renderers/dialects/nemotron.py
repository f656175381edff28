"""NVIDIA Nemotron Nano v2 (9B / 12B, the Nemotron-H vocabulary): reasoning in ``<think>``/``</think>``,
tool calls as one JSON array of ``{"name": ..., "arguments": ...}`` objects in ``<TOOLCALL>...</TOOLCALL>``
(parallel calls share the block, :mod:`renderers.dialects.json_calls`).

Nemotron 3 Nano (30B-A3B) writes Qwen3-Coder's ``<tool_call><function=...>`` XML and ``<think>``: the
hermes dialect reads it (its vocabulary has those pairs and no ``<TOOLCALL>``).
"""

from __future__ import annotations

from ..types import ToolCall
from . import Dialect, Offered, register
from .json_calls import json_calls


@register
class NemotronToolcall(Dialect):
    name = "nemotron_toolcall"
    priority = 19  # before Mistral's 20: a Tekken-derived vocabulary may keep [TOOL_CALLS] next to <TOOLCALL>
    markers = ("<TOOLCALL>", "</TOOLCALL>")
    call = ("<TOOLCALL>", "</TOOLCALL>")
    stops = ("<SPECIAL_12>",)  # the template's turn close ("\n<SPECIAL_12>\n" after each assistant turn)

    def parse_block(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> list[ToolCall]:
        return json_calls(self.tokenizer.decode, body_ids, span, offered.names)
