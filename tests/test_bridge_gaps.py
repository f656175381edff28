"""The ids-only bridge on templates no other test was written for (tests/bridge_gaps.py): a sample of the
corpus, and the ``[INST]`` cases behind issue 32 (an empty generation prompt; the system prompt and tool
list moved into the last user message). Every expected id comes from transformers' apply_chat_template;
the deeper sweep is scripts/measure_bridge_gaps.py (figures in docs/renderers.md)."""

from __future__ import annotations

import pytest

import tito_renderers as renderers
from tito_renderers import Break, BreakReason, Bridged

from .bridge_gaps import TOOL_DEFS, Entry, corpus, measure

CORPUS = {e.id: e for e in corpus()}
# the sample the suite runs (each a few conversations; the script runs every entry with more)
SAMPLE = [
    "mistral-v1", "mistral-v2", "mistral-v3", "mistral-v7", "mistral-v11", "mistral-v13-think", "mistral-v7-spm",
    "llama-2", "llama-2-on-llama-3-vocab", "mistral-v3+nl-after-markers", "mistral-v1+system-at-last",
    "llama-2+system-at-last", "llama-3.1+no-gp", "llama-3.1",
    # mistral-common's own shipped tokenizer files (tests/shipped_mistral.py)
    "mistral-v2-spm@spm-v2", "mistral-v7-spm@spm-v7", "mistral-v3@tekken-240718",
    "mistral-v3@spm-v1-text", "mistral-v7@spm-v1-text",  # [INST] as plain text: issue 43
]


@pytest.mark.parametrize("entry_id", SAMPLE)
def test_no_needless_break_nor_wrong_bridge_from_ids_alone(entry_id: str) -> None:
    """No turn breaks where transformers' render with the new messages extends the previous prompt +
    completion; every bridge equals that render; no bridge where it does not (a drift)."""
    c = measure(CORPUS[entry_id], seed=11, n=3)
    print(entry_id, c)
    assert c["needless"] == 0 and c["wrong"] == 0 and c["drift"] == 0 and c["unequal"] == 0, c
    assert c["exact"] >= 1, c


def _ids(entry: Entry, messages: list[dict], tools=None, agp: bool = True) -> list[int]:
    return entry.reference_ids(messages, tools, agp)


def _turn(entry: Entry, history: list[dict], reply: dict, tools=None) -> tuple[list[int], list[int]]:
    """Transformers' prompt before ``reply`` and the ids the model sampled for it (through its stop)."""
    prompt = _ids(entry, history, tools)
    full = _ids(entry, [*history, reply], tools, agp=False)
    assert full[: len(prompt)] == prompt
    return prompt, full[len(prompt):]


@pytest.mark.parametrize("entry_id", ["mistral-v3", "mistral-v2", "llama-2", "mistral-v3-spm@spm-v3"])
def test_the_simplest_turn_bridges_from_ids(entry_id: str) -> None:
    """Issue 32's case: user "What is 2+2?" -> "4</s>" -> user "And 3+3?" on a template whose generation
    prompt is empty (with tools, Mistral v2/v3 move the tool list: see the next test). On Mistral's
    SentencePiece v3 file the prompt's ids decode to ``[INST]  What`` (the dummy prefix of the run after
    ``[INST]``): recovery reads the runs between added tokens instead."""
    entry = CORPUS[entry_id]
    user, reply, new = ({"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                        {"role": "user", "content": "And 3+3?"})
    prompt, completion = _turn(entry, [user], reply)
    result = entry.renderer().bridge(prompt, completion, [new])
    assert isinstance(result, Bridged), result
    assert result.token_ids == _ids(entry, [user, reply, new])


@pytest.mark.parametrize("entry_id", ["mistral-v3-spm@spm-v3", "mistral-v3"])
def test_a_tool_result_after_a_finished_tool_round_bridges_from_ids(entry_id: str) -> None:
    """The prompt holds a finished tool round, the model calls a tool again, the tool answers. Mistral v3
    rejects the probe's reply with both text and calls, so the bridge recovers the conversation from the
    prompt's ids; on SentencePiece the reply head " " after ``[/INST]`` is absent before ``[TOOL_CALLS]``
    and the recovery walk must not require it. A tool result that reads as a number is written without
    the quotes the walk's sentinel text gets."""
    entry = CORPUS[entry_id]

    def call(i: str) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"abcDEF12{i}", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]}

    # a result that reads as a number is written outside the JSON string's quotes: {"content": 4, ...}
    for answer in ('{"r": "ok"}', "4"):
        history = [{"role": "user", "content": "What is 2+2?"}, call("3"),
                   {"role": "tool", "tool_call_id": "abcDEF123", "content": answer},
                   {"role": "assistant", "content": "It is 4"}, {"role": "user", "content": "And 3+3?"}]
        new = {"role": "tool", "tool_call_id": "abcDEF124", "content": "6"}
        prompt, completion = _turn(entry, history, call("4"), TOOL_DEFS)
        result = entry.renderer().bridge(prompt, completion, [new], TOOL_DEFS)
        assert isinstance(result, Bridged), (answer, result)
        assert result.token_ids == _ids(entry, [*history, call("4"), new], TOOL_DEFS)


