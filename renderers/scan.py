"""The one id scan every marker-pair format shares: reasoning, content and tool-call spans by token ids.

A completion is read by its added-token ids only, never by its text, so that a message quoting
``<think>`` or ``<tool_call>`` as text (encoded as ordinary tokens) can never open a block. Used by
:meth:`renderers.base.Renderer.parse_response`, the DeepSeek renderers and every dialect
(:mod:`renderers.dialects`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from .types import ParsedResponse, ToolCall


@dataclass
class Scan:
    """What :func:`scan_ids` found. ``calls`` holds ``(start, end, closed)`` spans in completion ids:
    ``[start, end)`` covers the call's open marker through its close marker when ``closed``; an
    unclosed call ends where the next call, the section's end, the stop id or the completion's end came.
    ``saw_reasoning``: a reasoning block was opened (or continued from the prompt) or closed;
    ``in_reasoning``: the completion ended inside one. ``stop``/``end``: the stop id (None when
    truncated) and the index where scanning ended."""

    reasoning: list[int] = field(default_factory=list)
    content: list[int] = field(default_factory=list)
    calls: list[tuple[int, int, bool]] = field(default_factory=list)
    saw_reasoning: bool = False
    in_reasoning: bool = False
    stop: int | None = None
    end: int = 0

    def response(self, calls: list[ToolCall], decode: Callable[[list[int]], str]) -> ParsedResponse:
        """The parsed response this scan describes, with ``calls`` (its call spans, parsed by the caller)."""
        return ParsedResponse(
            content=decode(self.content).strip(),
            reasoning_content=decode(self.reasoning).strip() if self.saw_reasoning else None,
            tool_calls=calls,
            reasoning_complete=(not self.in_reasoning) if self.saw_reasoning else None,
            stop_token_id=self.stop,
        )


def scan_ids(
    ids: Sequence[int],
    *,
    stop_ids: Collection[int],
    think: tuple[int, int] | None = None,
    call: tuple[int, int] | None = None,
    section: tuple[int, int] | None = None,
    restart: bool = False,
    in_reasoning: bool = False,
) -> Scan:
    """Scan ``ids`` up to the first of ``stop_ids``.

    - ``think``: the (open, close) ids of reasoning. A close with no open before it (the template's
      generation prompt opened the block, or the model skipped the open) makes everything before it
      reasoning; ``in_reasoning`` starts the scan inside a block the prompt opened.
    - ``call``: the (open, close) ids of one tool call; what lies between them is the call's body.
    - ``section``: the (begin, end) ids of a block holding the calls (DeepSeek, Kimi): structure, and
      the text between calls inside it is dropped, not content.
    - ``restart``: a call's open (or the section's end) inside a call ends that call unclosed; without
      it everything up to the close is the body (the base ``<tool_call>`` rule).
    """
    open_think, close_think = think or (None, None)
    open_call, close_call = call or (None, None)
    begin_section, end_section = section or (None, None)
    out = Scan(saw_reasoning=in_reasoning, in_reasoning=in_reasoning, end=len(ids))
    call_start: int | None = None
    in_section = False
    for i, tid in enumerate(ids):
        if tid in stop_ids:
            out.stop, out.end = tid, i
            break
        if call_start is not None:
            if tid == close_call:
                out.calls.append((call_start, i + 1, True))
                call_start = None
            elif restart and (tid == open_call or tid == end_section):
                out.calls.append((call_start, i, False))
                call_start = i if tid == open_call else None
                if tid == end_section:
                    in_section = False
            continue
        if tid == open_think and not out.in_reasoning:
            out.in_reasoning = out.saw_reasoning = True
        elif tid == close_think:
            if not out.in_reasoning and not out.saw_reasoning:
                out.reasoning, out.content = out.content, []  # a close with no open: what came before was reasoning
            out.in_reasoning = False
            out.saw_reasoning = True
        elif out.in_reasoning:
            out.reasoning.append(tid)
        elif tid == open_call:
            call_start = i
        elif tid == begin_section:
            in_section = True
        elif tid == end_section:
            in_section = False
        elif not in_section:
            out.content.append(tid)
    if call_start is not None:
        out.calls.append((call_start, out.end, False))
    return out


def prompt_opens_reasoning(
    prompt_ids: Sequence[int] | None, think: tuple[int, int] | None, closers: Collection[int]
) -> bool:
    """True when the prompt's last turn opened a reasoning block that the completion continues: the
    last of ``think``'s open, its close and ``closers`` (turn-closing ids) in the prompt is the open."""
    if not prompt_ids or think is None:
        return False
    open_id, close_id = think
    for tid in reversed(prompt_ids):
        if tid == open_id:
            return True
        if tid == close_id or tid in closers:
            return False
    return False
