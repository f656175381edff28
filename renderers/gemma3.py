"""Gemma 3 (instruction-tuned): ``<start_of_turn>role\\n...<end_of_turn>\\n`` turns with ``model`` as the
assistant role, and no system role: a first system message is folded into the first user turn.

What the official template does, and this module mirrors:

- it prints ``bos_token`` itself (the reference is tokenized with ``add_special_tokens=False``);
- a first system message becomes ``content + "\\n\\n"`` in front of the first loop message's text,
  untrimmed; with nothing after it, it is dropped;
- the remaining messages must alternate: user at even positions, anything else (assistant, system,
  tool) at odd ones, else it raises "Conversation roles must alternate ..." (:class:`TemplateRejected`
  here); a later system or tool message is rendered as a ``system`` / ``tool`` turn in place;
- every content is ``| trim``-med (Python's ``str.strip``); an assistant message without content
  renders as empty; reasoning, tool calls and tool definitions are not rendered at all.

The vocabulary matters as much as the template. Gemma's tokenizer has ~6400 non-special added tokens
that are ordinary text to the model: newline, tab and ``▁`` runs, HTML tags (``<b>``, ``<table>``),
``<unusedN>``. transformers splits text on them (SentencePiece's user-defined symbols), so message
text must be too, or ``<b>`` in a user message would not be the token the model knows. Only the
*control* tokens (``special: true``: ``<bos>``, ``<start_of_turn>``, ``<end_of_turn>``, ``<eos>``,
image tokens, ...) stay ordinary text inside a message, which is what keeps a quoted
``<start_of_turn>`` from forging a turn. :attr:`renderers.Tokenizer.text_view` is that encoding.
"""

from __future__ import annotations

from typing import Any

from .base import Renderer, TemplateRejected
from .pieces import Pieces, PieceWriter
from .tokenizer import Tokenizer
from .types import Break, BreakReason

ALTERNATION_ERROR = "Conversation roles must alternate user/assistant/user/assistant/..."

def _content(m: dict) -> str:
    """``message['content'] | trim``; no content at all is Jinja's undefined, which the template's
    ``is iterable`` branch loops over as empty."""
    return m.get("content", "").strip()


class Gemma3Renderer(Renderer):
    """Gemma 3 instruction-tuned models (1B to 27B share the template)."""

    name = "gemma3"
    template_hashes = ("7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4",)
    supports_tools = False  # the template renders neither tool definitions nor tool calls
    turn_close = "<end_of_turn>"
    after_close = "\n"
    extra_stop_tokens = ("<eos>",)

    def __init__(self, tokenizer: Tokenizer, *, thinking_retention: str = "keep", **template_kwargs: Any) -> None:
        super().__init__(tokenizer.text_view, thinking_retention=thinking_retention, **template_kwargs)
        self.start_of_turn_id = self.tokenizer.token_id("<start_of_turn>")

    def _render(self, p, msgs, tools, add_generation_prompt):
        p.scaffold(self.tokenizer.bos_token or "<bos>")
        first = 1 if msgs[0]["role"] == "system" else 0
        for turn, i in enumerate(range(first, len(msgs))):
            if (msgs[i]["role"] == "user") != (turn % 2 == 0):
                raise TemplateRejected(
                    f"message {i}: {ALTERNATION_ERROR} (the gemma3 template wants a user turn at every even "
                    f"position after an optional first system message, got {msgs[i]['role']!r} at position {turn})"
                )
            self._turn(p, msgs, i, system_prefix=first == 1 and turn == 0)
        if add_generation_prompt:
            self._generation_prompt(p)

    def _turn(self, p: PieceWriter, msgs: list[dict], i: int, system_prefix: bool = False) -> None:
        m = msgs[i]
        assistant = m["role"] == "assistant"
        p.special("<start_of_turn>", i)
        p.scaffold(("model" if assistant else m["role"]) + "\n", i)
        if system_prefix:  # the first system message, untrimmed, in front of the first turn's text
            p.text(msgs[0]["content"], 0)
            p.scaffold("\n\n", 0)
        p.text(_content(m), i, sampled=assistant)
        p.special("<end_of_turn>", i, sampled=assistant)
        p.scaffold("\n", i)

    def _generation_prompt(self, p: PieceWriter) -> None:
        p.special("<start_of_turn>")
        p.scaffold("model\n")

    def _continue(self, p, msgs, tools, prompt_ids, completion):
        # _family_break has checked the alternation against the turn's position in the whole conversation.
        for i in range(len(msgs)):
            self._turn(p, msgs, i)
        self._generation_prompt(p)

    # ---- bridging --------------------------------------------------------------------------------

    def _family_break(self, prompt_ids, completion, msgs):
        # The template's alternation rule depends on absolute positions, which only the prompt knows:
        # every turn opens with <start_of_turn>, so their count places the turn being answered. This
        # C-level count is the one pass over the prefix that a Gemma bridge makes.
        turn = prompt_ids.count(self.start_of_turn_id) - 1
        end = len(prompt_ids) + len(completion)
        if turn < 0:
            return Break(BreakReason.TEMPLATE_ERROR, "the prompt opens no <start_of_turn>: no model turn to extend", end)
        if turn % 2 == 0:
            return Break(
                BreakReason.TEMPLATE_ERROR,
                f"{ALTERNATION_ERROR}: the model turn being extended is turn {turn}, where the gemma3 template "
                "wants a user turn, so the template rejects the conversation once it holds that reply",
                end,
            )
        for j, m in enumerate(msgs):
            position = turn + 1 + j
            if (m["role"] == "user") != (position % 2 == 0):
                want = "a user message" if position % 2 == 0 else "a non-user message (assistant, system or tool)"
                return Break(
                    BreakReason.TEMPLATE_ERROR,
                    f"{ALTERNATION_ERROR}: new message {j} is {m['role']!r} at turn {position}, where the gemma3 "
                    f"template wants {want}",
                    end,
                )
        if self.thinking_retention == "template":
            why = self._rewritten_turn(completion)
            if why is not None:
                return Break(BreakReason.TEMPLATE_REWRITES_HISTORY, why, len(prompt_ids))
        return None

    def _rewritten_turn(self, completion: list[int]) -> str | None:
        """Why the template would re-render the sampled turn differently, or None when it would not.

        The template re-renders a reply from its text: trimmed, tokenized canonically, closed by
        ``<end_of_turn>``. Sampled tokens that differ from that (whitespace at either end, another
        stop token, a non-canonical split) would change under a full re-render.
        """
        stops = [k for k, t in enumerate(completion) if t in self.stop_token_ids]
        body = completion[: stops[0]] if stops else completion
        if stops and (completion[stops[0]] != self.turn_close_id or stops[0] != len(completion) - 1):
            return "the completion did not end with a single <end_of_turn>, which the template renders after the reply"
        text = self.tokenizer.decode(body)
        if text != text.strip():
            return "the reply starts or ends with whitespace, which the gemma3 template trims on re-render"
        p = Pieces(self.tokenizer)
        p.text(text, 0)
        if p.encode().token_ids != body:
            return "the reply's tokens are not the tokenization the template's re-render produces"
        return None
