"""gpt-oss (Harmony): the official gpt-oss chat template, hand-coded.

A Harmony conversation is a sequence of messages ``<|start|>{header}<|message|>{body}{close}``:

- a system message the template writes itself (model identity, knowledge cutoff, today's date,
  ``Reasoning: low|medium|high``, the built-in tools, the valid channels);
- a developer message with the first system message's text as ``# Instructions`` and the function
  tools as a TypeScript-like ``namespace functions``;
- assistant messages on a channel: ``analysis`` (reasoning), ``final`` (the answer), or
  ``commentary`` addressed ``to=functions.NAME`` (a tool call, JSON body, closed by ``<|call|>``);
- tool results as messages from ``functions.NAME to=assistant``, their content JSON-encoded.

What the template does that matters for token identity (each mirrored below):

- the reasoning of an assistant message is its ``thinking`` field; tito's ``reasoning_content``
  (``reasoning``, ``thinking``) is that field;
- a final answer ends with ``<|return|>`` only when it is the last message of a conversation rendered
  without a generation prompt (training); elsewhere with ``<|end|>``, and its reasoning is dropped;
- the reasoning of a tool-call message is kept until a later final answer exists; a tool-call
  message's ``content`` is rendered as *analysis*; only its first tool call is rendered;
- a tool result names the function of the last tool call (reset by a final answer);
- system messages after the first are not rendered.

Parsing scans messages by token ids (:mod:`renderers.dialects.harmony`, the Harmony dialect this
renderer holds as ``grammar``); the bridge below extends the sampled tokens with the same scan.
"""

from __future__ import annotations

import datetime
from typing import Any

from .base import Renderer, TemplateRejected, bridged
from .dialects.harmony import FUNCTIONS_PREFIX, Harmony, HarmonyMessage
from .json_text import tojson
from .pieces import Pieces, PieceWriter
from .tokenizer import Tokenizer
from .types import Break, BreakReason, Bridged, ParsedResponse, ToolCallStatus

DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
BUILTIN_TOOLS = ("browser", "python")
BROWSER_TOOL = (
    "## browser\n\n"
    "// Tool for browsing.\n"
    "// The `cursor` appears in brackets before each browsing display: `[{cursor}]`.\n"
    "// Cite information from the tool using the following format:\n"
    "// `【{cursor}†L{line_start}(-L{line_end})?】`, for example: `【6†L9-L11】` or `【8†L3】`.\n"
    "// Do not quote more than 10 words directly from the tool output.\n"
    "// sources=web (default: web)\n"
    "namespace browser {\n\n"
    "// Searches for information related to `query` and displays `topn` results.\n"
    "type search = (_: {\n"
    "query: string,\n"
    "topn?: number, // default: 10\n"
    "source?: string,\n"
    "}) => any;\n\n"
    "// Opens the link `id` from the page indicated by `cursor` starting at line number `loc`, showing `num_lines` lines.\n"
    "// Valid link ids are displayed with the formatting: `【{id}†.*】`.\n"
    "// If `cursor` is not provided, the most recent page is implied.\n"
    "// If `id` is a string, it is treated as a fully qualified URL associated with `source`.\n"
    "// If `loc` is not provided, the viewport will be positioned at the beginning of the document or centered on the "
    "most relevant passage, if available.\n"
    "// Use this function without `id` to scroll to a new location of an opened page.\n"
    "type open = (_: {\n"
    "id?: number | string, // default: -1\n"
    "cursor?: number, // default: -1\n"
    "loc?: number, // default: -1\n"
    "num_lines?: number, // default: -1\n"
    "view_source?: boolean, // default: false\n"
    "source?: string,\n"
    "}) => any;\n\n"
    "// Finds exact matches of `pattern` in the current page, or the page given by `cursor`.\n"
    "type find = (_: {\n"
    "pattern: string,\n"
    "cursor?: number, // default: -1\n"
    "}) => any;\n\n"
    "} // namespace browser\n\n"
)
PYTHON_TOOL = (
    "## python\n\n"
    "Use this tool to execute Python code in your chain of thought. The code will not be shown to the user. This tool "
    "should be used for internal reasoning, but not for code that is intended to be visible to the user (e.g. when "
    "creating plots, tables, or files).\n\n"
    "When you send a message containing Python code to python, it will be executed in a stateful Jupyter notebook "
    "environment. python will respond with the output of the execution or time out after 120.0 seconds. The drive at "
    "'/mnt/data' can be used to save and persist user files. Internet access for this session is UNKNOWN. Depends on "
    "the cluster.\n\n"
)
CHANNELS_LINE = "# Valid channels: analysis, commentary, final. Channel must be included for every message."
FUNCTIONS_LINE = "\nCalls to these tools must go to the commentary channel: 'functions'."
# The template refuses message text that carries these headers (it wants analysis in `thinking`).
FORBIDDEN_IN_TEXT = ("<|channel|>analysis<|message|>", "<|channel|>final<|message|>")
# Whitespace the template's Jinja leaves in tool definitions: an unstripped `{{ ... }}` after a line break.
OBJECT_PROPERTY_INDENT = "\n" + " " * 16
ONEOF_DEFAULT_INDENT = " " * 20


