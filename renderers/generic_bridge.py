"""The generic renderer's bridge (a mixin of :class:`renderers.generic.GenericRenderer`).

Where the load-time probe found a new message's role append-only after an assistant turn, the bridge
splices: it renders a sentinel history shaped like the sampled turn plus the new messages, and appends
the text after the turn's close (``_splice``). Where the probe found it not append-only, or the splice
finds this conversation's render is not, the whole conversation is rendered and the turn bridged when
that render extends the previous ids exactly (renderers/full_bridge.py).
"""

from __future__ import annotations

from typing import Any

from .base import TemplateRejected, bridged, empty_prompt_break
from .dialects import dialect_for
from .full_bridge import as_sampled, assistant_message, full_bridge, stripped_edge
from .long_pieces import encode_pieces
from .messages import MessageError, normalize_messages
from .probe import PROBE_CALL, SENT_ASSISTANT, SENT_USER, call_id, closers, splice_point
from .recipes import applies, fill, plain, sentinel, split_parts, split_segments, with_slots
from .recover import recover_conversations
from .tracked import tracked
from .types import Break, BreakReason, Bridged, RenderedTokens

# Recipes of the splice (``_splice_by_recipe``, renderers/recipes.py): at most this many shapes per renderer
_RECIPES = 1024

# Breaks of the splice that say this conversation's render is not append-only: the full render decides.
_RENDER_IN_FULL = (BreakReason.TEMPLATE_NOT_APPEND_ONLY, BreakReason.SYSTEM_MESSAGE_MOVES, BreakReason.NO_SPECIAL_TOKEN_ANCHOR)


