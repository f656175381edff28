"""ChatML and SmolLM2-Instruct: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message.

Both templates render only role and content: reasoning and tool calls on an assistant message are
not rendered (the template ignores them), and a message without content is rejected.
"""

from __future__ import annotations

from importlib import resources

from .base import Renderer, TemplateRejected
from .pieces import PieceWriter

CHATML_TEMPLATE = resources.files(__package__).joinpath("templates/chatml.jinja").read_text(encoding="utf-8")
SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _require_content(m: dict, i: int, family: str) -> str:
    if "content" not in m:
        raise TemplateRejected(f"message {i}: the {family} template needs content on every message (got none)")
    return m["content"]


class ChatMLRenderer(Renderer):
    """Plain ChatML (the canonical template in renderers/templates/chatml.jinja)."""

    name = "chatml"
    template_hashes = ("2eefca287a0f008b170ce31bc2c4dabb398a64eb74716bf64db5d9a21da50da9",)
    turn_close = "<|im_end|>"
    after_close = "\n"
    supports_tools = False  # the template renders role and content only
    default_system: str | None = None

    def _message(self, p: PieceWriter, m: dict, i: int) -> None:
        text = _require_content(m, i, self.name)
        assistant = m["role"] == "assistant"
        p.special("<|im_start|>", i)
        p.scaffold(m["role"] + "\n", i)
        p.text(text, i, sampled=assistant)
        p.special("<|im_end|>", i, sampled=assistant)
        p.scaffold("\n", i)

    def _render(self, p, msgs, tools, add_generation_prompt):
        if self.default_system is not None and msgs[0]["role"] != "system":
            p.special("<|im_start|>")
            p.scaffold("system\n")
            p.scaffold(self.default_system)
            p.special("<|im_end|>")
            p.scaffold("\n")
        for i, m in enumerate(msgs):
            self._message(p, m, i)
        if add_generation_prompt:
            self._generation_prompt(p)

    def _continue(self, p, msgs, tools, prompt_ids, completion):
        for i, m in enumerate(msgs):
            self._message(p, m, i)
        self._generation_prompt(p)

    def _generation_prompt(self, p: PieceWriter) -> None:
        p.special("<|im_start|>")
        p.scaffold("assistant\n")


class SmolLM2Renderer(ChatMLRenderer):
    """SmolLM2-Instruct: ChatML that adds its default system message when the first message is not one."""

    name = "smollm2"
    template_hashes = ("872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",)
    default_system = SMOLLM2_DEFAULT_SYSTEM