def test_a_tool_call_after_a_sampled_assistant_header_bridges() -> None:
    """Llama 3.1 with its generation prompt removed: the model samples the assistant header itself, then
    a tool call. The re-render writes the header again, so the sampled turn is parsed after it (Probe.
    reply_head), else the call reads as text and the full render differs from the sampled ids."""
    entry = CORPUS["llama-3.1+no-gp"]
    history = [{"role": "user", "content": "What is 2+2?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}]}
    new = {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"r": "ok"}'}
    prompt, completion = _turn(entry, history, call, TOOL_DEFS)
    result = entry.renderer().bridge(prompt, completion, [new], TOOL_DEFS)
    assert isinstance(result, Bridged), result
    assert result.token_ids == _ids(entry, [*history, call, new], TOOL_DEFS)


@pytest.mark.parametrize("text", ["\nLet me search.", "Let me search.\n\n", "Let me search. "])
@pytest.mark.parametrize("entry_id", ["qwen2.5+space-before-markers", "qwen2.5"])
def test_a_reply_with_whitespace_around_its_text_before_a_tool_call_bridges(entry_id: str, text: str) -> None:
    """A reply with text and a tool call, the text opening or ending with whitespace, in the prompt's
    history. Qwen2.5 with a space before its markers closes no turn on an added token alone
    (`` <|im_end|>``), so every bridge from ids recovers the conversation; the parse strips the text, and
    the proof by re-render failed until the whitespace was restored (renderers/full_bridge.py
    ``exact_texts``: how much of the whitespace before the call is the template's own ``"\n"`` is
    decided by rendering)."""
    entry = CORPUS[entry_id]
    opening = {"role": "assistant", "content": text, "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}]}
    history = [{"role": "user", "content": "Find x."}, opening,
               {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"r": "ok"}'}]
    reply, new = {"role": "assistant", "content": "Found it."}, {"role": "user", "content": "Thanks."}
    prompt, completion = _turn(entry, history, reply, TOOL_DEFS)
    renderer = entry.renderer()
    stop = max(i for i, t in enumerate(completion) if t in renderer.stop_token_ids)
    completion = completion[: stop + 1]  # what the model sampled: through its stop token, not the "\n" after
    result = renderer.bridge(prompt, completion, [new], TOOL_DEFS)
    assert isinstance(result, Bridged), result
    assert result.token_ids == _ids(entry, [*history, reply, new], TOOL_DEFS)


def test_a_moved_system_prompt_or_tool_list_still_breaks() -> None:
    """Mistral v3 moves the system prompt and the tool list to the new last user message: transformers'
    render does not extend the previous ids, and the ids-only bridge says so."""
    entry = CORPUS["mistral-v3"]
    history = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}]
    reply, new = {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}
    for h, tools in ((history, None), (history[1:], TOOL_DEFS)):
        prompt, completion = _turn(entry, h, reply, tools)
        expected = _ids(entry, [*h, reply, new], tools)
        assert expected[: len(prompt) + len(completion)] != prompt + completion  # a genuine drift
        result = entry.renderer().bridge(prompt, completion, [new], tools)
        assert isinstance(result, Break) and result.reason is BreakReason.TEMPLATE_NOT_APPEND_ONLY, result
        # (with the system prompt, the ids also read as one user text "Be terse.\n\nWhat is 2+2?")
        assert "differs from the previous tokens" in result.detail or "re-render exactly from" in result.detail
        # a tool result keeps the last user message where it is: that turn bridges
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "abcDEF123", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}]}
        if tools:
            prompt, completion = _turn(entry, h, call, tools)
            result = entry.renderer().bridge(prompt, completion, [{"role": "tool", "tool_call_id": "abcDEF123", "content": "7"}], tools)
            assert isinstance(result, Bridged), result