class GenericBridge:
    """The bridge methods of the generic renderer (they use its probe, template and tokenizer)."""

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
        """As :meth:`Renderer.bridge`. ``history``: the messages ``prev_prompt_ids`` was rendered from;
        where the probe finds the template not append-only for the new messages, the bridge renders
        the whole conversation and extends when that render starts with the previous ids exactly
        (renderers/full_bridge.py). It is read only then (a caller holding its conversation passes it
        by reference at no cost; nothing of it is kept). Without it, the conversation of a prompt this
        renderer produced (a render with the generation prompt, or a bridge) is recalled, else
        recovered from the ids alone (renderers/recover.py)."""
        if len(prev_prompt_ids) == 0:  # (an array's truth value is ambiguous)
            return empty_prompt_break(prev_completion_ids)
        if not template_kwargs:
            return self._bridge(prev_prompt_ids, prev_completion_ids, new_messages, tools, history)
        try:
            overrides = self.check_template_kwargs(template_kwargs)
        except ValueError as exc:
            return Break(BreakReason.INVALID_MESSAGES, str(exc), len(prev_prompt_ids) + len(prev_completion_ids))
        return self._for_call(overrides)._bridge(prev_prompt_ids, prev_completion_ids, new_messages, tools, history)

    def _bridge(self, prev_prompt_ids, prev_completion_ids, new_messages, tools, history=None) -> Bridged | Break:
        prefix_len = len(prev_prompt_ids) + len(prev_completion_ids)
        checked = self._new_messages(new_messages, tools, prefix_len, keep_empty_tools=True)
        if isinstance(checked, Break):
            return checked
        msgs, tool_defs = checked
        completion = list(prev_completion_ids)
        if self.think_ids is not None and self._ends_in_reasoning(prev_prompt_ids, completion):
            stopped = bool(completion) and completion[-1] in self.stop_token_ids
            reason = BreakReason.STOP_INSIDE_REASONING if stopped else BreakReason.TRUNCATED_INSIDE_REASONING
            what = "sampled a stop token" if stopped else "was cut off"
            return Break(reason, f"the completion {what} inside an unclosed reasoning block", position=prefix_len)
        probe = self.probe
        # what the probe found for the first new message whose role is not append-only after a turn
        why = next((w for m in msgs if (w := probe.continuations.get(m["role"])) is not None), None)
        # A completion that stopped on a token the template closes turns with is extended after it (kept
        # as sampled); anything else (cut off, or another stop id such as an end-of-text) gets the close
        # the template puts after a reply followed by more messages, synthesized as context.
        last = completion[-1] if completion else None
        closing_ids = self._closing_ids(probe)
        closing = last not in closing_ids
        if closing and probe.close_gap:
            return Break(
                BreakReason.NO_SPECIAL_TOKEN_ANCHOR,
                f"the completion ended without a stop token and the template puts {probe.close_gap!r} before its close",
                prefix_len,
            )
        result = None
        if why is None:
            result = self._splice(prev_prompt_ids, completion, msgs, tool_defs, closing, prefix_len)
            if isinstance(result, Break) and result.reason in _RENDER_IN_FULL:
                why = result.detail  # the splice found this conversation's render not append-only
        if why is not None:
            result = self._bridge_in_full(prev_prompt_ids, completion, msgs, tool_defs, history, why, closing_ids, result)
        if isinstance(result, Bridged) and history is None:
            # O(1) in the history: the sampled turn is parsed only if a later bridge needs it (a caller that
            # passes its history holds the conversation itself: nothing is remembered for it)
            self._conversations.extend(prev_prompt_ids, completion, result.appended.token_ids, msgs, tool_defs,
                                       self.template_kwargs)
        return result

    def _closing_ids(self, probe) -> frozenset[int]:
        """The ids the template closes a turn with (its stop tokens and the history close)."""
        cached = self.__dict__.get("_closers")
        if cached is None or cached[0] is not probe:
            added = self.tokenizer.added_tokens
            cached = self._closers = (probe, frozenset(added[t] for t in (*probe.stop_tokens, probe.history_close) if t))
        return cached[1]

    def _bridge_in_full(self, prompt, completion, msgs, tools, history, why, closing_ids, splice_break) -> Bridged | Break:
        """The full-render bridge (renderers/full_bridge.py) for the conversation behind ``prompt``; where
        that conversation is unknown, the splice's Break, or the probe's finding as one."""
        prefix_len = len(prompt) + len(completion)
        tk = self.template_kwargs
        if history is not None:
            try:
                history = normalize_messages(history)
            except MessageError as exc:
                return Break(BreakReason.INVALID_MESSAGES, f"history: {exc}", prefix_len)
        else:
            history = self._conversations.recall(prompt, tools, tk, lambda ids: assistant_message(self, ids, tools))
        if history is None:
            readings = recover_conversations(self, prompt, tools)
            if len(readings) > 1:
                return self._bridge_readings(prompt, completion, readings, msgs, tools, closing_ids, why)
            if readings:
                history = readings[0]
                self._conversations.remember(prompt, history, tools, tk)
        if history is None:
            if splice_break is not None:
                return splice_break
            reason = BreakReason.TEMPLATE_NOT_APPEND_ONLY
            if why.startswith("MOVES: ") and any(m["role"] == "system" for m in msgs):
                reason = BreakReason.SYSTEM_MESSAGE_MOVES
            return Break(
                reason,
                f"the generic renderer cannot bridge: {why.removeprefix('MOVES: ')}, and the conversation behind "
                "the previous prompt is unknown: not remembered, and no conversation recovered from its ids "
                "re-renders to them exactly (pass history=)",
                prefix_len,
            )
        return self._full(prompt, completion, history, assistant_message(self, completion, tools), msgs, tools,
                          closing_ids, why)

    def _full(self, prompt, completion, history, assistant, msgs, tools, closing_ids, why) -> Bridged | Break:
        """The full-render bridge with the sampled turn as parsed, else with its text as sampled (a parse
        strips it; renderers/full_bridge.py ``as_sampled``): either is checked on the sampled ids."""
        result = full_bridge(self, prompt, completion, history, assistant, msgs, tools, closing_ids, why)
        if isinstance(result, Break):
            for exact in as_sampled(self, assistant, completion, prompt):
                retry = full_bridge(self, prompt, completion, history, exact, msgs, tools, closing_ids, why)
                if isinstance(retry, Bridged):
                    return retry
            if result.reason is BreakReason.TEMPLATE_NOT_APPEND_ONLY and (result.position or 0) >= len(prompt):
                stripped = stripped_edge(self, prompt, completion, history, assistant, msgs, tools)
                if stripped is not None:
                    return Break(BreakReason.EDGE_WHITESPACE_STRIPPED, stripped, result.position)
        return result

    def _bridge_readings(self, prompt, completion, readings, msgs, tools, closing_ids, why) -> Bridged | Break:
        """The full-render bridge where the previous prompt's ids re-render from several conversations
        (renderers/recover.py): bridged only where every reading gives the same ids, since the ids
        cannot tell which one the caller had. Nothing is remembered: a later bridge asks again."""
        assistant = assistant_message(self, completion, tools)
        results = [self._full(prompt, completion, h, assistant, msgs, tools, closing_ids, why) for h in readings]
        first = results[0]
        if isinstance(first, Bridged) and all(
            isinstance(r, Bridged) and r.appended.token_ids == first.appended.token_ids for r in results[1:]
        ):
            return first
        if all(isinstance(r, Break) for r in results):
            return first
        return Break(
            BreakReason.TEMPLATE_NOT_APPEND_ONLY,
            f"the previous prompt's ids re-render exactly from {len(readings)} conversations (the template folds "
            "a system prompt into a user turn as plain text) whose renders with the new messages differ, so the "
            f"conversation behind them is unknown (pass history=); the probe found: {why.removeprefix('MOVES: ')}",
            len(prompt) + len(completion),
        )

    def _shape(self, completion: list[int]) -> tuple[tuple[str, ...], bool]:
        """What the sentinel histories take from the sampled turn: its tool calls' names (templates render
        tool results by them) and whether it reasons (to see what the template drops)."""
        dialect = dialect_for(self.tokenizer)
        if dialect is not None:  # the parse without decoding the content or typing arguments
            names, reasons = dialect.call_names_and_reasoning(completion, self.stop_token_ids)
        else:
            parsed = self.parse_response(completion)
            names, reasons = tuple(c.name or "" for c in parsed.tool_calls), bool(parsed.reasoning_content)
        return tuple(name or PROBE_CALL["function"]["name"] for name in names), reasons

    @staticmethod
    def _histories(shape: tuple[tuple[str, ...], bool]) -> list[list[dict]]:
        """Sentinel histories ending in an assistant turn of this shape. The reply's text is the anchor;
        a template that refuses text next to reasoning and tool calls (gpt-oss) gets the anchor as the
        reasoning instead."""
        names, reasons = shape
        calls = [{"id": call_id(i), "type": "function", "function": {"name": name, "arguments": {}}}
                 for i, name in enumerate(names)]
        extra: dict[str, Any] = {"tool_calls": calls} if calls else {}
        user = {"role": "user", "content": SENT_USER}
        if not reasons:
            return [[user, {"role": "assistant", "content": SENT_ASSISTANT, **extra}]]
        return [
            [user, {"role": "assistant", "content": SENT_ASSISTANT, "reasoning_content": SENT_USER, **extra}],
            [user, {"role": "assistant", "reasoning_content": SENT_ASSISTANT, **extra}],
        ]

    def _splice(self, prompt, completion, msgs, tools, needs_close: bool, prefix_len) -> Bridged | Break:
        if not self.probe.tools_in_tail:
            tools = None  # the probe found they only change text before the splice: do not render them
        shape = self._shape(completion)
        fast = self._splice_by_recipe(shape, msgs, tools, needs_close)
        if fast is not None:
            return bridged(prompt, completion, fast[1], fast[0])
        spliced = self._splice_tail(self._histories(shape), msgs, tools, needs_close, prefix_len)
        if isinstance(spliced, Break):
            return spliced
        return bridged(prompt, completion, spliced[1], encode_pieces(self.tokenizer, spliced[0]))  # all unsampled

    def _splice_by_recipe(self, shape, msgs, tools, needs_close) -> tuple[RenderedTokens, list[int]] | None:
        """The splice's tail from the recipe for this shape of bridge, or None (no recipe: the full
        splice runs). A recipe is the splice of the same messages with a sentinel for each text (built
        once per shape); it applies where every text is plain (no added-token string, no private-use
        character) and the template's real render is the recipe's text with the texts put in: then the
        tail is the recipe's with the texts put in, exactly what the full splice would assemble, with no
        render where the template's tests of the texts hold (renderers/tracked.py), else one. The runs of
        the tail that hold no text were encoded when the recipe was built."""
        if self.thinking_retention == "template":
            return None
        texts = [m.get("content") for m in msgs]
        if not plain(texts, self._added_re):
            return None
        key = (shape, needs_close, repr([{k: v for k, v in m.items() if k != "content"} for m in msgs]),
               None if tools is None else repr(tools), self._kwargs_repr())
        recipes = self._recipes
        recipe = recipes.get(key)
        if recipe is None:
            if len(recipes) >= _RECIPES:
                recipes.clear()
            recipe = recipes[key] = self._recipe(self._histories(shape), msgs, tools, needs_close)
        if recipe is False:
            return None
        history, parts, segments, closing, trace = recipe
        full = applies(parts, texts)
        if full is None:
            return None
        # the render is the recipe's text with the texts put in where the template asked these texts what
        # it asked the sentinels and got the same answers (renderers/tracked.py); else it is rendered
        if (trace is None or not trace.holds(texts)) and self._try_text([*history, *msgs], tools, True) != full:
            return None  # the template renders these texts unlike the sentinels: the full splice decides
        return fill(self.tokenizer, segments, texts), closing  # (all unsampled: context)

    def _recipe(self, histories, msgs, tools, needs_close):
        """(history, the full text as literal parts and text indices, the tail's segments
        (renderers/recipes.py), closing, the trace of what the template does with the texts or None),
        or False where the shape has none (a sentinel not rendered exactly once, as one content piece of
        its own)."""
        marked = [{**m, "content": sentinel(i)} for i, m in enumerate(msgs)]
        spliced = self._splice_tail(histories, marked, tools, needs_close, 0)
        if isinstance(spliced, Break):
            return False
        tail, closing, history, full = spliced
        parts = split_parts(full, len(msgs))
        slotted = with_slots(tail, len(msgs)) if parts is not None else None
        if slotted is None:
            return False
        traced = [*history, *({**m, "content": tracked(m["content"], i)} for i, m in enumerate(marked))]
        return history, parts, split_segments(self.tokenizer, slotted), closing, self._trace(traced, tools, True, full)

    def _splice_tail(self, histories, msgs, tools, needs_close: bool, prefix_len):
        """(the tail's pieces after the splice point, the synthesized close, the sentinel history, the full
        text), or the Break that says why there is no splice."""
        error = None
        for history in histories:
            conversation = history + msgs
            try:
                full = self._text(conversation, tools, True)
                break
            except TemplateRejected as exc:
                error = exc
        else:
            return Break(BreakReason.TEMPLATE_ERROR, str(error), prefix_len)
        specials, content = self._annotate(conversation, tools, True, full)
        h = len(history)
        anchor = closers(self.probe, self._added_re)
        # after the last turn-closing token before the new messages' text: an assistant turn with tool
        # calls may be several closed messages (gpt-oss renders its text and each call apart)
        first_new = min((s for s, _e, i in content if i >= h), default=None)
        cut = splice_point(full, anchor, first_new)
        if cut is None:
            return Break(
                BreakReason.NO_SPECIAL_TOKEN_ANCHOR,
                "the template puts no turn-closing token after the assistant turn before the new messages",
                prefix_len,
            )
        if self.thinking_retention == "template":
            brk = self._rewrites_history(history, tools, full, cut, anchor, prefix_len)
            if brk is not None:
                return brk
        # the close the template puts at the splice (gpt-oss: <|call|> after a tool call, else <|end|>)
        closing = [self._token_ending_at(full, cut, specials)] if needs_close else []
        for s, _e, i in content:
            if i >= h and s < cut:
                role = conversation[i]["role"]
                reason = BreakReason.SYSTEM_MESSAGE_MOVES if role == "system" else BreakReason.TEMPLATE_NOT_APPEND_ONLY
                return Break(reason, f"the template renders new message {i - h} ({role}) before the assistant turn's close", 0)
        starts = self._boundaries(conversation, tools, True, full, specials, content, bridging=True)
        pieces = self._assemble(conversation, full, specials, content, starts, start_at=cut)
        tail = [(text, k - h if k >= h else -1, is_content, False) for text, k, is_content, _ in pieces]
        return tail, closing, history, full

    def _token_ending_at(self, text: str, end: int, specials: list[tuple[int, int, int]]) -> int:
        for _s, e, tid in specials:
            if e == end:
                return tid
        close = self.probe.history_close
        assert close is not None, "a bridged render needs the probe's history close (capabilities.bridge)"
        return self.tokenizer.added_tokens[close]

    def _rewrites_history(self, history, tools, full, cut, anchor, prefix_len) -> Break | None:
        """``thinking_retention="template"``: would the template render the sampled turn (or the prompt
        before it) differently once the new messages follow?"""
        alone = self._try_text(history, tools, False)
        prompt = self._try_text(history[:-1], tools, True)
        alone_cut = splice_point(alone, anchor) if alone is not None else None
        if alone_cut is None or alone[:alone_cut] != full[:cut] or prompt is None or not full.startswith(prompt):
            # e.g. gpt-oss closes a final reply with <|return|> and the same reply in history with <|end|>
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY,
                "the template renders the sampled assistant turn (or the prompt before it) differently once "
                "new messages follow",
                position=prefix_len,
            )
        return None
