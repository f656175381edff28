"""Qwen2.5-Instruct and Qwen3: ChatML turns, Hermes-style ``<tool_call>`` JSON, tool results grouped
into one user turn of ``<tool_response>`` blocks, and (Qwen3) ``<think>`` reasoning that the template
keeps only after the last real user query.

Each method mirrors a branch of the official template, including how Jinja treats a message with
no content (undefined: empty when printed, an error when concatenated).
"""

from __future__ import annotations

from functools import cached_property

from .base import Renderer, TemplateRejected
from .json_text import tojson
from .pieces import PieceWriter
from .types import Break, BreakReason

TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
_TOOLS_FIRST_LINE = TOOLS_INTRO + "\n"  # the intro and the first definition's line break, one scaffold string
_SYSTEM_TOOLS_GAP = "\n\n" + _TOOLS_FIRST_LINE  # between a Qwen3 system message's text and its first tool
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


# a turn's opening tokens, as one scaffold string (see Pieces.scaffold)
_TURN_OPEN = {role: f"<|im_start|>{role}\n" for role in ("system", "user", "assistant")}
_CALL_OPEN = {sep: sep + '<tool_call>\n{"name": "' for sep in ("", "\n")}
_CALL_MIDDLE = ('", "arguments": ',)

def _concat_content(m: dict, i: int, family: str) -> str:
    """``... + message.content`` in the template: an undefined content is a render error."""
    if "content" not in m:
        raise TemplateRejected(f"message {i}: the {family} template concatenates this {m['role']} message's content, which is missing")
    return m["content"]


class _QwenBase(Renderer):
    turn_close = "<|im_end|>"
    after_close = "\n"
    tool_call_tokens = ("<tool_call>", "</tool_call>")
    extra_stop_tokens = ("<|endoftext|>",)

    def _tool_definitions(self, p: PieceWriter, tools: list[dict]) -> None:
        for k, tool in enumerate(tools):  # each definition on its own line after the intro
            p.scaffold("\n" if k else _TOOLS_FIRST_LINE)
            p.text(tojson(tool), -1, content=False)
        p.scaffold(TOOLS_OUTRO)

    def _tool_message(self, p: PieceWriter, msgs: list[dict], i: int, prev_role: str | None) -> None:
        m = msgs[i]
        # consecutive tool results share one user turn; the fixed tokens go as one scaffold string each side
        last_of_turn = i == len(msgs) - 1 or msgs[i + 1]["role"] != "tool"
        p.wrapped(
            "\n<tool_response>\n" if prev_role == "tool" else "<|im_start|>user\n<tool_response>\n",
            _concat_content(m, i, self.name),
            "\n</tool_response><|im_end|>\n" if last_of_turn else "\n</tool_response>",
            i,
        )

    def _plain_turn(self, p: PieceWriter, m: dict, i: int) -> None:
        text = _concat_content(m, i, self.name)
        role = m["role"]
        if role == "assistant":
            p.scaffold(_TURN_OPEN[role], i)
            p.text(text, i, sampled=True)
            p.special("<|im_end|>", i, sampled=True)
            p.scaffold("\n", i)
        else:
            p.wrapped(_TURN_OPEN[role], text, "<|im_end|>\n", i)

    def _tool_call(self, p: PieceWriter, call: dict, i: int, arguments_text: str, separator: str, last: bool) -> None:
        """One call; the last one closes the turn too (``<|im_end|>``, sampled)."""
        p.fields(_CALL_OPEN[separator], (call["function"]["name"], arguments_text), _CALL_MIDDLE,
                 "}\n</tool_call><|im_end|>" if last else "}\n</tool_call>", i, sampled=True)

    def _messages(
        self, p: PieceWriter, msgs: list[dict], prev_role: str | None, first_is_skipped_system: bool, last_query: int = -1
    ) -> None:
        """The template's loop. ``last_query``: the index of the last real user query (Qwen3 keeps the
        reasoning of assistant turns after it); -1 where the template has no such rule."""
        for i, m in enumerate(msgs):
            role = m["role"]
            if role == "user" or (role == "system" and not (i == 0 and first_is_skipped_system)):
                self._plain_turn(p, m, i)
            elif role == "assistant":
                self._assistant(p, msgs, i, last_query)
            elif role == "tool":
                self._tool_message(p, msgs, i, msgs[i - 1]["role"] if i > 0 else prev_role)
            prev_role = role

    def _generation_prompt(self, p: PieceWriter) -> None:
        p.scaffold("<|im_start|>assistant\n")

    def _continue(self, p, msgs, tools, prompt_ids, completion):
        self._messages(p, msgs, prev_role="assistant", first_is_skipped_system=False)
        self._generation_prompt(p)


