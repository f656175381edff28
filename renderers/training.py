"""Training samples from a finished conversation (SFT data, and the tests' reference for loss masks)."""

from __future__ import annotations

from typing import Any

from .base import Renderer
from .types import TrainingSample


def build_training_sample(
    renderer: Renderer, messages: Any, tools: Any = None, *, train_on: str = "all_assistant"
) -> TrainingSample:
    """Render ``messages`` and mark the tokens to train on.

    ``train_on="all_assistant"`` trains every assistant turn's sampled tokens (its text, tool calls
    and end marker, not its header); ``"last_assistant"`` only the last assistant message's.
    """
    if train_on not in ("all_assistant", "last_assistant"):
        raise ValueError(f"train_on must be 'all_assistant' or 'last_assistant', got {train_on!r}")
    rendered = renderer.render(messages, tools, add_generation_prompt=False)
    mask = list(rendered.sampled_mask)
    if train_on == "last_assistant":
        assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        last = assistants[-1] if assistants else None
        mask = [s and mi == last for s, mi in zip(mask, rendered.message_indices)]
    return TrainingSample(token_ids=rendered.token_ids, loss_mask=mask, message_indices=rendered.message_indices)
