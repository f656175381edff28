"""gpt-oss Harmony: messages with channels (``<|channel|>analysis``/``final``) and recipients
(``to=functions.NAME``), parsed by token ids. Its grammar is a sequence of messages, not marker pairs,
so this dialect scans messages itself; the Harmony renderer (renderers/harmony.py) parses and bridges
with the same scan.

A completion starts right after the generation prompt ``<|start|>assistant`` and holds one or more
messages: ``{header}<|message|>{body}`` closed by ``<|end|>`` (the model goes on), ``<|call|>`` (a
tool call: stop) or ``<|return|>`` (the final answer: stop); each later message opens with
``<|start|>``. The header is the role, an optional recipient ``to=functions.NAME``, ``<|channel|>``
and the channel name, and an optional content type (``<|constrain|>json`` as gpt-oss samples it,
`` json`` as the template writes it). The model writes the recipient after the channel
(``<|channel|>commentary to=functions.f <|constrain|>json``); the template writes it after the role
(``assistant to=functions.f<|channel|>commentary json``): both are read.

The structure comes from the special ids alone; only header and body spans are decoded.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..messages import MessageError, normalize_tools, tool_names
from ..tokenizer import Tokenizer
from ..types import ParsedResponse, ToolCall, ToolCallStatus
from . import Dialect, register
from .json_calls import checked_call

_RECIPIENT = re.compile(r"(?:^|\s)to=(\S*)")
FUNCTIONS_PREFIX = "functions."


@dataclass
class HarmonyMessage:
    """One message found by :meth:`Harmony.scan_messages`; positions index the scanned ids."""

    start: int
    role: list[int] = field(default_factory=list)  # header ids before <|channel|>
    channel: list[int] = field(default_factory=list)  # header ids after <|channel|>
    constrain: list[int] = field(default_factory=list)  # header ids after <|constrain|>
    body_start: int | None = None  # position after <|message|>; None while still in the header
    end: int = 0  # one past the close token, or where the message stopped
    close: int | None = None  # <|end|> / <|call|> / <|return|>; None when it was never closed
    touched: bool = False

    @property
    def body_end(self) -> int:
        return self.end - 1 if self.close is not None else self.end


@dataclass
class Header:
    role: str
    channel: str
    recipient: str | None


@register
class Harmony(Dialect):
    name = "harmony"
    priority = 10
    markers = ("<|start|>", "<|channel|>", "<|message|>")
    think = None

    def __init__(self, tokenizer: Tokenizer) -> None:
        super().__init__(tokenizer)
        tid = tokenizer.token_id
        self.start_id, self.end_id, self.message_id = tid("<|start|>"), tid("<|end|>"), tid("<|message|>")
        self.channel_id, self.constrain_id = tid("<|channel|>"), tid("<|constrain|>")
        self.call_id, self.return_id = tid("<|call|>"), tid("<|return|>")
        self.close_ids = frozenset((self.end_id, self.call_id, self.return_id))
        # the grammar's own stops: a tool call and a final answer end the completion, <|end|> does not
        self.message_stops = frozenset((self.call_id, self.return_id))

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
        """As :meth:`parse_response` (``stop_ids`` is not used: Harmony's stops are part of its grammar)."""
        return self.parse_response(list(completion_ids), list(prompt_ids) if prompt_ids else None, tools)

    # ---- scanning ------------------------------------------------------------------------------

    def open_tail(self, prompt_ids: list[int] | None) -> list[int]:
        """The prompt's last message when it is still open (the generation prompt ``<|start|>assistant``,
        or a prefilled header): the completion continues it. Scans back to the last ``<|start|>`` only.
        Without a prompt, the completion is taken to follow the generation prompt."""
        if prompt_ids is None:
            return [self.start_id]
        for pos in range(len(prompt_ids) - 1, -1, -1):
            tid = prompt_ids[pos]
            if tid in self.close_ids:
                return []
            if tid == self.start_id:
                return list(prompt_ids[pos:])
        return []

    def scan_messages(self, ids: list[int]) -> tuple[list[HarmonyMessage], int | None, int]:
        """Split ids into messages: (messages, the stop id that ended the scan or None, where the scan
        ended). Never raises; tokens after a stop id are not scanned."""
        stops = self.message_stops
        messages: list[HarmonyMessage] = []
        cur = HarmonyMessage(start=0)
        segment = cur.role
        for pos, tid in enumerate(ids):
            if tid == self.start_id:
                if cur.touched:  # a new message before this one was closed
                    cur.end = pos
                    messages.append(cur)
                cur = HarmonyMessage(start=pos, touched=True)
                segment = cur.role
            elif tid in self.close_ids:
                cur.close, cur.end, cur.touched = tid, pos + 1, True
                messages.append(cur)
                cur = HarmonyMessage(start=pos + 1)
                segment = cur.role
                if tid in stops:
                    return messages, tid, pos + 1
            elif cur.body_start is not None:
                pass  # body: a span, decoded later
            elif tid == self.message_id:
                cur.body_start = pos + 1
                cur.touched = True
            elif tid == self.channel_id:
                segment = cur.channel
                cur.touched = True
            elif tid == self.constrain_id:
                segment = cur.constrain
                cur.touched = True
            else:
                segment.append(tid)
                cur.touched = True
        if cur.touched:
            cur.end = len(ids)
            messages.append(cur)
        return messages, None, len(ids)

    def header(self, m: HarmonyMessage) -> Header:
        """The role, channel and recipient of a scanned message (its header spans decoded)."""
        decode = self.tokenizer.decode
        role_text, channel_text = decode(m.role), decode(m.channel)
        found = (
            _RECIPIENT.search(role_text) or _RECIPIENT.search(channel_text) or _RECIPIENT.search(decode(m.constrain))
        )
        role = _RECIPIENT.sub(" ", role_text).strip()
        channel = channel_text.split()[0] if channel_text.split() else ""
        return Header(role, channel, found.group(1) if found else None)

    # ---- parsing -------------------------------------------------------------------------------

    def parse_response(
        self, completion_ids: list[int], prompt_ids: list[int] | None = None, tools: Any = None
    ) -> ParsedResponse:
        """Reasoning, content and tool calls of a completion, by scanning its token ids.

        - ``analysis`` messages -> ``reasoning_content`` (None when there is none;
          ``reasoning_complete`` False when the completion ended inside one);
        - ``final`` messages, and ``commentary`` without a recipient (a preamble gpt-oss may write
          before a tool call), and messages without a channel -> ``content`` (joined with "\\n");
        - a message with a recipient ``to=functions.NAME`` -> a tool call named NAME whose
          arguments are its JSON body; another recipient (a built-in tool: ``browser.search``,
          ``python``) keeps the whole recipient as the name. Statuses: ``missing_name``
          (``to=functions.``), ``invalid_json``, ``invalid_arguments`` (JSON but not an object; a
          JSON string holding an object is decoded once), ``unknown_tool`` (when ``tools`` is given),
          ``unclosed`` (the completion ended, or a new ``<|start|>`` came, before the message's close);
        - messages from another role (the model writing a tool's reply) are ignored;
        - ``stop_token_id``: ``<|call|>`` or ``<|return|>`` when the completion ended with it.
        """
        names = _offered_names(tools)
        tail = self.open_tail(prompt_ids)
        completion = list(completion_ids)
        messages, stop, _ = self.scan_messages(tail + completion)
        offset = len(tail)
        decode = self.tokenizer.decode
        scanned = tail + completion
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        reasoning_complete: bool | None = None
        for m in messages:
            end = m.end - offset
            if end <= 0:
                continue  # entirely in the prompt
            head = self.header(m)
            if head.role not in ("", "assistant") or head.recipient == "assistant":
                continue
            body = decode(scanned[m.body_start : m.body_end]) if m.body_start is not None else ""
            if head.recipient is not None:
                span = (max(m.start - offset, 0), end)
                calls.append(_harmony_call(head.recipient, body, m, span, names))
            elif m.body_start is None:
                continue  # a header that never reached <|message|>
            elif head.channel == "analysis":
                reasoning.append(body)
                reasoning_complete = m.close is not None
            else:
                content.append(body)
        return ParsedResponse(
            content="\n".join(c.strip() for c in content if c.strip()),
            reasoning_content="\n".join(r.strip() for r in reasoning if r.strip()) if reasoning else None,
            tool_calls=calls,
            reasoning_complete=reasoning_complete,
            stop_token_id=stop,
        )


def _offered_names(tools: Any) -> set[str] | None:
    """The offered tools' names; None (any name accepted) for no tools or tools that are not valid."""
    try:
        return tool_names(normalize_tools(tools))
    except MessageError:
        return None


def _harmony_call(
    recipient: str, body: str, m: HarmonyMessage, span: tuple[int, int], tool_names: set[str] | None
) -> ToolCall:
    """A tool call message with a status instead of an exception."""
    name = recipient[len(FUNCTIONS_PREFIX) :] if recipient.startswith(FUNCTIONS_PREFIX) else recipient
    if not name:
        return ToolCall(None, None, ToolCallStatus.MISSING_NAME, span, body, f"no function name after to={recipient}")
    if m.body_start is None or m.close is None:
        return ToolCall(name, None, ToolCallStatus.UNCLOSED, span, body, "the tool call message was never closed")
    try:
        args = json.loads(body)
    except ValueError as exc:
        return ToolCall(name, None, ToolCallStatus.INVALID_JSON, span, body, f"arguments are not JSON: {exc}")
    return checked_call(name, args, span, body, tool_names)
