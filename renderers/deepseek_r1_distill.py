"""DeepSeek-R1-Distill-Qwen: DeepSeek's ``<｜User｜>`` / ``<｜Assistant｜>`` markers on Qwen's vocabulary.

The template (as shipped on 2025-01-30) hoists the last system message to the top, drops everything
up to ``</think>`` from earlier assistant turns, and ends its generation prompt with a newline. Its
tool-call branch only runs for ``content is none``, which transformers never passes (it drops None
keys), so tool calls on an assistant message are not rendered; tool results are. The DeepSeek tool
markers are not tokens in this vocabulary, so they are ordinary scaffold text.
"""

from __future__ import annotations

from .base import Renderer, TemplateRejected
from .pieces import PieceWriter
from .types import Break, BreakReason

OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"


class DeepSeekR1DistillRenderer(Renderer):
    name = "deepseek-r1-distill"
    history_arguments = "json"  # the template concatenates arguments: a dict is a TypeError
    template_hashes = ("3fed12e2bc6cf968931ae01e6be6551b5a6337e11830c733bd3c97e05aa03db1",)
    turn_close = "<｜end▁of▁sentence｜>"
    think_tokens = ("<think>", "</think>")

    def _render(self, p, msgs, tools, add_generation_prompt):
        system = max((i for i, m in enumerate(msgs) if m["role"] == "system"), default=None)
        p.special(self.tokenizer.bos_token or "<｜begin▁of▁sentence｜>")
        p.scaffold("\n")
        if system is not None:
            p.text(msgs[system]["content"], system)
        is_tool = self._messages(p, msgs, is_output_first=True)
        if is_tool:
            p.scaffold(OUTPUTS_END + "\n")
        if add_generation_prompt and not is_tool:
            p.scaffold("<｜Assistant｜>\n")

    def _messages(self, p: PieceWriter, msgs: list[dict], is_output_first: bool) -> bool:
        is_tool = False
        for i, m in enumerate(msgs):
            role = m["role"]
            if role == "user":
                is_tool = False
                p.scaffold("<｜User｜>", i)
                p.text(m["content"], i)
            elif role == "assistant":
                if "content" not in m:
                    raise TemplateRejected(
                        f"message {i}: the deepseek-r1-distill template concatenates the assistant content, which is missing"
                    )
                content = m["content"]
                if is_tool:
                    p.scaffold(OUTPUTS_END, i)  # the prompt after tool results ends with it: not sampled
                    is_tool = False
                else:
                    if "</think>" in content:
                        content = content.split("</think>")[-1]
                    p.scaffold("<｜Assistant｜>", i)
                p.text(content, i, sampled=True)
                p.scaffold(self.turn_close, i, sampled=True)
            elif role == "tool":
                is_tool = True
                p.scaffold(OUTPUTS_BEGIN + OUTPUT_BEGIN if is_output_first else "\n" + OUTPUT_BEGIN, i)
                is_output_first = False
                p.text(m["content"], i)
                p.scaffold(OUTPUT_END, i)
        return is_tool

    def _outputs_opened(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt shows a tool output rendered before (the template's ns.is_output_first, the
        one state it carries across the conversation): only the first opens the outputs block, and its
        marker is text in this vocabulary. Shown where the marker follows a turn-closing token: only a
        tool output's scaffold starts there (a message's own text cannot; _family_break refuses a prompt
        that holds the marker elsewhere only)."""
        close, width = self.turn_close_id, len(self.tokenizer.encode(OUTPUTS_BEGIN)) + 1
        decode = self.tokenizer.decode
        return any(t == close and decode(prompt_ids[i + 1 : i + 1 + width]).startswith(OUTPUTS_BEGIN)
                   for i, t in enumerate(prompt_ids))

    def _continue(self, p, msgs, tools, prompt_ids, completion):
        first = any(m["role"] == "tool" for m in msgs) and not self._outputs_opened(prompt_ids)
        if self._messages(p, msgs, is_output_first=first):
            p.scaffold(OUTPUTS_END + "\n")  # after tool results: no generation prompt
        else:
            p.scaffold("<｜Assistant｜>\n")

    def _family_break(self, prompt_ids, completion, msgs):
        roles = {m["role"] for m in msgs}
        if "system" in roles:
            return Break(
                BreakReason.SYSTEM_MESSAGE_MOVES,
                "the deepseek-r1-distill template moves every system message to the top of the conversation",
                position=0,
            )
        # the marker where a message's text may have put it (or a tool output right after a user turn):
        # whether a tool output came before cannot be read
        if ("tool" in roles and not self._outputs_opened(prompt_ids)
                and OUTPUTS_BEGIN in self.tokenizer.decode(prompt_ids)):
            return Break(
                BreakReason.TEMPLATE_NOT_APPEND_ONLY,
                f"the deepseek-r1-distill template opens its tool outputs with {OUTPUTS_BEGIN} only for the "
                "conversation's first, and the previous prompt's text holds it where a message's text may "
                "have, so whether this one is the first cannot be read from the ids",
                position=len(prompt_ids) + len(completion),
            )
        if self.thinking_retention == "template":
            return Break(
                BreakReason.TEMPLATE_REWRITES_HISTORY,
                "the deepseek-r1-distill template re-renders earlier assistant turns without their reasoning "
                "and without the generation prompt's newline",
                position=len(prompt_ids),
            )
        return None