# ---- Jinja semantics on JSON values -------------------------------------------------------------


class _Undefined:
    """Jinja's undefined: falsy, and an error when concatenated."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "Undefined"


UNDEFINED = _Undefined()


def attr(value: Any, key: str) -> Any:
    """``value.key`` in the template: a dict's entry, else undefined (no other JSON value has the
    attributes the template reads)."""
    return value.get(key, UNDEFINED) if isinstance(value, dict) else UNDEFINED


def concat(what: str, *parts: Any) -> str:
    """The template's ``a + b``: an undefined or non-string part is a render error there."""
    for part in parts:
        if part is UNDEFINED:
            raise TemplateRejected(f"the gpt-oss template concatenates {what}, which is missing")
        if not isinstance(part, str):
            raise TemplateRejected(
                f"the gpt-oss template concatenates {what}, which is a {type(part).__name__}, not text"
            )
    return "".join(parts)


def _contains(container: Any, item: str, what: str) -> bool:
    try:
        return item in container
    except TypeError:
        raise TemplateRejected(
            f"the gpt-oss template tests membership in {what}, a {type(container).__name__}"
        ) from None


def _iterate(value: Any, what: str) -> list:
    if isinstance(value, (list, tuple, str)):
        return list(value)
    if isinstance(value, dict):
        return list(value)
    raise TemplateRejected(f"the gpt-oss template iterates over {what}, a {type(value).__name__}")


def _properties(value: Any, what: str) -> list[tuple[Any, Any]]:
    if not isinstance(value, dict):
        raise TemplateRejected(f"the gpt-oss template calls .items() on {what}, a {type(value).__name__}")
    return list(value.items())


# ---- tool definitions as TypeScript ------------------------------------------------------------


def typescript_type(spec: Any) -> str:
    """The template's ``render_typescript_type`` macro: a JSON schema as a TypeScript type."""
    kind = attr(spec, "type")
    nullable = " | null" if attr(spec, "nullable") else ""
    if kind == "array":
        # a dict without "items" gives the template its bound .items method (truthy, no 'type'): "any[]" either way
        items = spec.get("items")
        if not items:
            return "any[]" + nullable
        item_kind = attr(items, "type")
        if item_kind == "string":
            return "string[]" + nullable
        if item_kind == "number" or item_kind == "integer":
            return "number[]" + nullable
        if item_kind == "boolean":
            return "boolean[]" + nullable
        inner = typescript_type(items)
        return ("any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]") + nullable
    if isinstance(kind, (list, tuple)) and kind:  # a union of types: ["string", "null"]
        return " | ".join(_jinja_str(k) for k in kind) if len(kind) > 1 else _jinja_str(kind[0])
    one_of = attr(spec, "oneOf")
    if one_of:
        # The template sets has_object_variants inside a for loop; Jinja scoping discards the assignment,
        # so its "any" shortcut is never taken and every variant is rendered.
        variants = _iterate(one_of, "a oneOf")
        out = ""
        for j, variant in enumerate(variants):
            out += typescript_type(variant)
            description = attr(variant, "description")
            if description:
                out += concat("a oneOf variant's description", "// ", description)
            default = attr(variant, "default")
            if default is not UNDEFINED:
                out += ONEOF_DEFAULT_INDENT + "// default: " + tojson(default)
            if j < len(variants) - 1:
                out += " | \n"
        return out
    if kind == "string":
        enum = attr(spec, "enum")
        if enum:
            return '"' + '" | "'.join(_jinja_str(e) for e in _iterate(enum, "an enum")) + '"'
        return "string" + nullable
    if kind == "number" or kind == "integer":
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "object":
        properties = attr(spec, "properties")
        if not properties:
            return "object"
        required = attr(spec, "required") or []
        fields = []
        for name, prop in _properties(properties, "an object's properties"):
            optional = "" if _contains(required, name, "required") else "?"
            fields.append(f"{_jinja_str(name)}{optional}: {OBJECT_PROPERTY_INDENT}{typescript_type(prop)}")
        return "{\n" + ", ".join(fields) + "}"
    return "any"


