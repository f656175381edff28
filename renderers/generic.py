"""The generic template renderer: any chat template, rendered with minijinja, with token parity,
marker safety, attribution found by annotated renders, and an append-only bridge learnt by probing.

How a render works (``GenericRenderer.render``):

1. The real text: the template rendered as transformers renders it (renderers/template_env.py).
2. An annotated render: every added-token string inside message text / tool definitions is
   *defused* (a private-use character after its first character), and the stripped core of each
   message text field is wrapped in two private-use marks naming the message. Removing those
   characters must give the real text back exactly; then the added-token strings of the defused
   text are the template's own special tokens, and the marks are the exact spans of message content.
   Where it does not (the template tested or transformed the text in a way the marks change, e.g.
   ``startswith``, ``trim`` of a marked edge), a defused-only render is tried for the special
   tokens, without content spans; where even that differs (the template branched on a marker,
   e.g. split content on ``</think>``), the real text is split on every added-token string, as
   transformers does (the template intended those markers).
3. Message boundaries: between the text of message i-1 and that of message i, message i starts
   after the first turn-closing token (and the whitespace after it), or where message i-1's text
   ends when there is none. Where some message's text was not found (or is out of order), renders
   of growing prefixes decide: message i's turn starts where the render of the first i messages
   stops agreeing with the full render, moved past that prefix render's closing text. What the
   template renders for no messages (BOS, a default system prompt, tool definitions) and the
   generation prompt belong to no message (-1).
4. Sampled tokens: in an assistant message's turn, after the part the turn shares with the
   generation prompt (the header), through the last stop token of the turn.
5. Tokens: each run of text between two special tokens is encoded on its own (renderers/pieces.py),
   which reproduces the reference tokenizer's ids.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from typing import Any

from .annotate import (
    DEFUSE_CANDIDATES,
    MARK_RE,
    MAX_MARKED,
    added_regex,
    all_strings,
    common_prefix,
    content_spans,
    defused,
    mark_message,
    past_closing,
    snap,
)
from .base import Renderer, TemplateRejected
from .conversations import Conversations
from .dialects import dialect_for
from .generic_bridge import GenericBridge
from .long_pieces import encode_pieces
from .messages import MessageError, normalize_messages, normalize_tools
from .pieces import Piece
from .probe import Probe, probe_template
from .recipes import applies, fill, plain, sentinel, split_parts, split_segments, with_slots
from .template_env import compile_template, defused_template
from .tokenizer import Tokenizer
from .tracked import Trace, trace_render, tracked
from .types import Capabilities, ParsedResponse, RenderedTokens

# Private-use characters: defusing markers, and marking message text. Inputs that contain any of them
# are rendered without marks (coarser attribution), never wrongly.
_END_OF_TEXT = re.compile(r"<\|?(endoftext|end_of_text|eos)\|?>|<｜end▁of▁sentence｜>")
_PROBE_CACHE: dict[tuple, tuple[Any, Probe]] = {}  # (template sha256, backend id, kwargs) -> (backend, probe)
_TEXT_FIELDS = ("content", "reasoning_content")  # a message's texts, as the annotation marks them
_RENDER_RECIPES = 1024  # render recipes (and shapes seen once) kept per renderer


class GenericRenderer(GenericBridge, Renderer):
    """Any chat template (see the module docstring). Capabilities, template kwargs, stop tokens and
    the bridge come from probing the template when the renderer is built."""

    name = "generic"
    turn_close = ""  # per template kwargs, from the probe (_read_kwargs)

    def __init__(self, tokenizer: Tokenizer, *, thinking_retention: str = "keep", **template_kwargs: Any) -> None:
        if tokenizer.chat_template is None:
            raise ValueError(f"{tokenizer.name_or_path} has no chat template for the generic renderer to render")
        # A vocabulary with added tokens for ordinary text (Gemma's newline and space runs, HTML tags):
        # message text is split on them as transformers does; only the markers stay text inside a message.
        self._marker_ids = tokenizer.markers
        super().__init__(tokenizer.text_view, thinking_retention=thinking_retention, **template_kwargs)

    def _read_template(self) -> None:
        """Compile and probe the template: what :class:`Renderer` reads from a hand-coded family's class
        (the kwargs it takes, its reasoning levels, tools, history arguments) comes from the probe here."""
        tokenizer, markers = self.tokenizer, self._marker_ids
        self.template = compile_template(tokenizer.chat_template)
        self.special = {k: v for k, v in (("bos_token", tokenizer.bos_token), ("eos_token", tokenizer.eos_token)) if v}
        self._markers = tuple(sorted(markers))
        self._added_re = added_regex(markers)
        self._added_by_id = {v: k for k, v in tokenizer.added_tokens.items()}
        # a model may also stop on its end-of-text token (Qwen's <|endoftext|>, Llama's <|end_of_text|>, <eos>)
        self._end_of_text = tuple(i for t, i in markers.items() if _END_OF_TEXT.fullmatch(t))
        self._probes: dict[tuple, Probe] = {}
        self._conversations = Conversations()  # prompt ids -> their messages, for the full-render bridge
        self._recipes: dict = {}  # bridge shape -> its splice recipe (renderers/generic_bridge.py)
        self._render_recipes: dict = {}  # conversation shape -> its render recipe (_render_by_recipe)
        self._render_shapes: dict = {}  # shapes rendered once (a recipe is built the second time)
        base = self._probe_for({})
        self.template_kwargs_allowed = dict(base.kwargs)
        self.reasoning_efforts = base.reasoning_efforts
        self.supports_tools = base.tools
        self.history_arguments = base.history_arguments
        added = tokenizer.added_tokens
        # the reasoning pair of the vocabulary's dialect (``<think>``, Gemma 4's channel markers, ...)
        dialect = dialect_for(tokenizer)
        self.think_ids = dialect.think_ids if dialect is not None else None
        pair = ("<tool_call>", "</tool_call>")
        self.tool_call_ids = (added[pair[0]], added[pair[1]]) if all(t in added for t in pair) else None

    def _read_kwargs(self) -> None:
        """The probe for ``self.template_kwargs``, and the turn-closing and stop ids it found. Stops are
        the probe's turn-closing tokens, then the tokenizer's end-of-sequence ids; never one of the
        dialect's structural markers. A template with no end-of-turn token (GLM: the next role tag ends
        a turn) renders a tool-call turn ending in ``</tool_call>``, which the probe reads as a stop; sent
        to an engine, it would end the turn after the first of several parallel calls."""
        probe = self.probe = self._probe_for(self.template_kwargs)
        tok = self.tokenizer
        self.turn_close_id = tok.added_tokens[probe.turn_close] if probe.turn_close else -1
        dialect = dialect_for(tok)
        structure = set() if dialect is None else {
            *(dialect.think_ids or ()), *(dialect.call_ids or ()), *(dialect.section_ids or ())}
        stops = [i for i in (tok.added_tokens[t] for t in probe.stop_tokens) if i not in structure]
        self.stop_token_ids = tuple(dict.fromkeys([*stops, *tok.eos_token_ids, *self._end_of_text]))

    # ---- probing ----------------------------------------------------------------------------------

    def _probe_for(self, kwargs: dict[str, Any]) -> Probe:
        """The probe for these template kwargs: per renderer, then per template and tokenizer backend."""
        local = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        probe = self._probes.get(local)
        if probe is not None:
            return probe
        backend = self.tokenizer.backend
        key = (self.tokenizer.template_sha256, id(backend), local)
        cached = _PROBE_CACHE.get(key)
        if cached is not None and cached[0] is backend:  # the entry holds its backend: its id is not reused
            probe = cached[1]
        else:
            probe = probe_template(self.template, self._added_re, self.special, kwargs)
            if len(_PROBE_CACHE) > 256:
                _PROBE_CACHE.clear()
            _PROBE_CACHE[key] = (backend, probe)
        self._probes[local] = probe
        return probe

    @property
    def capabilities(self) -> Capabilities:
        probe = self.probe
        return Capabilities(
            thinking_switch=probe.thinking_switch,
            reasoning_efforts=self.reasoning_efforts,
            tools=self.supports_tools,
            bridge=probe.history_close is not None and any(v is None for v in probe.continuations.values()),
        )

    # ---- rendering --------------------------------------------------------------------------------

    def render(
        self, messages: Any, tools: Any = None, add_generation_prompt: bool = False, **template_kwargs: Any
    ) -> RenderedTokens:
        """As :meth:`Renderer.render`; an empty tool list stays an empty list (templates tell ``[]`` from
        none: Llama 3.1 announces the ipython environment for ``tools=[]``)."""
        msgs = normalize_messages(messages)
        if not msgs:
            raise MessageError("messages is empty")
        tool_defs = _tools(tools)
        call = self._for_call(self.check_template_kwargs(template_kwargs))  # this call's kwargs, never on self
        rendered = call._render_tokens(msgs, tool_defs, add_generation_prompt)
        if add_generation_prompt:  # a prompt a later bridge may need the conversation of
            self._conversations.remember(rendered.token_ids, msgs, tool_defs, call.template_kwargs)
        return rendered

    def _text(self, msgs: list[dict], tools: list[dict] | None, agp: bool, defuse: str | None = None) -> str:
        template = self.template
        if defuse is not None:  # the template's string tests on message text look for defused markers
            template = defused_template(template, self._markers, defuse)
        return template.render(msgs, tools, agp, self.special, **self.template_kwargs)

    def _render_tokens(self, msgs: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> RenderedTokens:
        fast = self._render_by_recipe(msgs, tools, add_generation_prompt)
        if fast is not None:
            return fast
        return encode_pieces(self.tokenizer, self._pieces(msgs, tools, add_generation_prompt))

    def _render_by_recipe(self, msgs: list[dict], tools: list[dict] | None, agp: bool) -> RenderedTokens | None:
        """The render from the recipe of this conversation's shape (renderers/recipes.py), or None.

        The shape is everything but the texts (each message's content and reasoning with a non-space
        character): roles, tool calls, other fields, tools, the generation prompt and the template
        kwargs. A shape's recipe is built the second time it is rendered (GRPO groups, a task set's
        prompts, a session's turns share shapes; a shape seen once costs only its key): the pieces of
        the conversation with a sentinel for each text and the trace of what the template does with
        the texts. It applies where the texts are plain and the template's tests of them give the
        sentinels' answers: then no template render is needed, only the runs holding the texts are
        encoded. Otherwise the render runs as before."""
        if self.thinking_retention == "template" or len(msgs) > MAX_MARKED // 2:
            return None
        texts: list[str] = []
        shape = []
        for m in msgs:
            fields = []
            for k, v in m.items():
                if k in _TEXT_FIELDS and v.__class__ is str and v.strip():
                    texts.append(v)
                    fields.append(k)
                else:
                    fields.append((k, v if v.__class__ is str or v is None else repr(v)))
            shape.append(tuple(fields))
        if not texts or not plain(texts, self._added_re):
            return None
        key = (tuple(shape), None if tools is None else repr(tools), agp, self._kwargs_repr())
        recipes = self._render_recipes
        recipe = recipes.get(key)
        if recipe is None:
            if len(recipes) >= _RENDER_RECIPES:
                recipes.clear()
            seen = self._render_shapes
            if key not in seen:  # the first time: remember the shape only
                if len(seen) >= _RENDER_RECIPES:
                    seen.clear()
                seen[key] = None
                return None
            recipe = recipes[key] = self._render_recipe(msgs, tools, agp, len(texts))
        if recipe is False:
            return None
        parts, segments, trace = recipe
        if not trace.holds(texts) or applies(parts, texts) is None:
            return None
        return fill(self.tokenizer, segments, texts)

    def _render_recipe(self, msgs: list[dict], tools: list[dict] | None, agp: bool, count: int):
        """(the text as parts, the pieces as segments, the trace) for ``msgs``' shape, or False where
        it has none: a sentinel not rendered once as one content piece of its own, or a template that
        does with a text what no test covers (renderers/tracked.py)."""
        marked, traced, n = [], [], 0
        for m in msgs:
            mm, tm = dict(m), dict(m)
            for k in _TEXT_FIELDS:
                v = m.get(k)
                if v.__class__ is str and v.strip():
                    mm[k], tm[k] = sentinel(n), tracked(sentinel(n), n)
                    n += 1
            marked.append(mm)
            traced.append(tm)
        try:
            pieces = self._pieces(marked, tools, agp)
        except TemplateRejected:
            return False
        added_by_id = self._added_by_id
        full = "".join(v if v.__class__ is str else added_by_id[v] for v, *_ in pieces)
        parts = split_parts(full, count)
        slotted = with_slots(pieces, count) if parts is not None else None
        if slotted is None:
            return False
        trace = self._trace(traced, tools, agp, full)
        if trace is None:
            return False
        return parts, split_segments(self.tokenizer, slotted), trace

    def _trace(self, msgs: list[dict], tools: list[dict] | None, agp: bool, full: str) -> Trace | None:
        """What the template does with the :class:`Tracked` texts of ``msgs`` (renderers/tracked.py), where
        the traced render is ``full`` (the recipe's text) and every use of a text is covered by a test;
        else None."""
        ctx = self.template.context(msgs, tools, agp, self.special, **self.template_kwargs)
        text, trace = trace_render(self.template.source, ctx)
        return trace if trace.unsafe is None and text == full else None

    def _kwargs_repr(self) -> str:
        """The template kwargs as a recipe key, computed once per kwargs dict."""
        kwargs = self.template_kwargs
        cached = self.__dict__.get("_kwargs_key")
        if cached is None or cached[0] is not kwargs:
            cached = self._kwargs_key = (kwargs, repr(sorted(kwargs.items())))
        return cached[1]

    def _pieces(self, msgs: list[dict], tools: list[dict] | None, agp: bool, boundaries: bool = True) -> list[Piece]:
        """The rendered conversation as pieces: special token ids and attributed runs of text."""
        real = self._text(msgs, tools, agp)
        specials, content = self._annotate(msgs, tools, agp, real)
        starts = self._boundaries(msgs, tools, agp, real, specials, content) if boundaries else None
        return self._assemble(msgs, real, specials, content, starts)

    def _annotate(
        self, msgs: list[dict], tools: list[dict] | None, agp: bool, real: str
    ) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """The template's special tokens ``(start, end, id)`` and message content spans ``(start, end,
        message)`` in ``real`` (see the module docstring, step 2)."""
        added = self._added_re
        strings = all_strings(msgs, tools)
        defuse = next((c for c in DEFUSE_CANDIDATES if c not in strings), None)
        markable = not MARK_RE.search(strings)
        has_marker = added is not None and added.search(strings) is not None
        if defuse is None:
            return self._all_specials(real), []
        if markable:
            fields: list[tuple[int, str, str, str]] = []
            marked_msgs = [
                mark_message(defused(m, added, defuse) if has_marker else m, i, fields) for i, m in enumerate(msgs)
            ]
            if len(fields) > MAX_MARKED:
                marked_msgs = None
        if markable and marked_msgs is not None:
            try:
                marked_tools = defused(tools, added, defuse) if has_marker else tools
                text = self._text(marked_msgs, marked_tools, agp, defuse if has_marker else None)
            except TemplateRejected:
                text = None
            if text is not None and MARK_RE.sub("", text).replace(defuse, "") == real:
                content = content_spans(text, defuse, fields, real)
                if not has_marker:
                    return self._all_specials(real), content
                return self._specials_of_defused(MARK_RE.sub("", text), defuse), content
        if not has_marker:
            return self._all_specials(real), []
        try:
            text = self._text(defused(msgs, added, defuse), defused(tools, added, defuse), agp, defuse)
        except TemplateRejected:
            text = None
        if text is not None and text.replace(defuse, "") == real:
            return self._specials_of_defused(text, defuse), []
        return self._all_specials(real), []  # the template branched on a marker: its own intent

    def _all_specials(self, text: str) -> list[tuple[int, int, int]]:
        if self._added_re is None:
            return []
        ids = self.tokenizer.added_tokens
        return [(m.start(), m.end(), ids[m.group()]) for m in self._added_re.finditer(text)]

    def _specials_of_defused(self, text: str, defuse: str) -> list[tuple[int, int, int]]:
        """Added-token strings of a defused render, at their positions once the defuse characters are gone."""
        if self._added_re is None:
            return []
        out = []
        removed = 0
        pos = 0
        ids = self.tokenizer.added_tokens
        for m in self._added_re.finditer(text):
            removed += text.count(defuse, pos, m.start())
            pos = m.start()
            out.append((m.start() - removed, m.end() - removed, ids[m.group()]))
        return out

    def _boundaries(self, msgs, tools, agp, real, specials, content, bridging: bool = False) -> list[int]:
        """Where each message's turn starts in ``real``, plus where the last one ends (step 3).
        ``bridging``: only the boundaries after the sentinel history matter (the first message's start,
        which costs a render of the template's preamble, is not needed)."""
        n = len(msgs)
        first_content = [None] * n
        last_content = [None] * n
        for s, e, i in content:
            if first_content[i] is None:
                first_content[i] = s
            last_content[i] = e
        special_starts = {s: e for s, e, _ in specials}
        fast = self._boundaries_by_closers(msgs, tools, real, specials, first_content, last_content, bridging)
        if fast is not None:
            return fast
        starts: list[int] = []
        for i in range(n + 1):
            if i == n:
                prefix = self._try_text(msgs, tools, False) if agp else real
            else:
                prefix = self._try_text(msgs[:i], tools, False)
            lo = starts[-1] if starts else 0
            hi = next((first_content[j] for j in range(i, n) if first_content[j] is not None), len(real))
            if prefix is None:
                b = first_content[i] if i < n and first_content[i] is not None else lo
            else:
                b = snap(common_prefix(prefix, real), specials, special_starts)
                if b < len(prefix):
                    b = past_closing(prefix, real, b, hi, self._added_re)
            prev_end = max((e for e in last_content[:i] if e is not None), default=0)
            b = min(max(b, lo, prev_end), max(hi, lo))
            starts.append(snap(b, specials, special_starts))
        return starts

    def _boundaries_by_closers(
        self, msgs, tools, real, specials, first_content, last_content, bridging: bool = False
    ) -> list[int] | None:
        """Boundaries without prefix renders, where every message's text was found and in order: between
        the text of message i-1 and that of message i, message i starts after the first turn-closing token
        (and the whitespace after it), or right where message i-1's text ends when there is none (DeepSeek's
        user turns have no close). None when that does not apply: the caller renders prefixes instead."""
        n = len(msgs)
        firsts = [f for f in first_content if f is not None]
        lasts = [e for e in last_content if e is not None]
        if len(firsts) < n or len(lasts) < n or any(firsts[i] < lasts[i - 1] for i in range(1, n)):
            return None
        probe = self.probe
        added = self.tokenizer.added_tokens
        closer_ids = {added[t] for t in (*probe.stop_tokens, probe.history_close) if t}
        head = None if bridging else self._try_text([], tools, False)
        b0 = common_prefix(head, real) if head is not None else 0
        starts = [min(snap(b0, specials, {}), firsts[0])]
        ends = [*firsts[1:], len(real)]
        special_starts = [s for s, _, _ in specials]
        for i in range(1, n + 1):
            lo, hi = lasts[i - 1], ends[i - 1]
            b = lo
            k = bisect_left(special_starts, lo)
            while k < len(specials) and specials[k][1] <= hi:
                e, tid = specials[k][1], specials[k][2]
                k += 1
                if tid in closer_ids:
                    b = e
                    nxt = special_starts[k] if k < len(special_starts) else hi
                    gap = real[e : min(nxt, hi)]
                    if not gap.strip():
                        b = e + len(gap)
                    break
            starts.append(b)
        return starts

    def _try_text(self, msgs: list[dict], tools, agp: bool) -> str | None:
        try:
            return self._text(msgs, tools, agp)
        except TemplateRejected:
            return None

    def _assemble(self, msgs, real, specials, content, starts, start_at: int = 0) -> list[Piece]:
        """Pieces of ``real[start_at:]`` (``start_at`` must not fall inside a special token)."""
        n = len(msgs)
        cuts = {start_at, len(real)}
        for s, e, _ in specials:
            cuts.update((s, e))
        for s, e, _ in content:
            cuts.update((s, e))
        sampled: list[tuple[int, int]] = []
        if starts is not None:
            cuts.update(starts)
            sampled = self._sampled_spans(msgs, real, specials, starts)
            for s, e in sampled:
                cuts.update((s, e))
        order = sorted(c for c in cuts if start_at <= c <= len(real))
        special_at = {s: (e, tid) for s, e, tid in specials}
        content_starts = sorted(content)
        sampled_starts = [s for s, _ in sampled]  # disjoint, in order
        pieces: list[Piece] = []
        ci = 0
        open_content: list[tuple[int, int, int]] = []
        for a, b in zip(order, order[1:]):
            msg = -1
            if starts is not None:
                k = bisect_right(starts, a) - 1
                msg = k if 0 <= k < n else -1
            while ci < len(content_starts) and content_starts[ci][0] <= a:
                open_content.append(content_starts[ci])
                ci += 1
            if open_content:
                open_content = [c for c in open_content if c[1] > a]
            is_content = bool(open_content)
            if is_content:
                msg = open_content[-1][2]
            j = bisect_right(sampled_starts, a) - 1
            is_sampled = j >= 0 and a < sampled[j][1]
            if a in special_at and special_at[a][0] == b:
                pieces.append((special_at[a][1], msg, False, is_sampled))
            else:
                pieces.append((real[a:b], msg, is_content, is_sampled))
        return pieces

    def _sampled_spans(self, msgs, real, specials, starts) -> list[tuple[int, int]]:
        probe = self.probe
        header = probe.generation_prompt or ""
        stop_ids = set(self.stop_token_ids)
        if probe.history_close:  # gpt-oss closes earlier turns with <|end|>, which is no stop token
            stop_ids.add(self.tokenizer.added_tokens[probe.history_close])
        out = []
        special_starts = [s for s, _, _ in specials]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            a, b = starts[i], starts[i + 1]
            if a >= b:
                continue
            h = snap(a + common_prefix(header, real[a:b]), specials, {}) - a if header else 0
            lo, hi = bisect_left(special_starts, a), bisect_left(special_starts, b)
            ends = [e for _s, e, tid in specials[lo:hi] if e <= b and tid in stop_ids]
            end = ends[-1] if ends else b
            if a + h < end:
                out.append((a + h, end))
        return out

    # ---- parsing ----------------------------------------------------------------------------------

    def parse_response(self, completion_ids, prompt_ids=None, tools=None) -> ParsedResponse:
        """Parsed by the dialect the vocabulary's markers select (renderers/dialects: Harmony channels,
        DeepSeek, GLM, Kimi K2, MiniMax M2, ... down to ``<think>`` / ``<tool_call>`` scanning), with
        this template's stop ids; plain text up to a stop id when the vocabulary has no dialect's markers."""
        dialect = dialect_for(self.tokenizer)
        if dialect is not None:
            return dialect.parse(completion_ids, tools, prompt_ids=prompt_ids, stop_ids=self.stop_token_ids)
        return super().parse_response(completion_ids, prompt_ids, tools)


# ---- helpers -----------------------------------------------------------------------------------


def _tools(tools: Any) -> list[dict] | None:
    defs = normalize_tools(tools)
    return [] if defs is None and tools is not None else defs