def test_ids_that_fit_two_conversations_break() -> None:
    """Mistral v3 renders a system prompt as ``system + "\\n\\n"`` before the last user text, so a user
    text holding "\\n\\n" has the same ids as a system prompt and a shorter user text. With a new user
    message transformers renders the two differently: no ids-only bridge is right for both, and the
    bridge breaks rather than guess. A tool result, rendered alike after both, bridges."""
    entry = CORPUS["mistral-v3"]
    plain = [{"role": "user", "content": "Summarize:\n\nthe text"}]
    with_system = [{"role": "system", "content": "Summarize:"}, {"role": "user", "content": "the text"}]
    reply, new = {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}
    prompt, completion = _turn(entry, plain, reply)
    assert _turn(entry, with_system, reply) == (prompt, completion)  # the same ids
    renders = {tuple(_ids(entry, [*h, reply, new])) for h in (plain, with_system)}
    assert len(renders) == 2  # ... that transformers continues differently
    result = entry.renderer().bridge(prompt, completion, [new])
    assert isinstance(result, Break) and "re-render exactly from 2 conversations" in result.detail, result
    assert entry.renderer().bridge(prompt, completion, [new], history=plain).token_ids == _ids(entry, [*plain, reply, new])


def test_mistral_call_ids_survive_the_parse() -> None:
    """A re-render of a sampled tool-call turn writes the model's call id back (v3: the ``"id"`` field;
    v11: ``[CALL_ID]``); Mistral's templates reject any id but 9 alphanumerics."""
    for entry_id in ("mistral-v3", "mistral-v11"):
        entry = CORPUS[entry_id]
        r = entry.renderer()
        call = {"id": "abcDEF123", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
        _, completion = _turn(entry, [{"role": "user", "content": "hi"}], {"role": "assistant", "content": "",
                                                                           "tool_calls": [call]}, TOOL_DEFS)
        message = r.parse_response(completion, tools=TOOL_DEFS).to_message()
        assert [c["id"] for c in message["tool_calls"]] == ["abcDEF123"], (entry_id, message)


def test_int_and_float_filters_default_as_jinja2() -> None:
    """minijinja's ``int`` / ``float`` raise on text that is no number; Jinja2's (transformers') give 0."""
    from tito_renderers.template_env import ChatTemplate

    source = "{% for m in messages %}{{ m.content|int }} {{ m.content|float }} {{ m.content|int(-1) }};{% endfor %}"
    msgs = [{"role": "user", "content": c} for c in ("abc", "42", "3.5", "", "1e3")]
    ours = ChatTemplate(source).render(msgs)
    import jinja2

    assert ours == jinja2.Environment().from_string(source).render(messages=msgs)
    assert renderers  # (the package import is what the test exercises)


@pytest.mark.parametrize("name", ["spm-v3", "tekken-240718"])
def test_a_converted_shipped_tokenizer_encodes_as_mistral_common(name: str) -> None:
    """The HF tokenizer converted from mistral-common's shipped file encodes varied texts (unicode,
    whitespace runs, digits, code) exactly as mistral-common's own tokenizer, and its control tokens have
    the same ids (scripts/measure_bridge_gaps.py --verify checks every file on more texts)."""
    from .shipped_mistral import mismatches, texts

    assert mismatches(name, texts(150, seed=3)) == []


@pytest.mark.parametrize("version", ["mistral-v2", "mistral-v3", "mistral-v7"])
@pytest.mark.parametrize("reply", [" 4", "  4", " 4\n", "\t4 ", " 4\u00a0"])
def test_a_reply_opening_with_a_space_bridges_on_a_plain_text_inst_vocabulary(version: str, reply: str) -> None:
    """mistral-common's v2-v7 templates on its shipped SentencePiece v1 file, where ``[INST]`` and ``[/INST]``
    are plain text: a reply the model opened with a space samples ``▁4`` right after ``]``, and the reply
    decoded alone reads ``4`` (the decoder drops its first dummy-prefix space), so the re-render with the
    stripped text gave other ids: a needless Break (issue 43). Decoded after the prompt's last tokens it
    keeps the space; transformers' render is the judge."""
    import functools

    from .bridge_gaps import mistral_configs, mistral_template

    config = dict(mistral_configs())[version]
    entry = Entry(f"{version}@spm-v1", "shipped:spm-v1", functools.partial(mistral_template, **config),
                  kind="mistral", string_args=True)
    user, answer, new = ({"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": reply},
                         {"role": "user", "content": "And 3+3?"})
    prompt, completion = _turn(entry, [user], answer)
    expected = _ids(entry, [user, answer, new])
    assert expected[: len(prompt) + len(completion)] == prompt + completion  # append-only: a Break is needless
    result = entry.renderer().bridge(prompt, completion, [new])
    assert isinstance(result, Bridged), result
    assert result.token_ids == expected
