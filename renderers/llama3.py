"""Llama 3.1 / 3.2 / 3.3: header-delimited turns closed by ``<|eot_id|>`` (or ``<|eom_id|>``).

Meta's templates (3.3 ships 3.1's template byte for byte) put a dated system header first, the tool
definitions in the first user turn (or the system turn with ``tools_in_user_message=False``), a
single JSON tool call per assistant turn (``{"name": ..., "parameters": ...}``; the format has no
tool-call tokens), builtin tool calls as ``<|python_tag|>name.call(k="v")`` closed by ``<|eom_id|>``
(3.1 with ``builtin_tools``), and tool results under the ``ipython`` role, JSON-encoded.

Llama-3.3-Nemotron-Super, another format on the same vocabulary, is in llama3_nemotron.py.

Each method mirrors a branch of its template, including Jinja's treatment of a missing content
(``undefined|trim`` is empty) and the errors the template raises.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from .base import Renderer, TemplateRejected
from .dialects.json_calls import parse_json_call
from .dialects.llama3_json import JSON_CALL_START, python_tag_call
from .json_text import tojson
from .messages import MessageError, normalize_tools, tool_names
from .pieces import Pieces, PieceWriter
from .tokenizer import Tokenizer
from .types import Break, BreakReason, ParsedResponse, ToolCall, ToolCallStatus

HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"
SYSTEM_TOOLS_INTRO = (
    "You have access to the following functions. To call a function, please respond with JSON for a function call."
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)
USER_TOOLS_INTRO = (
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    "Do not use variables.\n\n"
)


class LlamaHeaders(Renderer):
    """What every template of this vocabulary shares: header turns, ``<|eot_id|>``, stop ids."""

    turn_close = "<|eot_id|>"
    extra_stop_tokens = ("<|eom_id|>", "<|end_of_text|>")

    def _header(self, p: PieceWriter, role: str, i: int) -> None:
        p.scaffold(HEADER.format(role), i)


class Llama31Renderer(LlamaHeaders):
    """Llama 3.1 and 3.3 (one template): ``date_string``, ``tools_in_user_message``, ``custom_tools``
    and ``builtin_tools`` (ipython mode: ``<|python_tag|>`` builtin calls, every tool call closed by
    ``<|eom_id|>``)."""

    name = "llama3.1"
    template_hashes = ("e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",)
    template_kwargs_allowed = {
        "date_string": str,
        "tools_in_user_message": bool,
        "custom_tools": list,
        "builtin_tools": list,
    }
    default_date = "26 Jul 2024"  # the template's fallback when date_string is not given
    has_builtin_tools = True
    # transformers hands tools=[] to the template as an empty list, which this template renders unlike
    # none (an "Environment: ipython" header and an empty tool preamble)
    renders_empty_tools = True

    def __init__(self, tokenizer: Tokenizer, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self.eot_id = self.turn_close_id
        self.eom_id = tokenizer.token_id("<|eom_id|>")
        self.python_tag_id = tokenizer.token_id("<|python_tag|>")

    def check_template_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        out = super().check_template_kwargs(kwargs)
        if "builtin_tools" in out and not all(isinstance(t, str) for t in out["builtin_tools"]):
            raise ValueError("template kwarg 'builtin_tools' must be a list of tool names (strings)")
        if "custom_tools" in out:
            try:
                out["custom_tools"] = normalize_tools(out["custom_tools"]) or []
            except MessageError as exc:
                raise ValueError(f"template kwarg 'custom_tools': {exc}") from None
        return out

    # ---- rendering -------------------------------------------------------------------------------

    @property
    def _builtin(self) -> list[str] | None:
        """``builtin_tools`` when given (the template tests ``is defined``); never for Llama 3.2."""
        return self.template_kwargs.get("builtin_tools") if self.has_builtin_tools else None

    def _render(self, p, msgs, tools, add_generation_prompt):
        kw = self.template_kwargs
        if "custom_tools" in kw:
            tools = kw["custom_tools"]
        in_user = kw.get("tools_in_user_message", True)
        builtin = self._builtin
        start, owner = 0, -1
        system_text = ""
        if msgs[0]["role"] == "system":
            start, owner = 1, 0
            system_text = msgs[0]["content"].strip()
        p.scaffold("<|begin_of_text|>")
        self._header(p, "system", owner)
        if builtin is not None or tools is not None:
            p.scaffold("Environment: ipython\n")
        if builtin is not None:
            p.scaffold("Tools: " + ", ".join(t for t in builtin if t != "code_interpreter") + "\n\n")
        p.scaffold(
            "Cutting Knowledge Date: December 2023\nToday Date: " + kw.get("date_string", self.default_date) + "\n\n"
        )
        if tools is not None and not in_user:
            p.scaffold(SYSTEM_TOOLS_INTRO)
            self._tool_definitions(p, tools)
        p.text(system_text, owner)
        p.special("<|eot_id|>", owner)
        if tools is not None and in_user:
            if start == len(msgs):
                raise TemplateRejected("Cannot put tools in the first user message when there's no first user message!")
            # the template takes whatever message comes first (even an assistant's) as the user turn, content only
            self._header(p, "user", start)
            p.scaffold(USER_TOOLS_INTRO)
            self._tool_definitions(p, tools)
            p.text(msgs[start].get("content", "").strip(), start)
            p.special("<|eot_id|>", start)
            start += 1
        for i in range(start, len(msgs)):
            self._message(p, msgs, i)
        if add_generation_prompt:
            self._header(p, "assistant", -1)

    def _tool_definitions(self, p: PieceWriter, tools: list[dict]) -> None:
        for tool in tools:
            p.text(tojson(tool, indent=4), -1, content=False)
            p.scaffold("\n\n")

    def _message(self, p: PieceWriter, msgs: list[dict], i: int) -> None:
        m = msgs[i]
        role = m["role"]
        if role == "tool":  # a string is `iterable` to Jinja: the template JSON-encodes it
            p.wrapped(HEADER.format("ipython"), tojson(m["content"]), "<|eot_id|>", i)
        elif "tool_calls" in m:
            self._tool_call_turn(p, m, i)
        elif role == "assistant":
            self._header(p, role, i)
            p.text(m.get("content", "").strip(), i, sampled=True)  # undefined|trim is ""
            p.special("<|eot_id|>", i, sampled=True)
        else:
            p.wrapped(HEADER.format(role), m.get("content", "").strip(), "<|eot_id|>", i)

    def _tool_call_turn(self, p: PieceWriter, m: dict, i: int) -> None:
        if len(m["tool_calls"]) != 1:
            raise TemplateRejected(f"message {i}: This model only supports single tool-calls at once!")
        call = m["tool_calls"][0]["function"]
        name, args = call["name"], call["arguments"]
        builtin = self._builtin
        self._header(p, "assistant", i)
        if builtin is not None and name in builtin:
            if not isinstance(args, dict):
                raise TemplateRejected(
                    f"message {i}: a builtin tool call needs arguments as an object (`items` filter)"
                )
            p.special("<|python_tag|>", i, sampled=True)
            p.text(name, i, sampled=True)
            p.scaffold(".call(", i, sampled=True)
            for j, (key, value) in enumerate(args.items()):
                if not isinstance(value, str):
                    raise TemplateRejected(
                        f"message {i}: builtin tool call argument {key!r} must be a string "
                        "(the template concatenates it)"
                    )
                p.text(key, i, sampled=True)
                p.scaffold('="', i, sampled=True)
                p.text(value, i, sampled=True)
                p.scaffold('", ' if j < len(args) - 1 else '"', i, sampled=True)
            p.scaffold(")", i, sampled=True)
        else:
            p.scaffold('{"name": "', i, sampled=True)
            p.text(name, i, sampled=True)
            p.scaffold('", "parameters": ', i, sampled=True)
            p.text(tojson(args), i, sampled=True)
            p.scaffold("}", i, sampled=True)
        p.special("<|eom_id|>" if builtin is not None else "<|eot_id|>", i, sampled=True)

    def _continue(self, p, msgs, tools, prompt_ids, completion):
        for i in range(len(msgs)):
            self._message(p, msgs, i)
        self._header(p, "assistant", -1)

    # ---- bridging --------------------------------------------------------------------------------

    def _turn_close_for(self, completion: list[int]) -> int:
        # In ipython mode the template closes a tool-call turn with <|eom_id|>, and a model may stop on it.
        return self._close_for(completion)

    def _family_break(self, prompt_ids, completion, msgs):
        """Under ``thinking_retention="template"``: a Break when the template would re-render this reply
        otherwise than sampled. It re-renders a reply from its parsed message: content trimmed, a tool
        call re-serialized, the template's close; any difference (whitespace at either end, another
        spelling of the JSON, a non-canonical token split, another stop id) rewrites history."""
        if self.thinking_retention != "template":
            return None
        sampled = (
            completion
            if completion and completion[-1] in self.stop_token_ids
            else [*completion, self._close_for(completion)]
        )
        parsed = self.parse_response(sampled)  # with the close the bridge synthesizes for a truncated reply
        at = len(prompt_ids)
        if any(c.status is not ToolCallStatus.OK for c in parsed.tool_calls):
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY, "the template cannot re-render a malformed tool call", at
            )
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:  # arguments as parsed (an object): the spelling the template re-renders
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.tool_calls
            ]
        p = Pieces(self.tokenizer)
        try:
            self._message(p, [message], 0)
        except TemplateRejected as exc:
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY, f"the template would not re-render this reply: {exc}", at
            )
        rendered = p.encode().token_ids
        header = self.tokenizer.encode(HEADER.format("assistant"))
        if rendered[: len(header)] != header or rendered[len(header) :] != sampled:
            tail = rendered[len(header) :]
            diff = next(
                (i for i, (a, b) in enumerate(zip(tail, sampled, strict=False)) if a != b), min(len(tail), len(sampled))
            )
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY,
                "the template re-renders this reply from its parsed message (content trimmed, the tool call "
                "re-serialized, its own close), which differs from the sampled tokens",
                at + diff,
            )
        return None

    def _close_for(self, completion: list[int]) -> int:
        """The token closing this assistant turn: the sampled one, else the template's (``<|eom_id|>`` for a
        tool call in ipython mode, else ``<|eot_id|>``)."""
        if completion and completion[-1] in (self.eot_id, self.eom_id):
            return completion[-1]
        if self._builtin is not None and self.parse_response(completion).tool_calls:
            return self.eom_id
        return self.eot_id

    # ---- parsing ---------------------------------------------------------------------------------

    def parse_response(self, completion_ids, prompt_ids=None, tools=None) -> ParsedResponse:
        """Content, and at most one tool call: ``<|python_tag|>`` and what follows it up to the stop (a
        JSON call, a builtin ``name.call(k="v")`` or, as Meta's format has it, code for
        ``code_interpreter``), or a content that is one JSON object whose first key is ``"name"``."""
        names = tool_names(normalize_tools(tools))
        ids = list(completion_ids)
        end, stop = len(ids), None
        for i, tid in enumerate(ids):
            if tid in self.stop_token_ids:
                end, stop = i, tid
                break
        call_end = end + 1 if stop is not None else end  # a call's span covers its closing stop token
        decode = self.tokenizer.decode
        calls: list[ToolCall] = []
        if self.python_tag_id in ids[:end]:
            k = ids.index(self.python_tag_id)
            content = decode(ids[:k]).strip()
            calls.append(python_tag_call(decode(ids[k + 1 : end]), (k, call_end), names))
        else:
            content = decode(ids[:end])
            if JSON_CALL_START.match(content):
                calls.append(parse_json_call(content, (0, call_end), names))
                content = ""
            content = content.strip()
        if calls and stop is None:
            calls[0].status, calls[0].error = ToolCallStatus.UNCLOSED, "the completion ended inside this tool call"
        return ParsedResponse(
            content=content, reasoning_content=None, tool_calls=calls, reasoning_complete=None, stop_token_id=stop
        )


class Llama32Renderer(Llama31Renderer):
    """Llama 3.2: 3.1's template without builtin tools; today's date (``strftime_now``) unless
    ``date_string`` is given, read once when the renderer is built so that renders are stable."""

    name = "llama3.2"
    template_hashes = ("5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",)
    template_kwargs_allowed = {"date_string": str, "tools_in_user_message": bool, "custom_tools": list}
    has_builtin_tools = False

    def __init__(self, tokenizer: Tokenizer, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self.default_date = datetime.now().strftime("%d %b %Y")  # the template's strftime_now("%d %b %Y")
