"""The generic bridge where the probe finds a template not append-only: it renders the whole
conversation and bridges every turn whose full render extends the previous prompt + the completion as
sampled (renderers/full_bridge.py). Measured against transformers' full renders over multi-turn
conversations on real fixture tokenizers: no needless break (a Break where the reference's full render
does extend the previous ids), every bridge equal to the reference."""

from __future__ import annotations

from pathlib import Path

import pytest

import tito_renderers as renderers
from rollout.turns import SampledTurn
from tito_renderers import Break, BreakReason, Bridged

from .family_checks import Family, bridge_cases, sampled_completion
from .test_bridge import TOOLS, call
from .test_generic_bridge import plain_chat, tool_chat

VARIANT = Path(__file__).parent / "templates" / "test-variant-llama-3.1-system-at-last-user.jinja"


def long_chat(system: bool, rounds: int = 4) -> list[dict]:
    """User turns and single-call tool rounds in turn (Llama 3.1 takes one call per assistant turn)."""
    out = [{"role": "system", "content": "You are precise. Use the tool for arithmetic."}] if system else []
    for r in range(rounds):
        out.append({"role": "user", "content": f"Round {r}: what is {r}+{r * 3}? Ünïcode 数据 🙂"})
        out.append({"role": "assistant", "content": "", "tool_calls": [call(f"{r}+{r * 3}", r)]})
        out.append({"role": "tool", "tool_call_id": f"c{r}", "content": str(4 * r)})
        out.append({"role": "assistant", "content": f"It is {4 * r}."})
    out.append({"role": "user", "content": "Thanks, bye."})
    return out


# the measured set (docs/renderers.md); the test runs a smaller one
ALL_CONVS = [
    (plain_chat(False), None),
    (plain_chat(True), None),
    (tool_chat(False), TOOLS),
    (tool_chat(True), TOOLS),
    (long_chat(False), TOOLS),
    (long_chat(True), TOOLS),
    (long_chat(True), None),
]
CONVS = [(plain_chat(True), None), (tool_chat(False), TOOLS), (long_chat(True, 3), TOOLS)]


class VariantFamily(Family):
    @property
    def template(self) -> str:  # type: ignore[override]
        return VARIANT.read_text(encoding="utf-8")

    @property
    def tok(self) -> renderers.Tokenizer:  # type: ignore[override]
        from ._support import ours

        return ours(self.tokenizer).with_chat_template(self.template, VARIANT.stem)


# templates the probe flags not append-only for some role after an assistant turn (the measured set;
# the test runs the first, Llama 3.1 and the variant)
ALL_FAMILIES = [
    Family("deepseek-v3", "deepseek-v3", renderer_name="generic"),
    Family("deepseek-r1", "deepseek-r1", renderer_name="generic"),
    Family("llama-3.1", "llama-3.1-8b-instruct", renderer_name="generic"),
    Family("llama-3.2", "llama-3.2-3b-instruct", renderer_name="generic"),
    Family("llama-3.3", "llama-3.1-8b-instruct", "meta-llama-Llama-3.3-70B-Instruct.jinja", renderer_name="generic"),
    Family("nemotron-super", "llama-3.3-nemotron-super-49b-v1.5", renderer_name="generic"),
    Family("gpt-oss", "gpt-oss-20b", renderer_name="generic"),
    VariantFamily("variant-system-at-last-user", "llama-3.1-8b-instruct", renderer_name="generic"),
]
FAMILIES = [ALL_FAMILIES[0], ALL_FAMILIES[2], ALL_FAMILIES[-1]]


