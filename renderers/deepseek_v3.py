"""DeepSeek-V3 (Dec 2024) and DeepSeek-R1 (2025-01-22): full-width ``<｜User｜>`` / ``<｜Assistant｜>``
markers, DeepSeek's own tool-call format, and (R1) reasoning that the template cuts from history.

Both templates hoist every system message to the top (joined with ``"\\n\\n"``, right after the BOS),
close assistant turns with ``<｜end▁of▁sentence｜>``, open a tool-outputs block only once per
conversation (``ns.is_output_first`` is never reset) and print ``<｜tool▁outputs▁end｜>`` instead of a
generation prompt after tool results, so the model answers directly after it.

Tool calls, as R1's template prints them (and as both models sample them)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    \\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>

What transformers actually renders differs from what the templates' authors meant, and parity means
rendering it anyway:

- V3 renders tool calls only for ``content is none``; transformers drops null keys, so that branch never
  runs: an assistant message with content renders as plain text (its tool calls vanish), one without
  content is an error (``'<｜Assistant｜>' + undefined``).
- R1 prints the ``<｜Assistant｜>`` header and content only for the conversation's first tool call
  (``ns.is_first`` is never reset); later tool-call messages print ``"\\n"`` and the calls alone.
  ``ARGS`` is concatenated as a string: a dict is a ``TypeError`` in the template.
- R1 never prints ``reasoning_content`` and cuts everything up to the last ``</think>`` from an
  assistant's content, except after tool outputs and in tool-call messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .base import Renderer, TemplateRejected
from .deepseek_r1_distill import OUTPUT_BEGIN, OUTPUT_END, OUTPUTS_BEGIN, OUTPUTS_END
from .dialects.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, EOS, TOOL_SEP, parse_deepseek_call
from .messages import normalize_tools, tool_names
from .pieces import PieceWriter
from .scan import scan_ids
from .tokenizer import Tokenizer
from .types import Break, BreakReason, ParsedResponse, ToolCall, ToolCallStatus

BOS = "<｜begin▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = ("<think>", "</think>")


@dataclass
class _Namespace:
    """The template's ``ns``: state that spans the whole conversation."""

    is_tool: bool = False  # the last message rendered was a tool output
    is_first: bool = False  # R1: a tool-call header was printed (never reset, as in the template)
    is_output_first: bool = True  # no tool-outputs block was opened yet