class Qwen25Renderer(_QwenBase):
    """Qwen2.5-Instruct (tools; a default system prompt; arguments always through ``tojson``)."""

    name = "qwen2.5"
    template_hashes = ("cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",)

    def _render(self, p, msgs, tools, add_generation_prompt):
        has_system = msgs[0]["role"] == "system"
        owner = 0 if has_system else -1
        if tools:
            p.scaffold("<|im_start|>system\n", owner)
            if has_system:
                p.text(_concat_content(msgs[0], 0, self.name), 0)
            else:
                p.scaffold(QWEN25_DEFAULT_SYSTEM)
            p.scaffold("\n\n")
            self._tool_definitions(p, tools)
        elif has_system:
            self._plain_turn(p, msgs[0], 0)
        else:
            p.scaffold(f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n")
        self._messages(p, msgs, prev_role=None, first_is_skipped_system=True)
        if add_generation_prompt:
            self._generation_prompt(p)

    def _assistant(self, p: PieceWriter, msgs: list[dict], i: int, last_query: int) -> None:
        m = msgs[i]
        if "tool_calls" not in m:
            self._plain_turn(p, m, i)
            return
        p.scaffold("<|im_start|>assistant", i)
        if m.get("content"):
            p.scaffold("\n", i, sampled=True)
            p.text(m["content"], i, sampled=True)
        calls = m["tool_calls"]  # never empty: normalisation drops an empty list
        for j, call in enumerate(calls):
            self._tool_call(p, call, i, tojson(call["function"]["arguments"]), "\n", j == len(calls) - 1)
        p.scaffold("\n", i)


class Qwen3Renderer(_QwenBase):
    """Qwen3 (hybrid thinking): ``enable_thinking=False`` pre-fills an empty think block."""

    name = "qwen3"
    template_hashes = ("87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",)
    template_kwargs_allowed = {"enable_thinking": bool}
    think_tokens = ("<think>", "</think>")

    def _render(self, p, msgs, tools, add_generation_prompt):
        has_system = msgs[0]["role"] == "system"
        if tools and has_system and self._tool_intro_is_text:  # the system text, then the tool block
            p.wrapped("<|im_start|>system\n", _concat_content(msgs[0], 0, self.name), TOOLS_OUTRO, 0,
                      extra=_SYSTEM_TOOLS_GAP + "\n".join(tojson(tool) for tool in tools), extra_message=-1)
        elif tools:
            p.scaffold("<|im_start|>system\n", 0 if has_system else -1)
            if has_system:  # the same tokens and owners as the wrapped call, the intro split on added tokens
                p.text(_concat_content(msgs[0], 0, self.name), 0)
                p.scaffold("\n\n")
            self._tool_definitions(p, tools)
        elif has_system:
            self._plain_turn(p, msgs[0], 0)
        self._messages(p, msgs, prev_role=None, first_is_skipped_system=True, last_query=_last_query_index(msgs))
        if add_generation_prompt:
            self._generation_prompt(p)

    @cached_property
    def _tool_intro_is_text(self) -> bool:
        """The tool block's fixed text holds no added-token string in this vocabulary, so it can join the
        system message's run as plain text (wrapped's ``extra``); a vocabulary that adds, say, ``<tools>``
        must have it split out as the template's text is."""
        return self.tokenizer.split_added(_SYSTEM_TOOLS_GAP) == [_SYSTEM_TOOLS_GAP]

    def _generation_prompt(self, p: PieceWriter) -> None:
        super()._generation_prompt(p)
        if self.template_kwargs.get("enable_thinking") is False:
            p.scaffold("<think>\n\n</think>\n\n")

    def _assistant(self, p: PieceWriter, msgs: list[dict], i: int, last_query: int) -> None:
        m = msgs[i]
        content = m.get("content")  # None stands for Jinja's undefined
        reasoning = ""
        if "reasoning_content" in m:
            reasoning = m["reasoning_content"]
        elif content is not None and "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if content is None:
            raise TemplateRejected(f"message {i}: the qwen3 template concatenates the assistant content, which is missing")
        p.scaffold("<|im_start|>assistant\n", i)
        if i > last_query and (i == len(msgs) - 1 or reasoning):
            p.wrapped("<think>\n", reasoning.strip("\n"), "\n</think>\n\n", i, sampled=True)
            p.text(content.lstrip("\n"), i, sampled=True)
        else:
            p.text(content, i, sampled=True)
        calls = m.get("tool_calls", ())
        for j, call in enumerate(calls):
            args = call["function"]["arguments"]
            # the template tests `content` before its lstrip: "\n" alone still separates
            self._tool_call(p, call, i, args if isinstance(args, str) else tojson(args), "\n" if j > 0 or content else "",
                            j == len(calls) - 1)
        if not calls:
            p.special("<|im_end|>", i, sampled=True)
        p.scaffold("\n", i)

    def _family_break(self, prompt_ids, completion, msgs):
        if self.thinking_retention != "template":
            return None
        open_id = self.think_ids[0]
        real_query = any(m["role"] == "user" and not _looks_like_tool_response(m["content"]) for m in msgs)
        if real_query:
            start = self._last_query_start(prompt_ids)
            if open_id in prompt_ids[start:] or open_id in completion:
                return Break(
                    BreakReason.TEMPLATE_REWRITES_HISTORY,
                    "a new user query makes the qwen3 template drop the reasoning of earlier assistant turns",
                    position=len(prompt_ids) + len(completion),
                )
            return None
        # this turn's think block may open in the prompt (enable_thinking=False pre-fills an empty one)
        im_start = self.tokenizer.token_id("<|im_start|>")
        turn_start = next((i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] == im_start), 0)
        turn = prompt_ids[turn_start:] + completion
        if open_id in turn and not self._think_block_kept(turn):
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY,
                "the qwen3 template re-renders this turn's reasoning differently (empty, or not in its "
                "'<think>\\n...\\n</think>\\n\\n' form)",
                position=turn_start + turn.index(open_id),
            )
        return None

    def _think_block_kept(self, turn: list[int]) -> bool:
        """Would the template re-render this turn's think block as sampled (non-empty, canonical)?"""
        open_id, close_id = self.think_ids
        try:
            a = turn.index(open_id)
            b = turn.index(close_id, a)
        except ValueError:
            return False
        reasoning = self.tokenizer.decode(turn[a + 1 : b])
        after = self.tokenizer.decode(turn[b + 1 :])
        inner = reasoning[1:-1]
        return (
            len(reasoning) >= 3
            and reasoning[0] == "\n"
            and reasoning[-1] == "\n"
            and inner == inner.strip("\n")
            and after.startswith("\n\n")
            and not after[2:].startswith("\n")
        )

    def _last_query_start(self, prompt_ids: list[int]) -> int:
        """Position of the last real user query's ``<|im_start|>`` in the prompt (0 if none)."""
        tok = self.tokenizer
        im_start = tok.token_id("<|im_start|>")
        user_id = tok.encode("user")[0]
        for pos in range(len(prompt_ids) - 2, -1, -1):
            if prompt_ids[pos] != im_start or prompt_ids[pos + 1] != user_id:
                continue
            try:
                end = prompt_ids.index(self.turn_close_id, pos + 1)
            except ValueError:
                end = len(prompt_ids)
            turn = tok.decode(prompt_ids[pos + 1 : end])
            if turn.startswith("user\n") and not _looks_like_tool_response(turn[5:]):
                return pos
        return 0


def _looks_like_tool_response(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


def _last_query_index(msgs: list[dict]) -> int:
    """The template's ``ns.last_query_index``: the last user message that is not a wrapped tool response."""
    for index in range(len(msgs) - 1, -1, -1):
        m = msgs[index]
        if m["role"] == "user" and not _looks_like_tool_response(m["content"]):
            return index
    return len(msgs) - 1