def measure(family: Family, convs=CONVS) -> dict:
    """Bridge every assistant turn followed by new messages, from the ids alone in a renderer that never
    saw the prompt ("ids": the previous prompt is transformers' render, so the conversation behind it
    must be recovered from its ids) and with the history given ("history"): breaks, needless breaks
    (the reference's full render does extend the previous ids) and exact bridges. Asserts every bridge
    keeps the previous ids and equals the reference wherever the reference is append-stable."""
    with_history = family.renderer()
    c = {"turns": 0, "breaks_ids": 0, "needless_ids": 0, "breaks_history": 0, "needless_history": 0, "exact": 0, "kept": 0}
    for case in bridge_cases(family, with_history, convs):
        prompt, completion, tools = case.prompt, case.completion, case.tools
        c["turns"] += 1
        from_ids = family.renderer().bridge(prompt, completion, case.new, tools)  # a fresh renderer each time
        given = with_history.bridge(prompt, completion, case.new, tools, history=case.messages[: case.k])
        for key, result in (("ids", from_ids), ("history", given)):
            if isinstance(result, Break):
                assert result.reason in set(BreakReason)
                c[f"breaks_{key}"] += 1
                c[f"needless_{key}"] += case.stable
                continue
            assert result.token_ids[: result.prefix_len] == prompt + completion
            if case.stable:
                assert result.token_ids == case.expected, f"[{family.id}] turn {case.k} ({key}) differs from the reference"
                assert not any(result.appended.sampled_mask)
                assert all(-1 <= i < len(case.new) for i in result.appended.message_indices)
                c["exact"] += key == "ids"
            else:
                c["kept"] += key == "ids"  # the splice keeps the sampled prefix where the template rewrites it
    return c


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES, ids=[f.id for f in ALL_FAMILIES])
def test_no_needless_breaks_from_ids_alone(family: Family) -> None:
    """Every template the probe flags not append-only, and the variant that moves the system prompt and
    tools to the last user message: called with ids only (as verifiers' TrainClient and prime-rl call),
    no turn breaks where the reference's full render extends the previous ids."""
    c = measure(family)
    print(family.id, c)
    assert c["needless_ids"] == 0 and c["needless_history"] == 0, c
    assert c["breaks_ids"] == c["breaks_history"], c  # ids alone bridge exactly what the history does
    assert c["exact"] >= 1, c
    if isinstance(family, VariantFamily):
        assert c["kept"] == 0 and c["breaks_ids"] > 0, c  # it does move the system block at new user turns