def _jinja_str(value: Any) -> str:
    """How Jinja prints a value (Python's ``str``: ``None``, ``True``)."""
    return value if isinstance(value, str) else str(value)


def functions_namespace(tools: list[dict]) -> str:
    """The template's ``render_tool_namespace("functions", tools)``."""
    out = "## functions\n\nnamespace functions {\n\n"
    for k, tool in enumerate(tools):
        fn = attr(tool, "function")
        where = f"tools[{k}]"
        if fn is UNDEFINED:
            raise TemplateRejected(
                f"{where}: the gpt-oss template reads tool.function, and this tool has none (flat form)"
            )
        out += concat(f"{where}'s description", "// ", attr(fn, "description"), "\n")
        out += concat(f"{where}'s name", "type ", attr(fn, "name"), " = ")
        parameters = attr(fn, "parameters")
        if not (parameters and attr(parameters, "properties")):
            out += "() => any;\n\n"
            continue
        required = attr(parameters, "required") or []
        out += "(_: {\n"
        for name, spec in _properties(parameters["properties"], f"{where}'s parameters.properties"):
            description = attr(spec, "description")
            if description:
                out += concat(f"{where} parameter {name!r}'s description", "// ", description, "\n")
            out += _jinja_str(name) + ("" if _contains(required, name, f"{where}'s required") else "?") + ": "
            out += typescript_type(spec)
            default = attr(spec, "default")
            if default is not UNDEFINED:
                if attr(spec, "enum"):
                    out += concat(f"{where} parameter {name!r}'s enum default", ", // default: ", default)
                elif attr(spec, "oneOf"):
                    out += concat(f"{where} parameter {name!r}'s oneOf default", "// default: ", default)
                else:
                    out += ", // default: " + tojson(default)
            out += ",\n"
        out += "}) => any;\n\n"
    return out + "} // namespace functions"


# ---- the renderer ------------------------------------------------------------------------------


