"""Llama-3.3-Nemotron-Super-49B v1.5: NVIDIA's own format on the Llama 3 vocabulary and headers.

Its reasoning switch is ``/think`` / ``/no_think`` in the first system message; tool calls are
``<TOOLCALL>[...]</TOOLCALL>`` text and results ``<TOOL_RESPONSE>[...]</TOOL_RESPONSE>``; the template
drops everything up to the last ``</think>`` of every assistant message. None of these markers are added
tokens in the Llama 3 vocabulary, so the parser reads them from the decoded completion and maps
character positions back to tokens through each token's bytes.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from typing import Any

from .dialects.json_calls import parse_json_call
from .json_text import tojson
from .llama3 import LlamaHeaders
from .messages import normalize_tools, tool_names
from .pieces import PieceWriter
from .tokenizer import Tokenizer
from .types import Break, BreakReason, ParsedResponse, ToolCall, ToolCallStatus

NEMOTRON_TOOLS_INTRO = "You can use the following tools to assist the user if required:\n<AVAILABLE_TOOLS>["
NEMOTRON_TOOLS_OUTRO = (
    "]</AVAILABLE_TOOLS>\n\nIf you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{{"name": "tool_name1", "arguments": "tool_args1"}}, '
    '{{"name": "tool_name2", "arguments": "tool_args2"}}]'
    "</TOOLCALL>\n\nResponse from tool(s) will be returned in this format:\n"
    '<TOOL_RESPONSE>[{{"response": "tool_response1"}}, {{"response": "tool_response2"}}]</TOOL_RESPONSE>\n\n'
    "Based on the results returned by the tool(s), you can call additional tools if needed, correct tool calls if "
    "any errors are found, or just respond with the answer to the user."
)
NO_THINK_PREFILL = "<think>\n\n</think>\n\n"


class NemotronSuperRenderer(LlamaHeaders):
    """Llama-3.3-Nemotron-Super-49B v1.5. Reasoning is on unless the first system message says
    ``/no_think`` (the template removes the switch from the text; ``/think`` is removed too); off, the
    generation prompt pre-fills an empty think block. The template takes no kwargs: it overwrites
    ``enable_thinking`` itself."""

    name = "llama3.3-nemotron-super"
    template_hashes = ("1b13a386b158bb4033ad9960032530554c47a92d1735c7dfce715efcabf30e5c",)
    extra_stop_tokens = ("<|end_of_text|>",)

    def __init__(self, tokenizer: Tokenizer, **kwargs: Any) -> None:
        super().__init__(tokenizer, **kwargs)
        self._prefill_ids = tokenizer.encode_plain("\n\n" + NO_THINK_PREFILL)  # the run after <|end_header_id|>

    def _render(self, p, msgs, tools, add_generation_prompt):
        owner = 0 if msgs[0]["role"] == "system" else -1
        p.scaffold("<|begin_of_text|>")
        self._header(p, "system", owner)
        thinking = True
        if owner == 0 and msgs[0]["content"] != "":
            text = msgs[0]["content"]
            if "/no_think" in text:
                text, thinking = text.replace("/no_think", "").strip(), False
            elif "/think" in text:
                text = text.replace("/think", "").strip()
            p.text(text, 0)
            p.scaffold("\n\n", 0)
        if tools:
            p.scaffold(NEMOTRON_TOOLS_INTRO)
            for j, tool in enumerate(tools):
                p.text(tojson(tool.get("function", tool)), -1, content=False)
                if j < len(tools) - 1:
                    p.scaffold(", ")
            p.scaffold(NEMOTRON_TOOLS_OUTRO)
        p.special("<|eot_id|>", owner)
        self._messages(p, msgs, prev_role=None)
        if add_generation_prompt:
            self._generation_prompt(p, thinking)

    def _generation_prompt(self, p: PieceWriter, thinking: bool) -> None:
        self._header(p, "assistant", -1)
        if not thinking:
            p.scaffold(NO_THINK_PREFILL)

    def _messages(self, p: PieceWriter, msgs: list[dict], prev_role: str | None) -> None:
        for i, m in enumerate(msgs):
            role = m["role"]
            if role == "user":
                self._header(p, "user", i)
                p.text(m["content"], i)
                p.special("<|eot_id|>", i)
            elif role == "assistant":
                self._assistant(p, m, i)
            elif role == "tool":
                if prev_role != "tool":
                    self._header(p, "tool", i)
                    p.scaffold("<TOOL_RESPONSE>[", i)
                p.text(m["content"], i)
                if i + 1 < len(msgs) and msgs[i + 1]["role"] == "tool":
                    p.scaffold(", ", i)
                else:
                    p.scaffold("]</TOOL_RESPONSE>", i)
                    p.special("<|eot_id|>", i)
            # system messages render nothing in the loop (only the first one, above)
            prev_role = role

    def _assistant(self, p: PieceWriter, m: dict, i: int) -> None:
        content = m.get("content", "")  # undefined prints as ""
        if "</think>" in content:
            content = content.split("</think>")[-1].lstrip()
        self._header(p, "assistant", i)
        p.text(content, i, sampled=True)
        calls = m.get("tool_calls", ())
        if calls:
            p.scaffold("<TOOLCALL>[", i, sampled=True)
            for j, call in enumerate(calls):
                fn = call["function"]
                p.scaffold('{"name": "', i, sampled=True)
                p.text(fn["name"], i, sampled=True)
                p.scaffold('", "arguments": ', i, sampled=True)
                args = fn["arguments"]
                p.text(args if isinstance(args, str) else tojson(args), i, sampled=True)
                p.scaffold("}, " if j < len(calls) - 1 else "}", i, sampled=True)
            p.scaffold("]</TOOLCALL>", i, sampled=True)
        p.special("<|eot_id|>", i, sampled=True)

    def _continue(self, p, msgs, tools, prompt_ids, completion):
        self._messages(p, msgs, prev_role="assistant")
        self._generation_prompt(p, self._thinking_in(prompt_ids))

    # ---- bridging --------------------------------------------------------------------------------

    def _thinking_in(self, prompt_ids: list[int]) -> bool:
        """Whether the conversation behind ``prompt_ids`` has reasoning on. The switch lives in the system
        message, outside a bridge's new messages: the previous generation prompt shows it (it ends with
        the pre-filled empty think block when thinking is off)."""
        n = len(self._prefill_ids)
        return list(prompt_ids[-n:]) != self._prefill_ids

    def _family_break(self, prompt_ids, completion, msgs):
        # Reasoning is text in this vocabulary (no think tokens for the base class to track).
        text = self.tokenizer.decode(completion)
        at = len(prompt_ids) + len(completion)
        if text.lstrip().startswith("<think>") and "</think>" not in text:
            stopped = bool(completion) and completion[-1] in self.stop_token_ids
            reason = BreakReason.STOP_INSIDE_REASONING if stopped else BreakReason.TRUNCATED_INSIDE_REASONING
            return Break(reason, "the completion ended inside an unclosed <think> block", position=at)
        if self.thinking_retention != "template":
            return None
        if not self._thinking_in(prompt_ids):
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY,
                "the nemotron template drops the empty think block its /no_think generation prompt pre-fills",
                position=len(prompt_ids) - len(self._prefill_ids),
            )
        if "</think>" in text:
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY,
                "the nemotron template drops an assistant message's text up to its last </think>",
                position=len(prompt_ids),
            )
        return None

    # ---- parsing ---------------------------------------------------------------------------------

    def parse_response(self, completion_ids, prompt_ids=None, tools=None) -> ParsedResponse:
        """Reasoning (text up to the first ``</think>``, without a leading ``<think>``), content, and the
        calls of each ``<TOOLCALL>[...]</TOOLCALL>`` block (a JSON list of ``{"name", "arguments"}``; every
        call of a block has the block's token span). These markers are text in this vocabulary, so
        they are found in the decoded completion and mapped back to token positions."""
        names = tool_names(normalize_tools(tools))
        ids = list(completion_ids)
        end, stop = len(ids), None
        for i, tid in enumerate(ids):
            if tid in self.stop_token_ids:
                end, stop = i, tid
                break
        body = ids[:end]
        text = self.tokenizer.decode(body)
        reasoning: str | None = None
        complete: bool | None = None
        offset = 0
        if "</think>" in text:
            before, _, _ = text.partition("</think>")
            reasoning, complete = before.strip().removeprefix("<think>").strip(), True
            offset = len(before) + len("</think>")
        elif text.lstrip().startswith("<think>"):
            reasoning, complete, offset = text.lstrip()[len("<think>") :].strip(), False, len(text)
        locate = _TokenLocator(self.tokenizer, body, text)
        content, calls = _toolcall_blocks(text, offset, locate, names, stop is not None)
        return ParsedResponse(
            content=content.strip(),
            reasoning_content=reasoning,
            tool_calls=calls,
            reasoning_complete=complete,
            stop_token_id=stop,
        )


def _toolcall_blocks(
    text: str, offset: int, locate: _TokenLocator, tool_names, stopped: bool
) -> tuple[str, list[ToolCall]]:
    """Content outside the ``<TOOLCALL>`` blocks of ``text[offset:]``, and their calls."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = offset
    while True:
        start = text.find("<TOOLCALL>", pos)
        if start < 0:
            content.append(text[pos:])
            return "".join(content), calls
        content.append(text[pos:start])
        body_start = start + len("<TOOLCALL>")
        close = text.find("</TOOLCALL>", body_start)
        if close < 0:
            raw = text[body_start:]
            span = locate.span(start, len(text), include_stop=stopped)
            what = "no </TOOLCALL> before the stop token" if stopped else "the completion ended inside this tool call"
            calls.append(ToolCall(None, None, ToolCallStatus.UNCLOSED, span, raw, what))
            return "".join(content), calls
        raw = text[body_start:close]
        pos = close + len("</TOOLCALL>")
        calls.extend(_block_calls(raw, locate.span(start, pos), tool_names))


def _block_calls(raw: str, span: tuple[int, int], tool_names) -> list[ToolCall]:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        return [ToolCall(None, None, ToolCallStatus.INVALID_JSON, span, raw, f"not JSON: {exc}")]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return [
            ToolCall(
                None,
                None,
                ToolCallStatus.NOT_AN_OBJECT,
                span,
                raw,
                f"expected a list of calls, got {type(value).__name__}",
            )
        ]
    return [parse_json_call(json.dumps(item, ensure_ascii=False), span, tool_names) for item in value]


class _TokenLocator:
    """Maps character offsets of ``decode(ids)`` back to token positions, through each token's bytes."""

    def __init__(self, tok: Tokenizer, ids: list[int], text: str) -> None:
        specials = {v: k for k, v in tok.added_tokens.items()}
        ends, total = [], 0
        for tid in ids:
            piece = specials.get(tid)
            if piece is not None:
                total += len(piece.encode("utf-8"))
            else:
                total += len(_token_bytes(tok, tid))
            ends.append(total)
        self.ends = ends
        self.text = text
        self.n = len(ids)

    def token_at(self, char: int) -> int:
        byte = len(self.text[:char].encode("utf-8"))  # exact while the text is valid UTF-8 up to char
        return min(bisect_right(self.ends, byte), max(self.n - 1, 0))

    def span(self, start_char: int, end_char: int, include_stop: bool = False) -> tuple[int, int]:
        start = self.token_at(start_char)
        end = self.token_at(max(end_char - 1, start_char)) + 1
        if include_stop:
            end = self.n + 1
        return start, max(end, start + 1)


_BYTE_DECODER: dict[str, int] | None = None


def _token_bytes(tok: Tokenizer, tid: int) -> bytes:
    """The bytes of a byte-level BPE token (GPT-2's printable-character mapping inverted)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        printable = (
            list(range(ord("!"), ord("~") + 1))
            + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1))
        )
        chars, n = list(printable), 0
        for b in range(256):
            if b not in printable:
                printable.append(b)
                chars.append(256 + n)
                n += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(printable, chars, strict=True)}
    token = tok.backend.id_to_token(tid) or ""
    return bytes(_BYTE_DECODER.get(ch, 0) for ch in token)
