"""Qwen3-Coder: ChatML turns, tool definitions as XML-ish ``<tools><function><name>...`` blocks, and XML tool
calls (``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``).

The template renders a string argument verbatim, a dict or list with ``tojson`` and any other value with
Python's ``str`` (``True``, ``None``, ``1e+20``), so the text of a call does not say which type a value
had: ``parse_response`` coerces each value back with the JSON schema of the tools it is given
(see :func:`coerce_arguments`). The structure is found by token ids (``<tool_call>``/``</tool_call>``
are added tokens); inside a call the XML tags are ordinary text, so the call body is decoded and read
with exactly the whitespace rules the template emits (:func:`parse_xml_call`).

Each rendering method mirrors a branch of the official template, including how Jinja treats a
missing value (undefined: empty when printed, an error when concatenated).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .base import TemplateRejected
from .json_text import tojson
from .messages import normalize_messages, normalize_tools
from .pieces import Pieces, PieceWriter
from .qwen import _QwenBase
from .types import Break, BreakReason, Bridged, ParsedResponse, ToolCall, ToolCallStatus

DEFAULT_SYSTEM = "You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks."
TOOLS_INTRO = "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_OUTRO = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>"
)


def jinja_str(value: Any) -> str:
    """Jinja's ``|string`` and ``~``: Python's ``str`` (so ``True``, ``None``, ``['a', 'b']``)."""
    return value if isinstance(value, str) else str(value)


def argument_text(value: Any) -> str:
    """How the template prints one tool-call argument: dicts and lists through ``tojson``, strings
    verbatim, anything else through ``|string``."""
    if isinstance(value, (dict, list, tuple)):
        return tojson(value)
    return jinja_str(value)


def _arguments_mapping(call: dict, i: int, j: int) -> dict:
    """The call's arguments as the dict the template iterates.

    A JSON string holding an object is decoded (as vLLM does before applying this template): the
    template's ``arguments|items`` only accepts a mapping, and OpenAI clients, like
    ``ParsedResponse.to_message``, send arguments as JSON strings. Any other string is rejected, as
    transformers fails on it."""
    args = call["function"]["arguments"]
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict):
            raise TemplateRejected(
                f"message {i}: tool_calls[{j}].arguments is a string that is not a JSON object; the qwen3-coder "
                "template iterates the arguments as a mapping"
            )
        return decoded
    return args


class Qwen3CoderRenderer(_QwenBase):
    """Qwen3-Coder (tools as XML definitions, XML tool calls; no reasoning in the template).

    ``think_tokens`` are set so that ``parse_response`` splits off reasoning a model samples with the
    vocabulary's ``<think>``/``</think>`` ids (templates of the same call format, Qwen3.5 and
    Nemotron-3-Nano, think); the template itself never renders reasoning.
    """

    name = "qwen3-coder"
    template_hashes = ("5a38bfa05833266240066aedc497decc9b00cc0d3e3b8cceea98cf530196ab06",)
    think_tokens = ("<think>", "</think>")

    # ---- rendering -------------------------------------------------------------------------------

    def _render(self, p, msgs, tools, add_generation_prompt):
        has_system = msgs[0]["role"] == "system"
        if has_system or tools:
            owner = 0 if has_system else -1
            p.special("<|im_start|>", owner)
            p.scaffold("system\n", owner)
            if has_system:
                p.text(msgs[0]["content"], 0)
            else:
                p.scaffold(DEFAULT_SYSTEM)
            if tools:
                self._tool_definitions(p, tools)
            p.special("<|im_end|>", owner)
            p.scaffold("\n", owner)
        self._messages(p, msgs, prev_role=None, first_is_skipped_system=has_system)
        if add_generation_prompt:
            self._generation_prompt(p)

    def _tool_definitions(self, p: PieceWriter, tools: list[dict]) -> None:
        def text(value: Any) -> None:  # text from the tool definitions: never an added token
            p.text(jinja_str(value), -1, content=False)

        def extra_keys(schema: Any, handled: tuple[str, ...]) -> None:  # the template's render_extra_keys
            if not isinstance(schema, dict):
                return
            for key, value in schema.items():
                if key in handled:
                    continue
                p.scaffold("\n<")
                text(key)
                p.scaffold(">")
                text(tojson(value) if isinstance(value, (dict, list, tuple)) else value)
                p.scaffold("</")
                text(key)
                p.scaffold(">")

        p.scaffold(TOOLS_INTRO)
        for tool in tools:
            fn = tool["function"] if "function" in tool else tool
            p.scaffold("\n<function>\n<name>")
            text(fn["name"])
            p.scaffold("</name>")
            if "description" in fn:
                p.scaffold("\n<description>")
                text(jinja_str(fn["description"]).strip())
                p.scaffold("</description>")
            p.scaffold("\n<parameters>")
            params = fn.get("parameters")
            if isinstance(params, dict) and isinstance(params.get("properties"), dict):
                for param_name, fields in params["properties"].items():
                    p.scaffold("\n<parameter>\n<name>")
                    text(param_name)
                    p.scaffold("</name>")
                    if isinstance(fields, dict) and "type" in fields:
                        p.scaffold("\n<type>")
                        text(fields["type"])
                        p.scaffold("</type>")
                    if isinstance(fields, dict) and "description" in fields:
                        p.scaffold("\n<description>")
                        text(jinja_str(fields["description"]).strip())
                        p.scaffold("</description>")
                    extra_keys(fields, ("name", "type", "description"))
                    p.scaffold("\n</parameter>")
            extra_keys(params, ("type", "properties"))
            p.scaffold("\n</parameters>")
            extra_keys(fn, ("type", "name", "description", "parameters"))
            p.scaffold("\n</function>")
        p.scaffold(TOOLS_OUTRO)

    def _messages(self, p: PieceWriter, msgs: list[dict], prev_role: str | None, first_is_skipped_system: bool) -> None:
        """The template's loop. ``prev_role`` is the role of the loop's previous item, None when the
        first message is the loop's first item (then a tool result gets no ``<|im_start|>user`` header)."""
        start = 1 if first_is_skipped_system else 0
        for i in range(start, len(msgs)):
            m = msgs[i]
            role = m["role"]
            if role == "assistant" and m.get("tool_calls"):
                self._assistant_tool_calls(p, m, i)
            elif role == "tool":
                self._tool_result(p, msgs, i, prev_role)
            else:
                self._plain_turn(p, m, i)  # rejects a missing content, as the template's concatenation does
            prev_role = role

    def _assistant_tool_calls(self, p: PieceWriter, m: dict, i: int) -> None:
        p.special("<|im_start|>", i)
        p.scaffold("assistant\n", i)  # this "\n" is the generation prompt's: the model samples what follows
        content = m.get("content", "").strip()
        if content:
            p.text(content, i, sampled=True)
            p.scaffold("\n", i, sampled=True)
        for j, call in enumerate(m["tool_calls"]):
            args = _arguments_mapping(call, i, j)
            p.scaffold("\n<tool_call>\n<function=" if j > 0 or content else "<tool_call>\n<function=", i, sampled=True)
            p.text(call["function"]["name"], i, sampled=True)
            p.scaffold(">\n", i, sampled=True)
            for key, value in args.items():
                p.scaffold("<parameter=", i, sampled=True)
                p.text(jinja_str(key), i, sampled=True)
                p.scaffold(">\n", i, sampled=True)
                p.text(argument_text(value), i, sampled=True)
                p.scaffold("\n</parameter>\n", i, sampled=True)
            p.scaffold("</function>\n</tool_call>", i, sampled=True)
        p.special("<|im_end|>", i, sampled=True)
        p.scaffold("\n", i)

    def _tool_result(self, p: PieceWriter, msgs: list[dict], i: int, prev_role: str | None) -> None:
        if prev_role is not None and prev_role != "tool":
            p.special("<|im_start|>", i)
            p.scaffold("user\n", i)
        p.special("<tool_response>", i)
        p.scaffold("\n", i)
        p.text(msgs[i].get("content", ""), i)
        p.scaffold("\n", i)
        p.special("</tool_response>", i)
        p.scaffold("\n", i)
        if i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool":
            p.special("<|im_end|>", i)
            p.scaffold("\n", i)

    def _family_break(self, prompt_ids, completion, msgs):
        # The template never renders reasoning: a think block the model sampled would vanish from a
        # re-render. "keep" extends what the model saw; "template" asks for the re-render.
        if self.thinking_retention != "template" or not any(t in self.think_ids for t in completion):
            return None
        position = len(prompt_ids) + next(i for i, t in enumerate(completion) if t in self.think_ids)
        return Break(
            BreakReason.TEMPLATE_REWRITES_HISTORY,
            "the qwen3-coder template drops reasoning: a re-render would remove this turn's think block",
            position=position,
        )

    def _bridge(self, prev_prompt_ids, prev_completion_ids, new_messages, tools):
        # Overridden because _family_break does not see the tools, and which turns the template would
        # rewrite depends on them (an argument's printed form comes from its schema-typed value).
        result = super()._bridge(prev_prompt_ids, prev_completion_ids, new_messages, tools)
        if isinstance(result, Bridged) and self.thinking_retention == "template":
            return self._rewrite_break(prev_prompt_ids, prev_completion_ids, tools) or result
        return result

    def _rewrite_break(self, prompt_ids: list[int], completion: list[int], tools: Any) -> Break | None:
        """``thinking_retention="template"``: a Break when re-rendering the parsed turn (what a caller
        re-renders: ``parse_response(...).to_message()``) would not give back the sampled tokens.

        The template re-renders a turn from the message, not from its tokens: content trimmed, every
        argument printed from its typed value (a boolean the model wrote ``true`` comes back ``True``),
        malformed calls gone, ``<|im_end|>`` as the close. Costs one parse and one render of this turn."""
        try:
            message = normalize_messages([self.parse_response(completion, prompt_ids, tools).to_message()])[0]
            p = Pieces(self.tokenizer)
            self._generation_prompt(p)
            head = len(p.encode().token_ids)  # the turn's header, which the prompt holds
            p = Pieces(self.tokenizer)
            self._messages(p, [message], prev_role="user", first_is_skipped_system=False)
            rerendered = p.encode().token_ids[head:-1]  # without the "\n" after the close
        except ValueError as exc:  # the parsed turn does not render at all
            return Break(BreakReason.TEMPLATE_REWRITES_HISTORY, f"the parsed turn does not re-render: {exc}")
        sampled = (
            list(completion)
            if completion and completion[-1] == self.turn_close_id
            else [*completion, self.turn_close_id]
        )
        if rerendered == sampled:
            return None
        first = next(
            (i for i, (a, b) in enumerate(zip(rerendered, sampled, strict=False)) if a != b),
            min(len(rerendered), len(sampled)),
        )
        return Break(
            BreakReason.TEMPLATE_REWRITES_HISTORY,
            "the qwen3-coder template re-renders this turn differently from what the model sampled "
            "(content trimmed, arguments printed from their parsed values, malformed calls dropped)",
            position=len(prompt_ids) + first,
        )

    # ---- parsing ---------------------------------------------------------------------------------

    def parse_response(
        self, completion_ids: list[int], prompt_ids: list[int] | None = None, tools: Any = None
    ) -> ParsedResponse:
        """The base scan (reasoning, content, ``<tool_call>`` spans, stop id), each call read as XML
        (:func:`parse_xml_call`), then typed with the tools' schemas (:func:`type_call`)."""
        schemas = function_schemas(normalize_tools(tools))
        parsed = super().parse_response(completion_ids, prompt_ids)
        parsed.tool_calls = [type_call(call, schemas) for call in parsed.tool_calls]
        return parsed

    def _parse_call(self, body_ids: list[int], span: tuple[int, int], tool_names: set[str] | None) -> ToolCall:
        return parse_xml_call(self.tokenizer.decode(body_ids), span)