class HarmonyRenderer(Renderer):
    """gpt-oss-20b / gpt-oss-120b (the Hugging Face chat template, Harmony format).

    Template kwargs: ``reasoning_effort`` (low / medium / high; default medium; other
    :data:`renderers.base.EFFORT_LEVELS` move to the nearest), ``model_identity`` (the system
    message's first line), ``builtin_tools`` (a list of "browser" and/or "python").

    The template prints ``strftime_now("%Y-%m-%d")``: the renderer reads the date once, at
    construction, into ``current_date`` (a string; set it to render another date), so that the
    tokens of a rollout do not change at midnight.

    Stop ids: ``<|call|>`` (a tool call) and ``<|return|>`` (a final answer). ``<|end|>`` is not a
    stop: it closes a message after which the model goes on (analysis, then a tool call or the
    final answer), so one completion can hold several messages. ``turn_close`` is ``<|call|>``:
    the turns the template re-renders exactly as sampled are tool calls.
    """

    name = "gpt-oss"
    template_hashes = ("a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",)
    template_kwargs_allowed = {"reasoning_effort": str, "model_identity": str, "builtin_tools": list}
    reasoning_efforts = ("low", "medium", "high")
    supports_tools = True
    turn_close = "<|call|>"
    extra_stop_tokens = ("<|return|>",)

    def __init__(self, tokenizer: Tokenizer, *, thinking_retention: str = "keep", **template_kwargs: Any) -> None:
        super().__init__(tokenizer, thinking_retention=thinking_retention, **template_kwargs)
        self.current_date = datetime.datetime.now().strftime("%Y-%m-%d")
        self.grammar = Harmony(tokenizer)  # the message scan that parsing and the bridge share

    def check_template_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        out = super().check_template_kwargs(kwargs)
        for tool in out.get("builtin_tools", ()):
            if tool not in BUILTIN_TOOLS:
                raise ValueError(f"builtin_tools may hold {' and '.join(map(repr, BUILTIN_TOOLS))}; got {tool!r}")
        return out

    # ---- system and developer messages ---------------------------------------------------------

    def _system_message(self, p: PieceWriter, tools: list[dict] | None) -> None:
        kw = self.template_kwargs
        text = (
            kw.get("model_identity", DEFAULT_IDENTITY) + "\n"
            "Knowledge cutoff: 2024-06\n"
            f"Current date: {self.current_date}\n\n"
            f"Reasoning: {kw.get('reasoning_effort', 'medium')}\n\n"
        )
        builtin = kw.get("builtin_tools")
        if builtin:
            text += "# Tools\n\n"
            text += BROWSER_TOOL if "browser" in builtin else ""
            text += PYTHON_TOOL if "python" in builtin else ""
        text += CHANNELS_LINE + (FUNCTIONS_LINE if tools else "")
        p.scaffold("<|start|>system<|message|>" + text + "<|end|>")

    def _developer_message(self, p: PieceWriter, msgs: list[dict], tools: list[dict] | None) -> None:
        has_system = msgs[0]["role"] == "system"
        instructions = msgs[0]["content"] if has_system else ""
        if not (instructions or tools):
            return
        owner = 0 if has_system else -1
        p.special("<|start|>", owner)
        p.scaffold("developer", owner)
        p.special("<|message|>", owner)
        if instructions:
            p.scaffold("# Instructions\n\n", owner)
            p.text(instructions, 0)
            p.scaffold("\n\n", owner)
        if tools:
            # tool definitions are message-like text: never matched as added tokens
            p.text("# Tools\n\n" + functions_namespace(tools), -1, content=False)
        p.special("<|end|>", owner)

    # ---- conversation messages -----------------------------------------------------------------

    def _render(self, p, msgs, tools, add_generation_prompt):
        self._system_message(p, tools)
        self._developer_message(p, msgs, tools)
        start = 1 if msgs[0]["role"] == "system" else 0
        self._messages(p, msgs, start, None, last_is_training=not add_generation_prompt)
        if add_generation_prompt:
            self._generation_prompt(p)

    def _generation_prompt(self, p: PieceWriter) -> None:
        p.special("<|start|>")
        p.scaffold("assistant")

    def _messages(
        self, p: PieceWriter, msgs: list[dict], start: int, last_call: str | None, *, last_is_training: bool
    ) -> str | None:
        """Messages ``start..`` (the template's loop_messages); returns the last tool call's name."""
        for i in range(start, len(msgs)):
            m = msgs[i]
            role = m["role"]
            if role == "assistant":
                last = i == len(msgs) - 1 and last_is_training
                future_final = any(n["role"] == "assistant" and "tool_calls" not in n for n in msgs[i + 1 :])
                last_call = self._assistant(p, m, i, last, future_final, last_call)
            elif role == "tool":
                if last_call is None:
                    raise TemplateRejected(
                        f"message {i}: a tool message needs an earlier assistant tool call (the gpt-oss template "
                        "names a tool result after the last call, and a final answer in between resets it)"
                    )
                self._tool_result(p, m, i, last_call)
            elif role == "user":
                p.wrapped("<|start|>user<|message|>", m["content"], "<|end|>", i)
            # a system message after the first is not rendered by the template
        return last_call

    def _assistant(
        self, p: PieceWriter, m: dict, i: int, last: bool, future_final: bool, last_call: str | None
    ) -> str | None:
        """One assistant message; returns the template's ``last_tool_call.name`` after it."""
        content = m.get("content")  # None: undefined in the template
        thinking = m.get("reasoning_content")
        for field, text in (("content", content), ("reasoning", thinking)):
            if text is not None and any(h in text for h in FORBIDDEN_IN_TEXT):
                raise TemplateRejected(
                    f"message {i}: the gpt-oss template rejects <|channel|> headers in the {field}; pass analysis "
                    "as reasoning_content and the answer as content"
                )
        p.scaffold("<|start|>assistant", i)
        if "tool_calls" in m:
            if content and thinking:
                raise TemplateRejected(
                    f"message {i}: the gpt-oss template rejects an assistant tool call with both content and reasoning"
                )
            analysis = content or thinking
            if analysis and not future_final:  # dropped once a later final answer exists
                self._analysis(p, analysis, i)
            call = m["tool_calls"][0]["function"]  # the template renders the first call only
            p.scaffold(" to=functions.", i, sampled=True)
            p.text(call["name"], i, sampled=True)
            p.scaffold("<|channel|>commentary json<|message|>", i, sampled=True)
            p.text(tojson(call["arguments"]), i, sampled=True)
            p.special("<|call|>", i, sampled=True)
            return call["name"]
        if last and thinking:  # only the last turn of a training render keeps its reasoning
            self._analysis(p, thinking, i)
        p.scaffold("<|channel|>final<|message|>", i, sampled=True)
        p.text(concat(f"message {i}'s content (an assistant message without tool calls)", content), i, sampled=True)
        p.special("<|return|>" if last else "<|end|>", i, sampled=True)
        return last_call if last else None

    def _analysis(self, p: PieceWriter, text: str, i: int) -> None:
        """An analysis message, then the next message's ``<|start|>assistant`` (both sampled: the
        model writes them after the generation prompt)."""
        p.wrapped("<|channel|>analysis<|message|>", text, "<|end|><|start|>assistant", i, sampled=True)

    def _tool_result(self, p: PieceWriter, m: dict, i: int, function: str) -> None:
        p.scaffold("<|start|>functions.", i)
        p.text(function, i, content=False)
        p.wrapped(" to=assistant<|channel|>commentary<|message|>", tojson(m["content"]), "<|end|>", i)

    # ---- parse_response ------------------------------------------------------------------------

    def parse_response(
        self, completion_ids: list[int], prompt_ids: list[int] | None = None, tools: Any = None
    ) -> ParsedResponse:
        """As :meth:`renderers.dialects.harmony.Harmony.parse_response`."""
        return self.grammar.parse_response(completion_ids, prompt_ids, tools)

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
        tail = self.grammar.open_tail(prev_prompt_ids)
        messages, _, _ = self.grammar.scan_messages(tail + completion)
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
        try:  # the new messages, a tool result named after this completion's call (passed, not kept)
            self._messages(p, msgs, 0, name, last_is_training=False)
        except ValueError as exc:
            return Break(BreakReason.TEMPLATE_ERROR, str(exc), prefix_len)
        self._generation_prompt(p)
        return bridged(prev_prompt_ids, completion, closing, p.encode())

    def _closing(self, messages: list[HarmonyMessage], tail: list[int], completion: list[int]) -> list[int]:
        """The close to synthesize after a completion that did not end on one (nothing when the last
        message is closed)."""
        if completion and completion[-1] in self.grammar.close_ids:
            return []
        if not messages or messages[-1].close is not None:
            return []
        open_message = messages[-1]
        return [self.grammar.call_id if self.grammar.header(open_message).recipient else self.grammar.end_id]

    def _call_name(
        self, messages: list[HarmonyMessage], tail: list[int], completion: list[int]
    ) -> tuple[str | None, str]:
        """The function the completion called (its last tool call), or None and why not."""
        for m in reversed(messages):
            if m.end <= len(tail):
                break
            head = self.grammar.header(m)
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
        tail = self.grammar.open_tail(prompt_ids)
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
            if self.grammar.return_id in sampled:
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
            if prompt_ids[pos] != self.grammar.channel_id:
                continue
            channel = decode(prompt_ids[pos + 1 : pos + 3]).lstrip()
            if channel.startswith("final"):
                break
            if channel.startswith("analysis"):
                found = pos
        return found
