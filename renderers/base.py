"""The Renderer base class: the public contract, and the parts every family shares.

A family subclass describes its template as pieces (``_render`` for a whole conversation,
``_continue`` for new messages after a closed assistant turn) and names its markers; this class
turns that into ``render``, ``parse_response`` and the append-only ``bridge``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar, Self

from .dialects import Dialect, dialect_named
from .dialects.json_calls import parse_json_call
from .long_pieces import new_pieces
from .messages import MessageError, normalize_messages, normalize_tools, tool_names
from .pieces import Pieces, PieceWriter
from .scan import prompt_opens_reasoning, scan_ids
from .tokenizer import Tokenizer
from .types import Break, BreakReason, Bridged, Capabilities, ParsedResponse, RenderedTokens, ToolCall, ToolCallStatus

THINKING_RETENTION = ("keep", "template")
# Every reasoning_effort value any template uses, in order. A template that distinguishes only some of
# them gets the nearest one (see nearest_effort).
EFFORT_LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def nearest_effort(requested: str, available: Sequence[str]) -> str:
    """The level of ``available`` nearest to ``requested`` on :data:`EFFORT_LEVELS`; ties go up.

    Raises ``ValueError`` naming the accepted values for a level outside :data:`EFFORT_LEVELS`, or
    when the template distinguishes no level at all."""
    if requested not in EFFORT_LEVELS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORT_LEVELS)}; got {requested!r}")
    if not available:
        raise ValueError("this template has no reasoning_effort levels")
    want = EFFORT_LEVELS.index(requested)
    return min(available, key=lambda lvl: (abs(EFFORT_LEVELS.index(lvl) - want), -EFFORT_LEVELS.index(lvl)))


class TemplateRejected(ValueError):
    """The chat template itself rejects this conversation (the reference would raise too)."""


class Renderer:
    """Conversation <-> token ids for one chat template (see docs/renderers.md for the contract).

    ``thinking_retention`` decides what ``bridge`` does when the template would rewrite reasoning
    the model already sampled: ``"keep"`` (default) extends the tokens the model saw, append-only;
    ``"template"`` returns a ``Break`` so that the caller re-renders exactly as the template does.

    Reentrant: nothing a call computes is stored on the renderer. Per-call template kwargs make a
    per-call copy (:meth:`_for_call`); what a family learns during one call (the last user query,
    the close a bridged turn takes) travels as arguments. One instance may serve many threads.
    """

    name: ClassVar[str]
    template_hashes: ClassVar[tuple[str, ...]] = ()  # sha256 of the templates the parity tests verified
    # What the template takes and renders. A hand-coded family declares these on its class; GenericRenderer
    # learns them per template in _read_template (so they are plain attributes, not ClassVars).
    template_kwargs_allowed: dict[str, type] = {}
    reasoning_efforts: tuple[str, ...] = ()  # levels the template distinguishes (EFFORT_LEVELS order)
    supports_tools: bool = True
    # How tool-call arguments of earlier assistant turns must be given for this template to re-render them
    # as sampled: "object" (the template applies tojson to a dict) or "json" (it concatenates a string).
    history_arguments: str = "object"
    turn_close: ClassVar[str]  # the special token that closes an assistant turn
    after_close: ClassVar[str] = ""  # template text between that token and the next message
    think_tokens: ClassVar[tuple[str, str] | None] = None
    tool_call_tokens: ClassVar[tuple[str, str] | None] = None
    extra_stop_tokens: ClassVar[tuple[str, ...]] = ()
    # The template renders ``tools=[]`` unlike no tools (Llama 3.1: an ipython header); render keeps it.
    renders_empty_tools: ClassVar[bool] = False
    # The hook for a hand-coded family whose output format is a dialect (renderers/dialects): its name.
    # parse_response then delegates to that dialect (with this renderer's stop ids) wherever the
    # vocabulary has the dialect's markers. None (every family today): the base scan below.
    dialect: ClassVar[str | None] = None

    def __init__(self, tokenizer: Tokenizer, *, thinking_retention: str = "keep", **template_kwargs: Any) -> None:
        if thinking_retention not in THINKING_RETENTION:
            raise ValueError(f"thinking_retention must be one of {THINKING_RETENTION}, got {thinking_retention!r}")
        self.tokenizer = tokenizer
        self.thinking_retention = thinking_retention
        self._read_template()
        self.template_kwargs = self.check_template_kwargs(template_kwargs)
        self._read_kwargs()

    def _read_template(self) -> None:
        """What the renderer knows of its template before any kwargs are checked. A hand-coded family
        declares it on its class, so only its markers' ids are looked up here; GenericRenderer probes."""
        tokenizer = self.tokenizer
        self.think_ids: tuple[int, ...] | None = (
            tuple(tokenizer.token_id(t) for t in self.think_tokens) if self.think_tokens else None
        )
        self.tool_call_ids: tuple[int, ...] | None = (
            tuple(tokenizer.token_id(t) for t in self.tool_call_tokens) if self.tool_call_tokens else None
        )

    def _read_kwargs(self) -> None:
        """What depends on ``self.template_kwargs``: the turn-closing and stop ids. Called at construction
        and on each per-call copy (:meth:`_for_call`); fixed for a hand-coded family, probed per kwargs
        by GenericRenderer (a template may close turns differently with thinking on)."""
        tokenizer = self.tokenizer
        self.turn_close_id: int = tokenizer.token_id(self.turn_close)
        stops = [self.turn_close_id] + [
            tokenizer.added_tokens[t] for t in self.extra_stop_tokens if t in tokenizer.added_tokens
        ]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))

    @property
    def template_sha256(self) -> str | None:
        return self.tokenizer.template_sha256

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            thinking_switch="enable_thinking" in self.template_kwargs_allowed,
            reasoning_efforts=self.reasoning_efforts,
            tools=self.supports_tools,
            bridge=True,
        )

    def check_template_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Validated template kwargs: a name the template does not take or a value of the wrong type is
        a ``ValueError``; ``reasoning_effort`` moves to the nearest level the template distinguishes."""
        out = {}
        for key, value in kwargs.items():
            expected = self.template_kwargs_allowed.get(key)
            if expected is None:
                allowed = ", ".join(self.template_kwargs_allowed) or "none"
                raise ValueError(f"renderer {self.name!r} has no template kwarg {key!r} (accepted: {allowed})")
            if not isinstance(value, expected):
                raise ValueError(f"template kwarg {key!r} must be {expected.__name__}, got {type(value).__name__}")
            if key == "reasoning_effort":
                value = nearest_effort(value, self.reasoning_efforts)
            out[key] = value
        return out

    def _for_call(self, overrides: dict[str, Any]) -> Self:
        """This renderer with per-call template kwargs (already checked) on top of the ones given at
        construction: a shallow copy, so that concurrent calls never see each other's kwargs (caches
        held in containers stay shared). No overrides: this renderer itself."""
        if not overrides:
            return self
        call = copy.copy(self)
        call.template_kwargs = {**self.template_kwargs, **overrides}
        call._read_kwargs()
        return call

    # ---- rendering -------------------------------------------------------------------------------

    def render(
        self, messages: Any, tools: Any = None, add_generation_prompt: bool = False, **template_kwargs: Any
    ) -> RenderedTokens:
        """Token ids identical to the template rendered by transformers and encoded with
        ``add_special_tokens=False``, with per-token attribution. ``template_kwargs`` (such as
        ``enable_thinking``, ``reasoning_effort``) override the renderer's for this call. Raises
        ``ValueError`` (a ``MessageError`` or ``TemplateRejected``) naming the problem."""
        msgs = normalize_messages(messages)
        if not msgs:
            raise MessageError("messages is empty")
        tool_defs = normalize_tools(tools)
        if tool_defs is None and self.renders_empty_tools and isinstance(tools, (list, tuple)):
            tool_defs = []  # normalize_tools folds [] to None; this template tells them apart
        if not template_kwargs:  # the common call: no per-call kwargs to check
            return self._render_tokens(msgs, tool_defs, add_generation_prompt)
        call = self._for_call(self.check_template_kwargs(template_kwargs))
        return call._render_tokens(msgs, tool_defs, add_generation_prompt)

    def _render_tokens(self, msgs: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> RenderedTokens:
        """Normalized messages to tokens; hand-coded families go through pieces."""
        p = new_pieces(self.tokenizer, len(msgs))
        self._render(p, msgs, tools, add_generation_prompt)
        return p.encode()

    def render_ids(
        self, messages: Any, tools: Any = None, add_generation_prompt: bool = False, **template_kwargs: Any
    ) -> list[int]:
        return self.render(messages, tools, add_generation_prompt, **template_kwargs).token_ids

    def _render(self, p: PieceWriter, msgs: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> None:
        raise NotImplementedError

    def _continue(
        self, p: PieceWriter, msgs: list[dict], tools: list[dict] | None, prompt_ids: list[int], completion: list[int]
    ) -> None:
        """Pieces for ``msgs`` following a closed assistant turn, then the generation prompt. ``prompt_ids``
        and ``completion`` are the ids being extended, for a family whose template carries state across
        the conversation (read, never kept)."""
        raise NotImplementedError

    # ---- bridging --------------------------------------------------------------------------------

    def bridge(
        self,
        prev_prompt_ids: list[int],
        prev_completion_ids: list[int],
        new_messages: Any,
        tools: Any = None,
        *,
        history: Any = None,
        **template_kwargs: Any,
    ) -> Bridged | Break:
        """The next prompt, append-only: prev prompt + prev completion + the new messages + the
        generation prompt. A completion that ended without closing its turn (truncated) gets the
        close synthesized as context. ``history`` (the messages behind ``prev_prompt_ids``) is for the
        generic renderer's full-render bridge; a hand-coded family bridges from the ids alone. Returns a ``Break`` with its reason where that is impossible; an
        empty previous prompt is one (there is no rendered conversation to extend)."""
        if len(prev_prompt_ids) == 0:  # (an array's truth value is ambiguous)
            return empty_prompt_break(prev_completion_ids)
        if not template_kwargs:  # the common call: no per-call kwargs to check
            return self._bridge(prev_prompt_ids, prev_completion_ids, new_messages, tools)
        try:
            overrides = self.check_template_kwargs(template_kwargs)
        except ValueError as exc:
            return Break(BreakReason.INVALID_MESSAGES, str(exc), len(prev_prompt_ids) + len(prev_completion_ids))
        return self._for_call(overrides)._bridge(prev_prompt_ids, prev_completion_ids, new_messages, tools)

    def _bridge(
        self, prev_prompt_ids: list[int], prev_completion_ids: list[int], new_messages: Any, tools: Any
    ) -> Bridged | Break:
        # Work on the completion only: nothing here may cost time proportional to the history.
        prefix_len = len(prev_prompt_ids) + len(prev_completion_ids)
        checked = self._new_messages(new_messages, tools, prefix_len)
        if isinstance(checked, Break):
            return checked
        msgs, tool_defs = checked
        completion = list(prev_completion_ids)
        if self.think_ids is not None:
            if self._ends_in_reasoning(prev_prompt_ids, completion):
                stopped = bool(completion) and completion[-1] in self.stop_token_ids
                reason = BreakReason.STOP_INSIDE_REASONING if stopped else BreakReason.TRUNCATED_INSIDE_REASONING
                what = "sampled a stop token" if stopped else "was cut off"
                return Break(reason, f"the completion {what} inside an unclosed reasoning block", position=prefix_len)
        brk = self._family_break(prev_prompt_ids, completion, msgs)
        if brk is not None:
            return brk
        close_id = self._turn_close_for(completion)
        closing = [] if completion and completion[-1] == close_id else [close_id]
        last = (closing or completion or prev_prompt_ids or [None])[-1]
        if last not in self.tokenizer.special_ids:
            return Break(
                BreakReason.NO_SPECIAL_TOKEN_ANCHOR, "the previous tokens do not end on a special token", prefix_len
            )
        p = Pieces(self.tokenizer)
        if self.after_close:
            p.scaffold(self.after_close)
        try:
            self._continue(p, msgs, tool_defs, prev_prompt_ids, completion)
        except ValueError as exc:
            return Break(BreakReason.TEMPLATE_ERROR, str(exc), prefix_len)
        return bridged(prev_prompt_ids, completion, closing, p.encode())

    def _new_messages(
        self, new_messages: Any, tools: Any, prefix_len: int, keep_empty_tools: bool = False
    ) -> tuple[list[dict], list[dict] | None] | Break:
        """The new messages and tools of a bridge, normalized, or the Break that refuses them: invalid
        input, nothing to bridge, or an assistant message (tokens the model never sampled).
        ``keep_empty_tools``: ``tools=[]`` stays ``[]`` (some templates render it unlike no tools)."""
        try:
            msgs = normalize_messages(new_messages)
            tool_defs = normalize_tools(tools)
        except MessageError as exc:
            return Break(BreakReason.INVALID_MESSAGES, str(exc))
        if keep_empty_tools and tool_defs is None and tools is not None:
            tool_defs = []
        if not msgs:
            return Break(BreakReason.INVALID_MESSAGES, "no new messages to bridge")
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                return Break(
                    BreakReason.ASSISTANT_IN_NEW_MESSAGES,
                    f"new message {i} is an assistant message: its tokens were not sampled in this rollout, "
                    "so they cannot be appended as the model's own",
                    position=prefix_len,
                )
        return msgs, tool_defs

    def _turn_close_for(self, completion: list[int]) -> int:
        """Family hook: the token that closes the bridged assistant turn (kept when sampled, else
        synthesized): :attr:`turn_close_id` unless the family closes some turns with another."""
        return self.turn_close_id

    def _family_break(self, prompt_ids: list[int], completion: list[int], msgs: list[dict]) -> Break | None:
        """Family hook: a Break when, under ``thinking_retention="template"``, the template would
        rewrite tokens that are already in the prefix."""
        return None

    def _ends_in_reasoning(self, prompt_ids: list[int], completion: list[int]) -> bool:
        open_id, close_id = self.think_ids  # type: ignore[misc]
        for tid in reversed(completion):  # the last think token the completion holds decides
            if tid == close_id:
                return False
            if tid == open_id:
                return True
        return self._prompt_opens_reasoning(prompt_ids)

    def _prompt_opens_reasoning(self, prompt_ids: list[int] | None) -> bool:
        """True when the prompt's last turn opened a reasoning block that the completion continues."""
        return prompt_opens_reasoning(prompt_ids, self.think_ids, (self.turn_close_id,))

    # ---- parsing ---------------------------------------------------------------------------------

    def parse_response(
        self, completion_ids: list[int], prompt_ids: list[int] | None = None, tools: Any = None
    ) -> ParsedResponse:
        """Split a completion into reasoning, content and tool calls by scanning its token ids."""
        if self.dialect is not None:
            dialect = self._dialect()
            if dialect is not None:
                return dialect.parse(completion_ids, tools, prompt_ids=prompt_ids, stop_ids=self.stop_token_ids)
        names = tool_names(normalize_tools(tools))
        ids = list(completion_ids)
        scan = scan_ids(
            ids,
            stop_ids=self.stop_token_ids,
            think=self.think_ids,
            call=self.tool_call_ids,
            in_reasoning=self._prompt_opens_reasoning(prompt_ids),
        )
        calls = []
        for start, end, closed in scan.calls:
            call = self._parse_call(ids[start + 1 : end - 1 if closed else end], (start, end), names)
            if not closed:
                call.status, call.error = ToolCallStatus.UNCLOSED, "the completion ended inside this tool call"
            calls.append(call)
        return scan.response(calls, self.tokenizer.decode)

    def _dialect(self) -> Dialect | None:
        """The dialect named by :attr:`dialect` on this tokenizer, or None where the vocabulary lacks its
        markers (then the base scan parses)."""
        return dialect_named(self.dialect, self.tokenizer) if self.dialect else None

    def _parse_call(self, body_ids: list[int], span: tuple[int, int], tool_names: set[str] | None) -> ToolCall:
        return parse_json_call(self.tokenizer.decode(body_ids), span, tool_names)


def empty_prompt_break(completion: list[int]) -> Break:
    """The Break for a bridge from no previous prompt: the ids a bridge extends must start with a
    rendered conversation (the PyPI renderers library refuses it too)."""
    return Break(
        BreakReason.EMPTY_PREVIOUS_PROMPT,
        "the previous prompt is empty: a bridge extends a rendered prompt; render the conversation instead",
        len(completion),
    )


def bridged(prompt: list[int], completion: list[int], closing: list[int], tail: RenderedTokens) -> Bridged:
    """The bridge's result: prompt + completion, then ``closing`` (a turn close synthesized for a
    truncated completion: context, attributed to no message) and the rendered ``tail``."""
    n = len(closing)
    appended = tail if not n else RenderedTokens(
        token_ids=closing + tail.token_ids,
        message_indices=[-1] * n + tail.message_indices,
        sampled_mask=[False] * n + tail.sampled_mask,
        is_content=[False] * n + tail.is_content,
    )
    return Bridged(prefix_len=len(prompt) + len(completion), appended=appended, synthesized=n, prev_prompt_ids=prompt,
                   prev_completion_ids=completion)
