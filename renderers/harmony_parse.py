"""gpt-oss (Harmony): parsing completions by token ids, and the append-only bridge.

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
from dataclasses import dataclass, field
from typing import Any

from .base import TemplateRejected, bridged, checked_call
from .messages import MessageError, normalize_tools
from .pieces import Pieces
from .types import Break, BreakReason, Bridged, ParsedResponse, ToolCall, ToolCallStatus

_RECIPIENT = re.compile(r"(?:^|\s)to=(\S*)")
FUNCTIONS_PREFIX = "functions."


@dataclass
class HarmonyMessage:
    """One message found by :meth:`HarmonyParsing.scan_messages`; positions index the scanned ids."""

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
class _Header:
    role: str
    channel: str
    recipient: str | None


class HarmonyParsing:
    """``parse_response`` and ``bridge`` for Harmony; mixed into :class:`renderers.harmony.HarmonyRenderer`.
    Depends on the tokenizer only (the generic template renderer may reuse it as a parser)."""

    def _init_parsing(self) -> None:
        tid = self.tokenizer.token_id
        self.start_id, self.end_id, self.message_id = tid("<|start|>"), tid("<|end|>"), tid("<|message|>")
        self.channel_id, self.constrain_id = tid("<|channel|>"), tid("<|constrain|>")
        self.call_id, self.return_id = tid("<|call|>"), tid("<|return|>")
        self.close_ids = frozenset((self.end_id, self.call_id, self.return_id))
        self._bridge_call_name: str | None = None

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
        stops = self.stop_token_ids
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

    def _header(self, m: HarmonyMessage) -> _Header:
        decode = self.tokenizer.decode
        role_text, channel_text = decode(m.role), decode(m.channel)
        found = (
            _RECIPIENT.search(role_text) or _RECIPIENT.search(channel_text) or _RECIPIENT.search(decode(m.constrain))
        )
        role = _RECIPIENT.sub(" ", role_text).strip()
        channel = channel_text.split()[0] if channel_text.split() else ""
        return _Header(role, channel, found.group(1) if found else None)

    # ---- parse_response ------------------------------------------------------------------------

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
        tool_names = _tool_names(tools)
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
            head = self._header(m)
            if head.role not in ("", "assistant") or head.recipient == "assistant":
                continue
            body = decode(scanned[m.body_start : m.body_end]) if m.body_start is not None else ""
            if head.recipient is not None:
                span = (max(m.start - offset, 0), end)
                calls.append(_harmony_call(head.recipient, body, m, span, tool_names))
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

    # ---- bridge --------------------------------------------------------------------------------

    def _bridge(
        self, prev_prompt_ids: list[int], prev_completion_ids: list[int], new_messages: Any, tools: Any
    ) -> Bridged | Break:
        """Append-only, as the base class, with three Harmony specifics:

        - a completion cut off before its close gets the close of the message it was in synthesized:
          ``<|call|>`` inside a tool call, ``<|end|>`` elsewhere (the template's close of any
          message that is not the last of a training render);
        - a tool result is named after the completion's tool call (``functions.NAME``), as the
          template names it after the last call; without one (a final answer, a truncated reply, a
          built-in tool) the template has no name: ``Break(TEMPLATE_ERROR)``;
        - with ``thinking_retention="keep"`` (default) the sampled tokens stay as sampled: a final
          answer keeps its ``<|return|>`` and its analysis, where the template would re-render
          ``<|end|>`` and drop the analysis. With ``"template"``: ``Break(TEMPLATE_REWRITES_HISTORY)``
          wherever the template would re-render the turn differently (see ``_family_break``).
        """
        prefix_len = len(prev_prompt_ids) + len(prev_completion_ids)
        checked = self._new_messages(new_messages, tools, prefix_len)
        if isinstance(checked, Break):
            return checked
        msgs, tool_defs = checked
        completion = list(prev_completion_ids)
        tail = self.open_tail(prev_prompt_ids)
        messages, _, _ = self.scan_messages(tail + completion)
        closing = self._closing(messages, tail, completion)
        last = (closing or completion or prev_prompt_ids or [None])[-1]
        if last not in self.tokenizer.special_ids:
            return Break(
                BreakReason.NO_SPECIAL_TOKEN_ANCHOR, "the previous tokens do not end on a special token", prefix_len
            )
        brk = self._family_break(prev_prompt_ids, completion + closing, msgs)
        if brk is not None:
            return brk
        name, why = self._call_name(messages, tail, completion)
        if name is None and any(m["role"] == "tool" for m in msgs):
            return Break(
                BreakReason.TEMPLATE_ERROR,
                f"a tool result needs the function of the previous tool call, and {why}",
                prefix_len,
            )
        p = Pieces(self.tokenizer)
        self._bridge_call_name = name
        try:
            self._continue(p, msgs, tool_defs)
        except ValueError as exc:
            return Break(BreakReason.TEMPLATE_ERROR, str(exc), prefix_len)
        finally:
            self._bridge_call_name = None
        return bridged(prev_prompt_ids, completion, closing, p.encode())

    def _closing(self, messages: list[HarmonyMessage], tail: list[int], completion: list[int]) -> list[int]:
        """The close to synthesize after a completion that did not end on one (nothing when the last
        message is closed)."""
        if completion and completion[-1] in self.close_ids:
            return []
        if not messages or messages[-1].close is not None:
            return []
        open_message = messages[-1]
        return [self.call_id if self._header(open_message).recipient else self.end_id]

    def _call_name(
        self, messages: list[HarmonyMessage], tail: list[int], completion: list[int]
    ) -> tuple[str | None, str]:
        """The function the completion called (its last tool call), or None and why not."""
        for m in reversed(messages):
            if m.end <= len(tail):
                break
            head = self._header(m)
            if head.recipient is None or head.role not in ("", "assistant") or head.recipient == "assistant":
                continue
            if not head.recipient.startswith(FUNCTIONS_PREFIX):
                return None, f"the previous completion called {head.recipient!r}, which the template cannot name"
            name = head.recipient[len(FUNCTIONS_PREFIX) :]
            if not name:
                return None, "the previous completion's tool call has no function name"
            return name, ""
        return None, "the previous completion made no tool call (a final answer resets the template's last call)"

    def _family_break(self, prompt_ids: list[int], sampled: list[int], msgs: list[dict]) -> Break | None:
        """``thinking_retention="template"``: a Break when the template would re-render tokens already in
        the prefix: this turn (``sampled``: the completion and any synthesized close), rendered from its
        parsed message, must come out identical; and a final answer must not follow analysis of an
        earlier tool-call turn, which the template then drops."""
        if self.thinking_retention != "template":
            return None
        tail = self.open_tail(prompt_ids)
        turn_start = len(prompt_ids) - len(tail)
        parsed = self.parse_response(sampled, prompt_ids)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning_content:
            message["reasoning_content"] = parsed.reasoning_content
        calls = [c for c in parsed.tool_calls if c.status is ToolCallStatus.OK]
        if calls:
            message["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        p = Pieces(self.tokenizer)
        try:
            self._assistant(p, message, 0, last=False, future_final=False, last_call=None)
        except TemplateRejected as exc:
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY,
                f"the gpt-oss template cannot re-render this turn: {exc}",
                turn_start,
            )
        expected = p.encode().token_ids
        turn = tail + sampled
        if expected != turn:
            diff = next(
                (i for i, (a, b) in enumerate(zip(expected, turn, strict=False)) if a != b),
                min(len(expected), len(turn)),
            )
            if self.return_id in sampled:
                why = "re-renders a final answer closed by <|end|> instead of the sampled <|return|>, without its analysis"
            else:
                dec = self.tokenizer.decode
                why = f"re-renders this turn as {dec(expected[diff : diff + 8])!r} where the model sampled {dec(turn[diff : diff + 8])!r}"
            return Break(BreakReason.TEMPLATE_REWRITES_HISTORY, f"the gpt-oss template {why}", turn_start + diff)
        if not calls:
            pos = self._analysis_since_last_final(prompt_ids, turn_start)
            if pos is not None:
                return Break(
                    BreakReason.TEMPLATE_REWRITES_HISTORY,
                    "a final answer makes the gpt-oss template drop the analysis of the tool-call turns before it",
                    pos,
                )
        return None

    def _analysis_since_last_final(self, prompt_ids: list[int], end: int) -> int | None:
        """Position of an analysis message after the prompt's last final answer (scans back to it only)."""
        decode = self.tokenizer.decode
        found = None
        for pos in range(end - 1, -1, -1):
            if prompt_ids[pos] != self.channel_id:
                continue
            channel = decode(prompt_ids[pos + 1 : pos + 3]).lstrip()
            if channel.startswith("final"):
                break
            if channel.startswith("analysis"):
                found = pos
        return found


def _tool_names(tools: Any) -> set[str] | None:
    try:
        defs = normalize_tools(tools)
    except MessageError:
        return None
    if not defs:
        return None
    return {t.get("function", t).get("name") for t in defs}


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