def rollout(r: renderers.Renderer, family: Family, messages: list[dict], tools) -> tuple[int, int]:
    """A rollout as the renderer service runs it: the first prompt rendered, then every turn bridged
    from ids alone (no history passed), re-rendered after a Break. Every prompt must equal the
    reference's. Returns (bridged turns, breaks)."""
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    prompt = r.render(messages[: turns[0]], tools, add_generation_prompt=True).token_ids
    bridged = breaks = 0
    for k in turns:
        nxt = next((j for j in range(k + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
        if nxt == k + 1 or nxt == len(messages) and k + 1 == len(messages):
            break
        completion = sampled_completion(r, prompt, family.reference_ids(messages[: k + 1], tools))
        assert completion is not None, f"[{family.id}] turn {k}: the reference does not extend the prompt"
        result = r.bridge(prompt, completion, messages[k + 1 : nxt], tools)
        expected = family.reference_ids(messages[:nxt], tools, agp=True)
        if isinstance(result, Break):
            breaks += 1
            prompt = r.render(messages[:nxt], tools, add_generation_prompt=True).token_ids
        else:
            bridged += 1
            prompt = result.token_ids
        assert prompt == expected, f"[{family.id}] turn {k}: {result}"
    return bridged, breaks


@pytest.mark.parametrize("family", [FAMILIES[0], FAMILIES[-1]], ids=["deepseek-v3", "variant-system-at-last-user"])
def test_rollouts_bridge_from_ids_alone(family: Family) -> None:
    """The renderer remembers the conversation behind each prompt it produced, so the service's calls
    (ids only) get the full-render bridge: DeepSeek V3's tool rounds never break, and the variant
    breaks only where the system prompt moves to a new last user message."""
    r = family.renderer()
    bridged, breaks = rollout(r, family, long_chat(False), TOOLS)
    # DeepSeek V3: every turn; the variant: the 4 tool results, never the 4 user turns that move the system block
    expected = (8, 0) if family.id == "deepseek-v3" else (4, 4)
    assert (bridged, breaks) == expected
    no_system_no_tools = [m for m in long_chat(False) if m["role"] in ("user", "assistant") and not m.get("tool_calls")]
    assert rollout(family.renderer(), family, no_system_no_tools, None) == (4, 0)


def test_ids_alone_bridge_and_ids_no_conversation_re_renders_to_break() -> None:
    """A fresh renderer given transformers' ids recovers the conversation behind them (the same roles and
    texts) and bridges as with the history; ids that spell the same text but are not the template's own
    tokenization (a client's char-by-char encoding) re-render to other ids: a Break that says so, never
    a bridge from a guess. A wrong history never bridges either."""
    from tito_renderers.recover import recover_conversations

    family = FAMILIES[0]
    r = family.renderer()
    messages = long_chat(True)
    k = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    prompt = family.reference_ids(messages[:k], TOOLS, agp=True)
    completion = sampled_completion(r, prompt, family.reference_ids(messages[: k + 1], TOOLS))
    expected = family.reference_ids(messages[: k + 2], TOOLS, agp=True)
    readings = recover_conversations(family.renderer(), prompt, TOOLS)
    assert len(readings) == 1
    recovered = readings[0]
    assert [(m["role"], m["content"]) for m in recovered] == [(m["role"], m["content"]) for m in messages[:k]]
    result = r.bridge(prompt, completion, messages[k + 1 : k + 2], TOOLS)
    assert isinstance(result, Bridged) and result.token_ids == expected

    user_text = messages[k - 1]["content"]
    n = len(r.tokenizer.encode(user_text))
    at = next(i for i in range(len(prompt)) if r.tokenizer.decode(prompt[i : i + n]) == user_text)
    by_char = [t for ch in user_text for t in r.tokenizer.encode(ch)]
    odd = prompt[:at] + by_char + prompt[at + n :]
    assert r.tokenizer.decode(odd) == r.tokenizer.decode(prompt) and odd != prompt
    fresh = family.renderer()
    assert recover_conversations(fresh, odd, TOOLS) == []
    brk = fresh.bridge(odd, completion, messages[k + 1 : k + 2], TOOLS)
    assert isinstance(brk, Break) and brk.reason is BreakReason.TEMPLATE_NOT_APPEND_ONLY
    assert "no conversation recovered from its ids re-renders to them" in brk.detail
    assert "depends on the earlier conversation" in brk.detail

    wrong = [dict(m, content=m["content"] + " (edited)") if m["role"] == "user" else m for m in messages[:k]]
    result = family.renderer().bridge(prompt, completion, messages[k + 1 : k + 2], TOOLS, history=wrong)
    assert isinstance(result, Break) and result.reason is BreakReason.TEMPLATE_NOT_APPEND_ONLY
    assert "previous prompt" in result.detail and result.position < len(prompt)
    ok = r.bridge(prompt, completion, messages[k + 1 : k + 2], TOOLS, history=messages[:k])
    assert isinstance(ok, Bridged) and ok.token_ids == expected
    cut = r.bridge(prompt, completion[:-1], messages[k + 1 : k + 2], TOOLS, history=messages[:k])  # truncated
    assert isinstance(cut, Bridged) and cut.synthesized == 1 and cut.token_ids == ok.token_ids


def test_an_empty_previous_prompt_is_refused() -> None:
    """As the PyPI renderers library does: there is no rendered conversation to extend."""
    for family in (FAMILIES[0], Family("qwen3", "qwen3-0.6b")):
        r = family.renderer()
        user = [{"role": "user", "content": "hi"}]
        completion = r.render_ids([*user, {"role": "assistant", "content": "yo"}])[-4:]
        brk = r.bridge([], completion, user)
        assert isinstance(brk, Break) and brk.reason is BreakReason.EMPTY_PREVIOUS_PROMPT, (family.id, brk)
        assert "previous prompt is empty" in brk.detail and brk.position == len(completion)


def test_conversation_memory_is_exact_and_bounded() -> None:
    """Prompts sharing a key (length and last ids) are never confused; a bridge's entry chains to its
    parent's; the oldest entries go first."""
    from tito_renderers.conversations import Conversations

    def parse(ids):
        return {"role": "assistant", "content": f"sampled {ids}"}

    mem = Conversations(max_bytes=4000)
    a, b = [1] * 40 + [5] * 32, [2] * 40 + [5] * 32  # the same key
    user_a, user_b, tool = {"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "tool", "content": "t"}
    mem.remember(a, [user_a], None, {})
    assert mem.recall(b, None, {}, parse) is None
    assert mem.recall(a, None, {}, parse) == [user_a]
    assert mem.recall(a, [], {}, parse) is None and mem.recall(a, None, {"enable_thinking": False}, parse) is None
    mem.extend(a, [7], [8, 9], [tool], None, {})  # completion [7], then the tool's ids
    mem.remember(b, [user_b], None, {})  # takes a's key: a's chain keeps its own link
    assert mem.recall([*a, 7, 8, 9], None, {}, parse) == [user_a, parse([7]), tool]
    assert mem.recall(b, None, {}, parse) == [user_b]
    mem.extend([9, 9], [1], [], [tool], None, {})  # an unknown prompt: nothing kept
    assert mem.recall([9, 9, 1], None, {}, parse) is None
    assert mem.bytes <= mem.max_bytes
    big = {"role": "user", "content": "x" * 1500}
    for k in range(2):
        mem.remember([100 + k], [big], None, {})
    assert mem.recall(b, None, {}, parse) is None  # evicted: bounded by bytes, not count
    assert mem.recall([101], None, {}, parse) == [big] and 3000 < mem.bytes <= mem.max_bytes
    mem.remember([7], [{"role": "user", "content": "y" * 5000}], None, {})  # larger than the whole budget
    assert mem.recall([7], None, {}, parse) is None and mem.recall([101], None, {}, parse) == [big]


def test_the_renderer_service_bridges_with_the_history_it_holds() -> None:
    """The service passes its own conversation (a view, not a copy) to the bridge, so a template that is
    not append-only bridges without the renderer remembering or recovering anything."""
    from rollout.renderer_service import RendererService

    from ._support import tokenizer_dir

    family = FAMILIES[0]
    svc = RendererService(str(tokenizer_dir(family.tokenizer)), renderer_name="generic")
    messages = long_chat(True)
    k = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    prompt = svc.begin("r0", messages[:k], TOOLS).ids
    assert prompt == family.reference_ids(messages[:k], TOOLS, agp=True)
    svc.renderer._conversations.__init__()  # forget the first prompt: only the history can help now
    seen = []
    bridge = svc.renderer.bridge
    svc.renderer.bridge = lambda *a, **kw: seen.append((kw["history"], list(kw["history"]))) or bridge(*a, **kw)
    import tito_renderers.generic_bridge as generic_bridge

    recover, generic_bridge.recover_conversations = generic_bridge.recover_conversations, lambda *a: []
    try:
        completion = sampled_completion(svc.renderer, prompt, family.reference_ids(messages[: k + 1], TOOLS))
        svc.record_turn("r0", SampledTurn(0, completion, None, 0, messages[k]))
        nxt = svc.bridge_next("r0", messages[k + 1 : k + 2], 1)
        kind, ids, brk = nxt.kind, nxt.ids, nxt.brk
    finally:
        generic_bridge.recover_conversations = recover
    assert (kind, brk) == ("append", None)
    assert prompt + completion + ids == family.reference_ids(messages[: k + 2], TOOLS, agp=True)
    ((view, history),) = seen
    assert history == messages[:k] and view._messages is svc.rollouts["r0"].messages
    assert svc.renderer._conversations.bytes == 0  # nothing kept: the service holds the conversation
