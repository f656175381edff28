"""Choosing a renderer: by the sha256 of the chat template text, never by model name."""

from __future__ import annotations

from typing import Any

from .base import Renderer
from .chatml import ChatMLRenderer, SmolLM2Renderer
from .deepseek_r1_distill import DeepSeekR1DistillRenderer
from .deepseek_v3 import DeepSeekR1Renderer, DeepSeekV3Renderer
from .gemma3 import Gemma3Renderer
from .generic import GenericRenderer
from .harmony import HarmonyRenderer
from .llama3 import Llama31Renderer, Llama32Renderer
from .llama3_nemotron import NemotronSuperRenderer
from .qwen import Qwen3Renderer, Qwen25Renderer
from .qwen3_coder import Qwen3CoderRenderer
from .tokenizer import Tokenizer

RENDERERS: dict[str, type[Renderer]] = {
    cls.name: cls
    for cls in (
        ChatMLRenderer,
        SmolLM2Renderer,
        Qwen3Renderer,
        Qwen25Renderer,
        Qwen3CoderRenderer,
        DeepSeekR1DistillRenderer,
        DeepSeekV3Renderer,
        DeepSeekR1Renderer,
        Llama31Renderer,
        Llama32Renderer,
        NemotronSuperRenderer,
        Gemma3Renderer,
        HarmonyRenderer,
        GenericRenderer,  # claims no hash: chosen for every template the others do not claim
    )
}
BY_TEMPLATE_HASH: dict[str, type[Renderer]] = {h: cls for cls in RENDERERS.values() for h in cls.template_hashes}


class UnknownTemplateError(ValueError):
    """The tokenizer has no chat template to render."""


def select_renderer(tokenizer: Tokenizer, name: str | None = None) -> tuple[type[Renderer], str]:
    """The renderer class for a tokenizer and a sentence saying why it was chosen."""
    if name is not None:
        try:
            cls = RENDERERS[name]
        except KeyError:
            raise ValueError(f"unknown renderer {name!r}; known: {', '.join(sorted(RENDERERS))}") from None
        return cls, f"forced by name={name!r}"
    digest = tokenizer.template_sha256
    if digest is None:
        raise UnknownTemplateError(
            f"{tokenizer.name_or_path} has no chat template; pass name= to choose a renderer "
            f"({', '.join(sorted(RENDERERS))})"
        )
    cls = BY_TEMPLATE_HASH.get(digest)
    if cls is None:  # a template no hand-coded renderer was verified against: render the template itself
        return GenericRenderer, (
            f"no hand-coded renderer is verified for sha256 {digest} (the chat template of "
            f"{tokenizer.name_or_path}); rendering with the generic template renderer"
        )
    return cls, f"template sha256 {digest[:16]}… is verified for {cls.name}"


def create_renderer(
    tokenizer: Tokenizer, *, name: str | None = None, thinking_retention: str = "keep", **template_kwargs: Any
) -> Renderer:
    """The renderer for ``tokenizer``: chosen by its template's sha256, or forced with ``name``."""
    cls, _ = select_renderer(tokenizer, name)
    return cls(tokenizer, thinking_retention=thinking_retention, **template_kwargs)
