"""gpt-oss Harmony: messages with channels (``<|channel|>analysis``/``final``) and recipients
(``to=functions.NAME``). Its grammar is a sequence of messages, not marker pairs, so this dialect
hands the completion to the Harmony renderer's parser (:mod:`renderers.harmony_parse`), which stops on
its own ``<|call|>``/``<|return|>``."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from ..tokenizer import Tokenizer
from ..types import ParsedResponse
from . import Dialect, register


@register
class Harmony(Dialect):
    name = "harmony"
    priority = 10
    markers = ("<|start|>", "<|channel|>", "<|message|>")
    think = None

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        from ..harmony import HarmonyRenderer

        self._renderer = HarmonyRenderer(tokenizer)

    @classmethod
    def detect(cls, tokenizer: Tokenizer) -> Dialect | None:
        if not all(m in tokenizer.markers for m in cls.markers):
            return None
        try:
            return cls(tokenizer)
        except (KeyError, ValueError):  # a vocabulary with these markers but not Harmony's others
            return None

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: Any = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        stop_ids: Collection[int] | None = None,
    ) -> ParsedResponse:
        """As :meth:`renderers.harmony_parse.HarmonyParsing.parse_response` (``stop_ids`` is not used:
        Harmony's stops are part of its grammar)."""
        return self._renderer.parse_response(list(completion_ids), list(prompt_ids) if prompt_ids else None, tools)