# ---- the XML call format -----------------------------------------------------------------------

_FUNCTION_OPEN = "<function="
_FUNCTION_CLOSE = "</function>"
_PARAMETER_OPEN = "<parameter="
_PARAMETER_CLOSE = "</parameter>"


def _snippet(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def parse_xml_call(raw: str, span: tuple[int, int]) -> ToolCall:
    """One call body (the text between ``<tool_call>`` and ``</tool_call>``) -> name and string arguments.

    The body is ``<function=NAME>``, parameters, ``</function>``, separated by any whitespace (the
    template writes ``\\n``). A parameter is ``<parameter=KEY>`` + value + ``</parameter>``; the value
    loses exactly one leading and one trailing ``\\n`` (the template adds exactly those), so values
    that start or end with newlines round-trip. A value ends at the first ``</parameter>`` followed
    (after whitespace) by another ``<parameter=`` or the end of the function block, so a value may
    itself contain ``</parameter>`` elsewhere. Values stay strings here (see :func:`type_call`).

    Statuses: ``missing_name`` (no ``<function=NAME>`` tag, or an empty or malformed name),
    ``invalid_arguments`` (the function block is not closed, a parameter tag has no name or is not
    closed, text that is not a parameter inside the block or after it, a parameter given twice).
    The arguments parsed before a structural error are kept on the call (the caller drops them
    unless the call was cut off)."""
    args: dict[str, Any] = {}

    def fail(status: ToolCallStatus, error: str, name: str | None = None) -> ToolCall:
        return ToolCall(name, args, status, span, raw, error)

    pos = len(raw) - len(raw.lstrip())
    if not raw.startswith(_FUNCTION_OPEN, pos):
        return fail(ToolCallStatus.MISSING_NAME, f"expected <function=NAME>, got {_snippet(raw.strip())}")
    name_end = raw.find(">", pos)
    name = raw[pos + len(_FUNCTION_OPEN) : name_end] if name_end >= 0 else ""
    if not name.strip() or "<" in name or "\n" in name:
        return fail(ToolCallStatus.MISSING_NAME, f"malformed function tag {_snippet(raw[pos:])}")
    close = raw.rfind(_FUNCTION_CLOSE)
    block_end = close if close > name_end else len(raw)
    error = _parse_parameters(raw[name_end + 1 : block_end], args, name)
    if error:
        return fail(ToolCallStatus.INVALID_ARGUMENTS, error, name)
    if close <= name_end:
        return fail(
            ToolCallStatus.INVALID_ARGUMENTS, f"the function block of {name!r} is not closed with </function>", name
        )
    trailing = raw[close + len(_FUNCTION_CLOSE) :]
    if trailing.strip():
        return fail(ToolCallStatus.INVALID_ARGUMENTS, f"text after </function>: {_snippet(trailing.strip())}", name)
    return ToolCall(name, args, ToolCallStatus.OK, span, raw)


def _parse_parameters(block: str, args: dict[str, Any], name: str) -> str | None:
    """Fill ``args`` from the parameters of one function block; an error message, or None."""
    i = 0
    n = len(block)
    while True:
        while i < n and block[i].isspace():
            i += 1
        if i == n:
            return None
        if not block.startswith(_PARAMETER_OPEN, i):
            return (
                f"unexpected text in the function block of {name!r}: {_snippet(block[i:])} (expected <parameter=KEY>)"
            )
        key_end = block.find(">", i)
        key = block[i + len(_PARAMETER_OPEN) : key_end] if key_end >= 0 else ""
        if not key or "<" in key or "\n" in key:
            return f"malformed parameter tag in {name!r}: {_snippet(block[i:])}"
        value_start = key_end + 1
        close = block.find(_PARAMETER_CLOSE, value_start)
        while close >= 0:
            rest = block[close + len(_PARAMETER_CLOSE) :].lstrip()
            if not rest or rest.startswith(_PARAMETER_OPEN):
                break
            close = block.find(_PARAMETER_CLOSE, close + 1)
        if close < 0:
            return f"parameter {key!r} of {name!r} is not closed with </parameter>"
        value = block[value_start:close]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        if key in args:
            return f"parameter {key!r} of {name!r} is given twice"
        args[key] = value
        i = close + len(_PARAMETER_CLOSE)


# ---- typing the arguments ----------------------------------------------------------------------


def function_schemas(tools: list[dict] | None) -> dict[str, dict] | None:
    """Offered function name -> its ``parameters`` schema ({} when it has none); None without tools."""
    if not tools:
        return None
    out = {}
    for tool in tools:
        fn = tool.get("function", tool)
        params = fn.get("parameters")
        out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


def type_call(call: ToolCall, schemas: dict[str, dict] | None) -> ToolCall:
    """Apply the offered tools to a structurally parsed call.

    - a call cut off by the end of the completion (``unclosed``) keeps the parameters completed
      before the cut, as strings; any other structural failure has no arguments;
    - without tools, every value stays the string the model wrote (a string ``"42"`` and an integer
      ``42`` are the same text: any guess could corrupt a string argument);
    - a name that is not offered is ``unknown_tool`` (values stay strings);
    - otherwise each value is coerced with its parameter's schema (:func:`coerce_arguments`); a value
      that is not of its declared type is ``invalid_arguments`` naming the parameter and the type.
    """
    if call.status is ToolCallStatus.UNCLOSED:
        return call
    if call.status is not ToolCallStatus.OK:
        call.arguments = None
        return call
    if schemas is None:
        return call
    if call.name not in schemas:
        call.status, call.error = ToolCallStatus.UNKNOWN_TOOL, f"no tool named {call.name!r} was offered"
        return call
    typed, error = coerce_arguments(call.arguments or {}, schemas[call.name], call.name or "")
    if error is not None:
        call.status, call.arguments, call.error = ToolCallStatus.INVALID_ARGUMENTS, None, error
    else:
        call.arguments = typed
    return call


def coerce_arguments(args: dict[str, str], parameters: dict, name: str) -> tuple[dict[str, Any], str | None]:
    """String values -> typed values by the ``parameters`` schema's ``properties``.

    A parameter whose schema declares ``string`` (or no type this function knows, or that is not in
    the schema at all) keeps its text verbatim. ``integer``, ``number``, ``boolean``, ``object``,
    ``array`` and ``null`` are read as JSON, and also as the template prints Python values
    (``True``/``False``, ``None``, ``inf``), so that render -> parse returns the original values. A
    union (``"type": [...]``, ``anyOf``/``oneOf``) tries its non-string types first, then keeps the
    string. Returns (arguments, None) or (partial, error)."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    out: dict[str, Any] = {}
    for key, text in args.items():
        types = _schema_types(properties.get(key))
        typed = _coerce(text, types)
        if typed is _NO_MATCH:
            return out, f"parameter {key!r} of {name!r} must be {' or '.join(types)}, got {_snippet(text)}"
        out[key] = typed
    return out, None


_NO_MATCH = object()
_ORDER = ("null", "boolean", "integer", "number", "object", "array")
_NON_FINITE = re.compile(r"[+-]?(inf|infinity|nan)", re.IGNORECASE)


def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types.extend(t for t in _schema_types(sub) if t not in types)
    return types


def _coerce(text: str, types: list[str]) -> Any:
    known = [t for t in _ORDER if t in types]
    if not known:
        return text  # a string, no type, or only types this parser does not know
    for kind in known:
        value = _as(kind, text.strip())
        if value is not _NO_MATCH:
            return value
    return text if "string" in types else _NO_MATCH


def _as(kind: str, text: str) -> Any:
    if kind == "null":
        return None if text in ("null", "None") else _NO_MATCH
    if kind == "boolean":
        return {"true": True, "True": True, "false": False, "False": False}.get(text, _NO_MATCH)
    if kind == "number" and _NON_FINITE.fullmatch(text):
        return float(text)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: a model can nest "[" deeper than the parser
        return _NO_MATCH
    if kind == "integer":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO_MATCH
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO_MATCH
    if kind == "object":
        return value if isinstance(value, dict) else _NO_MATCH
    return value if isinstance(value, list) else _NO_MATCH  # array