class _DeepSeekBase(Renderer):
    turn_close = EOS
    tool_call_tokens = (CALL_BEGIN, CALL_END)
    output_separator: ClassVar[str]  # printed before every tool output after the conversation's first

    def __init__(self, tokenizer: Tokenizer, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        tid = tokenizer.token_id
        self._assistant_id = tid(ASSISTANT)
        self._calls_begin_id, self._calls_end_id = tid(CALLS_BEGIN), tid(CALLS_END)
        self._call_begin_id, self._call_end_id = tid(CALL_BEGIN), tid(CALL_END)
        self._sep_id = tid(TOOL_SEP)
        self._outputs_begin_id = tid(OUTPUTS_BEGIN)

    # ---- rendering -------------------------------------------------------------------------------

    def _render(self, p, msgs, tools, add_generation_prompt):
        p.scaffold(self.tokenizer.bos_token or "")
        first = True
        for i, m in enumerate(msgs):  # every system message goes to the top, in order
            if m["role"] == "system":
                if not first:
                    p.scaffold("\n\n", i)
                p.text(m["content"], i)
                first = False
        ns = _Namespace()
        self._messages(p, msgs, ns)
        self._close(p, ns, add_generation_prompt)

    def _continue(self, p, msgs, tools, prompt_ids, completion):
        # Assistant and system messages never get here (the base and _family_break return a Break),
        # so the only state carried over from the prefix is whether a tool-outputs block was opened
        # (ns.is_output_first spans the conversation). One membership scan of the prefix, the same
        # order of cost as copying it into the result.
        begin = self._outputs_begin_id
        ns = _Namespace(is_output_first=begin not in prompt_ids and begin not in completion)
        self._messages(p, msgs, ns)
        self._close(p, ns, add_generation_prompt=True)

    def _messages(self, p: PieceWriter, msgs: list[dict], ns: _Namespace) -> None:
        for i, m in enumerate(msgs):
            role = m["role"]
            if role == "user":
                ns.is_tool = False
                p.special(USER, i)
                p.text(m["content"], i)
            elif role == "assistant":
                self._assistant(p, m, i, ns)
            elif role == "tool":
                ns.is_tool = True
                if ns.is_output_first:
                    p.special(OUTPUTS_BEGIN, i)
                    ns.is_output_first = False
                else:
                    p.scaffold(self.output_separator, i)
                p.special(OUTPUT_BEGIN, i)
                p.text(m["content"], i)
                p.special(OUTPUT_END, i)

    def _close(self, p: PieceWriter, ns: _Namespace, add_generation_prompt: bool) -> None:
        # After tool results the template closes the block and prints no generation prompt.
        if ns.is_tool:
            p.special(OUTPUTS_END)
        elif add_generation_prompt:
            p.special(ASSISTANT)

    def _assistant(self, p: PieceWriter, m: dict, i: int, ns: _Namespace) -> None:
        raise NotImplementedError

    def _plain_assistant(self, p: PieceWriter, content: str, i: int, ns: _Namespace) -> None:
        """An assistant turn without tool calls; after tool outputs the block's end is its header."""
        if ns.is_tool:
            p.special(OUTPUTS_END, i)
            ns.is_tool = False
        else:
            p.special(ASSISTANT, i)
        p.text(content, i, sampled=True)
        p.special(EOS, i, sampled=True)

    def _missing_content(self, i: int) -> TemplateRejected:
        return TemplateRejected(
            f"message {i}: the {self.name} template concatenates this assistant message's content, which is missing"
        )

    # ---- bridging --------------------------------------------------------------------------------

    def _family_break(self, prompt_ids, completion, msgs):
        for i, m in enumerate(msgs):
            if m["role"] == "system":
                return Break(
                    BreakReason.SYSTEM_MESSAGE_MOVES,
                    f"new message {i} is a system message: the {self.name} template moves every system message "
                    "to the top of the conversation",
                    position=1 if prompt_ids[:1] == [self.tokenizer.added_tokens.get(BOS)] else 0,
                )
        if self.thinking_retention == "template":
            return self._template_rewrite(prompt_ids, completion)
        return None

    def _template_rewrite(self, prompt_ids: list[int], completion: list[int]) -> Break | None:
        """Under ``thinking_retention="template"``: a Break when re-rendering the sampled turn from its
        parsed message would change tokens that are already in the prefix."""
        return None

    def _rewrite_break(self, prompt_ids: list[int], completion: list[int], first: int, why: str) -> Break:
        return Break(BreakReason.TEMPLATE_REWRITES_HISTORY, why, position=len(prompt_ids) + first)

    # ---- parsing ---------------------------------------------------------------------------------

    def parse_response(
        self, completion_ids: list[int], prompt_ids: list[int] | None = None, tools: Any = None
    ) -> ParsedResponse:
        """Reasoning (R1: ``<think>``/``</think>`` ids), content and DeepSeek tool calls, by scanning ids.

        A call runs from ``<｜tool▁call▁begin｜>`` to ``<｜tool▁call▁end｜>``; one that meets another call's
        begin, the block's ``<｜tool▁calls▁end｜>``, a stop id or the end of the completion first is
        ``unclosed``. ``<｜tool▁calls▁begin｜>``/``<｜tool▁calls▁end｜>`` and the text between calls inside
        the block are structure, not content. Anything after a stop id is ignored."""
        names = tool_names(normalize_tools(tools))
        ids = list(completion_ids)
        scan = scan_ids(
            ids,
            stop_ids=self.stop_token_ids,
            think=self.think_ids,
            call=(self._call_begin_id, self._call_end_id),
            section=(self._calls_begin_id, self._calls_end_id),
            restart=True,
            in_reasoning=self._prompt_opens_reasoning(prompt_ids),
        )
        calls = []
        for start, end, closed in scan.calls:
            call = self._parse_call(ids[start + 1 : end - 1 if closed else end], (start, end), names)
            if not closed:
                call.status, call.error = ToolCallStatus.UNCLOSED, "the tool call has no <｜tool▁call▁end｜>"
            calls.append(call)
        return scan.response(calls, self.tokenizer.decode)

    def _parse_call(self, body_ids: list[int], span: tuple[int, int], tool_names: set[str] | None) -> ToolCall:
        return parse_deepseek_call(self.tokenizer.decode, self._sep_id, body_ids, span, tool_names)


class DeepSeekV3Renderer(_DeepSeekBase):
    """DeepSeek-V3 (the original Dec-2024 template). Tool calls in history are not rendered (see the
    module docstring); tool results are, and completions' tool calls are parsed."""

    name = "deepseek-v3"
    template_hashes = ("3b8267e54b67df6500f231ffa969955cc9d26b3444a291ced4eb96ca7d3ca1ea",)
    output_separator = "\n"
    supports_tools = False  # neither tool definitions nor (under transformers) tool calls are rendered

    def _assistant(self, p, m, i, ns):
        if "content" not in m:
            raise self._missing_content(i)
        self._plain_assistant(p, m["content"], i, ns)

    def _template_rewrite(self, prompt_ids, completion):
        for pos, tid in enumerate(completion):
            if tid in (self._calls_begin_id, self._call_begin_id):
                why = "the deepseek-v3 template (under transformers) does not render an assistant message's tool calls"
                return self._rewrite_break(prompt_ids, completion, pos, why)
        return None


class DeepSeekR1Renderer(_DeepSeekBase):
    """DeepSeek-R1 (template of 2025-01-22): tool calls rendered, reasoning cut from history.

    ``<think>``/``</think>`` are added tokens of R1's vocabulary (128798/128799), so reasoning is found
    by those ids. On a vocabulary without them (DeepSeek-V3's has placeholders at those ids) the class
    still works, without a reasoning split: text spelling ``<think>`` is content there."""

    history_arguments = "json"  # the template concatenates arguments: a dict is a TypeError
    name = "deepseek-r1"
    template_hashes = ("3a3036eeb96ca0e48565fc1f19b4d7d3fa17ada32bb1b3d5ed539ae74cf22923",)
    output_separator = ""
    think_tokens = THINK

    def __init__(self, tokenizer: Tokenizer, **kwargs: Any) -> None:
        if not all(t in tokenizer.added_tokens for t in THINK):
            self.think_tokens = None  # this vocabulary has no think tokens: no reasoning split
        super().__init__(tokenizer, **kwargs)

    def _assistant(self, p, m, i, ns):
        if "tool_calls" not in m:
            if "content" not in m:
                raise self._missing_content(i)
            content = m["content"]
            if not ns.is_tool and "</think>" in content:
                content = content.split("</think>")[-1]
            self._plain_assistant(p, content, i, ns)
            return
        ns.is_tool = False
        for call in m["tool_calls"]:
            if not ns.is_first:
                if "content" not in m:
                    raise self._missing_content(i)
                p.special(ASSISTANT, i)
                p.text(m["content"], i, sampled=True)
                p.special(CALLS_BEGIN, i, sampled=True)
                ns.is_first = True
            else:
                p.scaffold("\n", i, sampled=True)
            self._tool_call(p, call, i)
        p.special(CALLS_END, i, sampled=True)
        p.special(EOS, i, sampled=True)

    def _tool_call(self, p: PieceWriter, call: dict, i: int) -> None:
        arguments = call["function"]["arguments"]
        if not isinstance(arguments, str):
            raise TemplateRejected(
                f"message {i}: the deepseek-r1 template concatenates tool-call arguments as a string; "
                f"got {type(arguments).__name__} (pass arguments as a JSON string)"
            )
        p.special(CALL_BEGIN, i, sampled=True)
        p.scaffold(call["type"], i, sampled=True)
        p.special(TOOL_SEP, i, sampled=True)
        p.text(call["function"]["name"], i, sampled=True)
        p.scaffold("\n```json\n", i, sampled=True)
        p.text(arguments, i, sampled=True)
        p.scaffold("\n```", i, sampled=True)
        p.special(CALL_END, i, sampled=True)

    def _template_rewrite(self, prompt_ids, completion):
        if self.think_ids is not None:
            for pos, tid in enumerate(completion):
                if tid in self.think_ids:
                    why = (
                        "the deepseek-r1 template never renders reasoning_content and cuts everything up to "
                        "'</think>' from earlier assistant turns"
                    )
                    return self._rewrite_break(prompt_ids, completion, pos, why)
        if self._calls_begin_id in completion or self._call_begin_id in completion:
            opened_by_header = bool(prompt_ids) and prompt_ids[-1] == self._assistant_id
            if not opened_by_header or self._calls_begin_id in prompt_ids:
                pos = next(k for k, t in enumerate(completion) if t in (self._calls_begin_id, self._call_begin_id))
                why = (
                    "the deepseek-r1 template prints the header and content only for the conversation's first "
                    "tool-call turn (and no <｜tool▁outputs▁end｜> before a tool-call turn)"
                )
                return self._rewrite_break(prompt_ids, completion, pos, why)
        return None
