"""The generic renderer's render recipes (renderers/recipes.py, GenericRenderer._render_by_recipe): a
conversation rendered again with other texts in the same shape gives transformers' token ids and the
attribution the full annotation gives, on every fixture template of test_generic_parity.

Each generated conversation is rendered three times in one renderer, each time with its texts
replaced (so the second and third renders can take the recipe built from the shape): plain words,
words with edge whitespace, digit-glued and multilingual text. (Text that spells an added token never
takes a recipe: the parity suites compare it in marker mode.) Ids are compared with
``apply_chat_template``; message indices, sampled mask and content flags with the renderer's own
full path (``_pieces`` + ``encode_pieces``, which the parity suites hold to the reference).
"""

from __future__ import annotations

import random

import jinja2
import pytest

import tito_renderers as renderers
from tito_renderers.generic import _tools
from tito_renderers.long_pieces import encode_pieces
from tito_renderers.messages import normalize_messages

from ._support import ours, reference
from .convgen import generate
from .test_generic_parity import CASES, GenericCase

TEXTS = [
    "plain words here", "42", "  padded both sides  ", "trailing newline\n", "x", "naïve 数据 🙂",
    "ERR: 7", "a\n\nb", "tool_response wrapped", "think twice",
]
SELECTED = ["qwen3", "qwen3-thinking-off", "qwen2.5", "qwen3-coder", "chatml", "r1-distill", "deepseek-v3",
            "llama-3.1", "nemotron-super", "gpt-oss"]


def retexted(messages: list[dict], rng: random.Random) -> list[dict]:
    """The same shape (a text stays a text), other texts."""
    out = []
    for m in messages:
        m = dict(m)
        for k in ("content", "reasoning_content"):
            if isinstance(m.get(k), str) and m[k].strip():
                m[k] = rng.choice(TEXTS)
        out.append(m)
    return out


def reference_ids(case: GenericCase, template: str, messages, tools, agp: bool) -> list[int] | None:
    try:
        out = reference(case.tokenizer).apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=agp, chat_template=template, **dict(case.kwargs))
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError):
        return None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("case", [c for c in CASES if c.id in SELECTED], ids=lambda c: c.id)
def test_recipe_renders_match_the_reference(case: GenericCase) -> None:
    template = case.template()
    r = renderers.create_renderer(ours(case.tokenizer).with_chat_template(template, case.id), name="generic",
                                  **dict(case.kwargs))
    rng = random.Random(case.seed)
    used = compared = 0
    recipe = r._render_by_recipe
    hits: list[bool] = []
    r._render_by_recipe = lambda *a: hits.append((out := recipe(*a)) is not None) or out
    for conv in generate(case.seed, 30):
        if any(not isinstance(m.get("content"), (str, type(None))) for m in conv.messages):
            continue  # content parts: not a recipe shape
        for agp in (False, True):
            for _ in range(3):
                messages = retexted(conv.messages, rng)
                want = reference_ids(case, template, messages, conv.tools, agp)
                if want is None:
                    continue
                hits.clear()
                got = r.render(messages, conv.tools, add_generation_prompt=agp)
                assert got.token_ids == want, (case.id, messages)
                if hits and hits[-1]:
                    used += 1
                    full = encode_pieces(r.tokenizer, r._pieces(normalize_messages(messages), _tools(conv.tools), agp))
                    assert (got.message_indices, got.sampled_mask, got.is_content) == (
                        full.message_indices, full.sampled_mask, full.is_content), (case.id, messages)
                compared += 1
    assert compared >= 40 and used >= 5, (case.id, compared, used)  # the recipe path was exercised
