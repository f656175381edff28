"""Qwen3-Coder: ChatML turns, tool definitions as XML-ish ``<tools><function><name>...`` blocks, and XML tool
calls (``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>``).

The template renders a string argument verbatim, a dict or list with ``tojson`` and any other value with
Python's ``str`` (``True``, ``None``, ``1e+20``), so the text of a call does not say which type a value
had: ``parse_response`` coerces each value back with the JSON schema of the tools it is given. The
structure is found by token ids (``<tool_call>``/``</tool_call>`` are added tokens); inside a call the
XML tags are ordinary text, read by :mod:`renderers.dialects.xml_calls` (the call format and its
typing live there, below the families, so that the dialects parse it too).

Each rendering method mirrors a branch of the official template, including how Jinja treats a
missing value (undefined: empty when printed, an error when concatenated).
"""

from __future__ import annotations

import json
from typing import Any

from .base import TemplateRejected
from .dialects.xml_calls import function_schemas, parse_xml_call, type_call
from .json_text import tojson
from .messages import normalize_messages, normalize_tools
from .pieces import Pieces, PieceWriter
from .qwen import _QwenBase
from .types import Break, BreakReason, Bridged, ParsedResponse, ToolCall

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
