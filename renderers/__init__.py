"""tito_renderers: conversation <-> token ids, exactly as each model's chat template, with attribution.

tok = load_tokenizer("path/to/tokenizer-dir-or.gguf")
r = create_renderer(tok)                 # chosen by the template's sha256
prompt = r.render(messages, add_generation_prompt=True)
parsed = r.parse_response(completion_ids, prompt.token_ids)
nxt = r.bridge(prompt.token_ids, completion_ids, new_messages)   # Bridged | Break
"""

if __name__ == "renderers":  # this source directory found under its old top-level name: see _toplevel.py
    from ._toplevel import hand_over

    hand_over()
else:
    from .base import EFFORT_LEVELS, Renderer, TemplateRejected, nearest_effort
    from .dialects.json_calls import parse_json_call
    from .messages import MessageError, normalize_messages
    from .registry import RENDERERS, UnknownTemplateError, create_renderer, select_renderer
    from .tokenizer import Tokenizer, TokenizerLoadError, load_tokenizer
    from .training import build_training_sample
    from .types import (
        Break,
        BreakReason,
        Bridged,
        Capabilities,
        ParsedResponse,
        RenderedTokens,
        ToolCall,
        ToolCallStatus,
        TrainingSample,
    )

__all__ = [
    "EFFORT_LEVELS",
    "Capabilities",
    "RENDERERS",
    "Break",
    "BreakReason",
    "Bridged",
    "MessageError",
    "ParsedResponse",
    "RenderedTokens",
    "Renderer",
    "TemplateRejected",
    "Tokenizer",
    "TokenizerLoadError",
    "ToolCall",
    "ToolCallStatus",
    "TrainingSample",
    "UnknownTemplateError",
    "build_training_sample",
    "create_renderer",
    "load_tokenizer",
    "nearest_effort",
    "normalize_messages",
    "parse_json_call",
    "select_renderer",
]
