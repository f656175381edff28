"""The generic renderer's bridge: equal to transformers' full render wherever the template is
append-stable (tests.family_checks.check_bridge_contract), the same tokens as the hand-coded
renderers' bridges, and an honest Break where it cannot extend."""

from __future__ import annotations

import jinja2
import pytest

import tito_renderers as renderers
from tito_renderers import Break, BreakReason, Bridged

from .family_checks import Family, check_bridge_contract, sampled_completion
from .test_bridge import TOOLS, call


def plain_chat(system: bool) -> list[dict]:
    head = [{"role": "system", "content": "Be terse."}] if system else []
    return head + [
        {"role": "user", "content": "Pick a number."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": " Double it\n"},
        {"role": "assistant", "content": "14 "},
        {"role": "user", "content": "再来 🙂"},
        {"role": "assistant", "content": "28."},
        {"role": "user", "content": "Thanks!"},
    ]


def tool_chat(reasoning: bool) -> list[dict]:
    r = {"reasoning_content": "I should use the tool."} if reasoning else {}
    return [
        {"role": "system", "content": "You are precise."},
        {"role": "user", "content": "What is (3+4)*5 and 2**10?"},
        {"role": "assistant", "content": "", **r, "tool_calls": [call("3+4")]},
        {"role": "tool", "tool_call_id": "c0", "content": "7"},
        {"role": "assistant", "content": "Next.", "tool_calls": [call("7*5", 1), call("2**10", 2)]},
        {"role": "tool", "tool_call_id": "c1", "content": "35"},
        {"role": "tool", "tool_call_id": "c2", "content": "1024"},
        {"role": "assistant", "content": "35 and 1024.", **r},
        {"role": "user", "content": "  Thanks! And\r\n 1+1?  "},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Bye"},
    ]


def renderable(family: Family, convs: list[tuple[list[dict], object]]) -> list[tuple[list[dict], object]]:
    """The conversations whose every prefix the reference renders (some templates reject tool roles)."""
    out = []
    for messages, tools in convs:
        try:
            for k in range(1, len(messages) + 1):
                family.reference_text(messages[:k], tools, agp=True)
        except (jinja2.TemplateError, TypeError):
            continue
        out.append((messages, tools))
    return out


ALL_CONVS = [(plain_chat(False), None), (plain_chat(True), None), (tool_chat(False), TOOLS), (tool_chat(True), TOOLS), (tool_chat(False), None)]

FAMILIES = [
    (Family("chatml", "qwen2.5-7b-instruct", renderer_name="generic"), 8),
    # Qwen3 renders an empty think block in the last assistant turn and drops it once a message follows:
    # the reference is append-stable only after turns with tool calls
    (Family("qwen3", "qwen3-0.6b", renderer_name="generic"), 1),
    (Family("qwen3-thinking-off", "qwen3-0.6b", renderer_name="generic", kwargs={"enable_thinking": False}), 0),
    (Family("qwen2.5", "qwen2.5-7b-instruct", renderer_name="generic"), 8),
    (Family("qwen3-coder", "qwen3-coder-30b-a3b-instruct", renderer_name="generic"), 8),
    (Family("llama-3.1", "llama-3.1-8b-instruct", renderer_name="generic"), 6),
    (Family("llama-3.2", "llama-3.2-3b-instruct", renderer_name="generic"), 6),
    (Family("llama-3.3", "llama-3.1-8b-instruct", "meta-llama-Llama-3.3-70B-Instruct.jinja", renderer_name="generic"), 6),
    (Family("nemotron-super", "llama-3.3-nemotron-super-49b-v1.5", renderer_name="generic"), 6),
    (Family("gemma-3", "gemma-3-it", renderer_name="generic"), 6),
    (Family("deepseek-v3", "deepseek-v3", renderer_name="generic"), 6),
    (Family("deepseek-r1", "deepseek-r1", renderer_name="generic"), 3),
    (Family("r1-distill", "deepseek-r1-distill-qwen-32b", renderer_name="generic"), 0),  # never append-stable
    (Family("gpt-oss", "gpt-oss-20b", renderer_name="generic"), 0),
]


@pytest.mark.parametrize("family,min_exact", FAMILIES, ids=[f.id for f, _ in FAMILIES])
def test_bridge_contract(family: Family, min_exact: int) -> None:
    convs = renderable(family, ALL_CONVS)
    counts = check_bridge_contract(family, convs, min_exact=min_exact)
    print(family.id, counts)


# ---- the same tokens as the hand-coded renderers ---------------------------------------------------

HAND_CODED = [
    ("chatml", "qwen2.5-7b-instruct", "chatml", {}),
    ("qwen3", "qwen3-0.6b", None, {}),
    ("qwen3-thinking-off", "qwen3-0.6b", None, {"enable_thinking": False}),
    ("qwen2.5", "qwen2.5-7b-instruct", None, {}),
    ("qwen3-coder", "qwen3-coder-30b-a3b-instruct", None, {}),
    ("llama-3.1", "llama-3.1-8b-instruct", None, {}),
    ("llama-3.2", "llama-3.2-3b-instruct", None, {}),
    ("nemotron-super", "llama-3.3-nemotron-super-49b-v1.5", None, {}),
    ("gemma-3", "gemma-3-it", None, {}),
    ("deepseek-v3", "deepseek-v3", None, {}),
    ("deepseek-r1", "deepseek-r1", None, {}),
    ("gpt-oss", "gpt-oss-20b", None, {}),
]


def _turns(hand: renderers.Renderer, messages: list[dict], tools):
    """(prompt, completion, new messages) for every assistant turn, as the hand-coded renderer renders them."""
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        nxt = next((j for j in range(k + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
        if nxt == k + 1:
            continue
        try:
            prompt = hand.render_ids(messages[:k], tools, add_generation_prompt=True)
            full = hand.render_ids(messages[: k + 1], tools)
        except ValueError:
            continue
        completion = sampled_completion(hand, prompt, full)
        if completion is not None:
            yield prompt, completion, messages[k + 1 : nxt]


@pytest.mark.parametrize("fid,fixture,template,kwargs", HAND_CODED, ids=[h[0] for h in HAND_CODED])
def test_bridge_tokens_equal_the_hand_coded_renderers(fid, fixture, template, kwargs) -> None:
    """Wherever both bridge, the generic renderer appends exactly the hand-coded renderer's tokens,
    for clean stops and for truncated completions; it breaks only with a documented reason where the
    hand-coded one knows more (a family's conversation-wide state) and never extends where that one
    breaks for the template's own structure."""
    from ._support import ours

    tok = ours(fixture)
    if template == "chatml":
        from tito_renderers.chatml import CHATML_TEMPLATE

        tok = tok.with_chat_template(CHATML_TEMPLATE, "chatml")
    hand = renderers.create_renderer(tok, **kwargs)
    generic = renderers.create_renderer(tok, name="generic", **kwargs)
    assert hand.name != "generic"
    counts = {"same": 0, "generic_break": 0, "both_break": 0, "truncated": 0}
    for messages, tools in ALL_CONVS:
        tools = tools if hand.capabilities.tools else None
        for prompt, completion, new in _turns(hand, messages, tools):
            for cut in (completion, completion[:-1]):
                a = hand.bridge(prompt, cut, new, tools)
                b = generic.bridge(prompt, cut, new, tools)
                if isinstance(a, Bridged) and isinstance(b, Bridged):
                    assert b.token_ids == a.token_ids, f"[{fid}] bridge differs from {hand.name}: {b} vs {a}"
                    assert b.synthesized == a.synthesized and b.prefix_len == a.prefix_len
                    assert all(-1 <= i < len(new) for i in b.appended.message_indices)
                    assert not any(b.appended.sampled_mask)
                    counts["truncated" if cut is not completion else "same"] += 1
                elif isinstance(b, Break) and isinstance(a, Bridged):
                    assert b.reason in (BreakReason.TEMPLATE_NOT_APPEND_ONLY, BreakReason.NO_SPECIAL_TOKEN_ANCHOR), b
                    counts["generic_break"] += 1
                elif isinstance(b, Break):
                    counts["both_break"] += 1
                else:
                    pytest.fail(f"[{fid}] the generic renderer extended where {hand.name} breaks: {a}")
    print(fid, counts)
    assert counts["same"] >= 2, counts


@pytest.mark.parametrize("fixture", ["qwen3-0.6b", "gpt-oss-20b", "llama-3.1-8b-instruct", "gemma-3-it"])
def test_bridge_never_raises_on_garbage_completions(fixture: str) -> None:
    """Random ids (biased to the added tokens) as the previous completion: a Bridged that keeps the
    prefix, or a Break with a documented reason; never an exception."""
    import random

    from ._support import ours

    tok = ours(fixture)
    r = renderers.create_renderer(tok, name="generic")
    rng = random.Random(5)
    specials = sorted(tok.added_tokens.values())
    prompt = r.render_ids([{"role": "user", "content": "q"}], add_generation_prompt=True)
    new = [{"role": "user", "content": "next"}]
    kinds = set()
    for _ in range(150):
        completion = [rng.choice(specials) if rng.random() < 0.4 else rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 12))]
        result = r.bridge(prompt, completion, new)
        if isinstance(result, Bridged):
            assert result.token_ids[: result.prefix_len] == prompt + completion
        else:
            assert result.reason in set(BreakReason)
        kinds.add(type(result).__name__)
    assert "Bridged" in kinds


@pytest.mark.parametrize("fixture", ["qwen3-0.6b", "llama-3.1-8b-instruct", "gpt-oss-20b", "gemma-3-it"])
def test_splice_recipes_give_the_full_splices_tokens_and_attribution(fixture: str, monkeypatch) -> None:
    """The splice's per-shape recipe (one render instead of two plus the annotation) gives exactly what the
    full splice gives: ids, message indices, content flags, for texts with and without edge whitespace, a
    text glued to template letters, and texts the recipe must refuse (markers, private-use characters)."""
    family = Family(fixture, fixture, renderer_name="generic")
    fast = family.renderer()
    texts = ["7", "  35 and\\n 1024\n\n", "x ", "\nlines\nof output", "a <|im_end|> b", "\U000f8300 private", "é中文🙂"]
    cases = 0
    for messages, tools in renderable(family, [(tool_chat(False), TOOLS), (plain_chat(True), None)]):
        for k, m in enumerate(messages):
            if m["role"] != "assistant" or k + 1 >= len(messages) or messages[k + 1]["role"] == "assistant":
                continue
            prompt = family.reference_ids(messages[:k], tools, agp=True)
            completion = sampled_completion(fast, prompt, family.reference_ids(messages[: k + 1], tools))
            if completion is None:
                continue
            for text in texts:
                new = [dict(messages[k + 1], content=text)]
                got = fast.bridge(prompt, completion, new, tools)
                with monkeypatch.context() as mp:
                    mp.setattr(type(fast), "_splice_by_recipe", lambda *a: None)
                    want = family.renderer().bridge(prompt, completion, new, tools)
                assert type(got) is type(want), (text, got, want)
                if isinstance(want, Break):
                    assert got.reason is want.reason
                    continue
                cases += 1
                assert got.token_ids == want.token_ids and got.synthesized == want.synthesized, text
                for f in ("message_indices", "is_content", "sampled_mask"):
                    assert getattr(got.appended, f) == getattr(want.appended, f), (text, f)
    assert cases >= len(texts)
    assert any(recipe is not False for recipe in fast._recipes.values())  # the recipes were used
