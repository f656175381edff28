"""One renderer instance serves several threads at once: what a call computes (its template kwargs,
Qwen3's last user query, the close a bridged Llama turn takes, DeepSeek's open tool-outputs block)
travels with the call and is never stored on the renderer.

Each test runs a first call up to a point inside it, pauses it there, runs a second call on the same
renderer from another thread, then lets the first finish: both results must equal the same calls
made alone. A renderer that kept per-call state on itself hands one call's state to the other."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import tito_renderers as renderers

from ._support import ours


def _interleaved(
    monkeypatch: pytest.MonkeyPatch, cls: type, method: str, first: Callable[[], Any], second: Callable[[], Any]
) -> None:
    """Run ``first`` in a thread until its first call of ``cls.method``, run ``second`` to the end while it
    waits there, then let ``first`` finish; each result must equal its call alone."""
    alone = first(), second()
    assert alone[0] != alone[1], "the calls must differ, or a mix-up would not show"
    paused, resume = threading.Event(), threading.Event()
    original = getattr(cls, method)
    first_thread: list[threading.Thread] = []

    def pausing(self: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is first_thread[0] and not paused.is_set():
            paused.set()
            assert resume.wait(60), "the second call never finished"
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, pausing)
    together: list[Any] = []
    first_thread.append(threading.Thread(target=lambda: together.append(first())))
    first_thread[0].start()
    assert paused.wait(60), f"the first call never reached {cls.__name__}.{method}"
    second_result = second()
    resume.set()
    first_thread[0].join(60)
    assert together == [alone[0]], "the first call's result changed when another call ran inside it"
    assert second_result == alone[1], "the second call's result changed when it ran inside another call"


def _appended(bridged: Any) -> list[int]:
    assert isinstance(bridged, renderers.Bridged), bridged
    return bridged.appended.token_ids


def test_qwen3_renders_with_their_own_kwargs_and_last_query(monkeypatch: pytest.MonkeyPatch) -> None:
    r = renderers.create_renderer(ours("qwen3-0.6b"))
    # the last real user query is message 2 here and message 0 there: the reasoning of message 3 is
    # dropped in the first conversation and kept in the second
    late_query = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one", "reasoning_content": "thought one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "two", "reasoning_content": "thought two"},
        {"role": "user", "content": "third"},
    ]
    early_query = [
        {"role": "user", "content": "only"},
        {"role": "assistant", "content": "one", "reasoning_content": "thought one"},
        {"role": "user", "content": "<tool_response>ok</tool_response>"},
        {"role": "assistant", "content": "two", "reasoning_content": "thought two"},
    ]
    _interleaved(
        monkeypatch,
        type(r),
        "_plain_turn",  # the first user turn: after the render began, before any assistant turn
        lambda: r.render_ids(late_query, add_generation_prompt=True, enable_thinking=False),
        lambda: r.render_ids(early_query, add_generation_prompt=True),
    )


def test_llama31_bridges_close_their_own_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    r = renderers.create_renderer(ours("llama-3.1-8b-instruct"))
    tok = r.tokenizer
    messages = [{"role": "user", "content": "search the weather"}]
    builtin = r.render_ids(messages, add_generation_prompt=True, builtin_tools=["brave_search"])
    plain = r.render_ids(messages, add_generation_prompt=True)
    call = [r.python_tag_id, *tok.encode('brave_search.call(query="weather")')]  # cut off: closed by <|eom_id|>
    cut = tok.encode("It is sunny")  # a plain reply cut off: closed by <|eot_id|>
    result = [{"role": "tool", "content": "sunny"}]
    _interleaved(
        monkeypatch,
        type(r),
        "_message",  # rendering the new tool result: after the bridge chose its turn's close
        lambda: _appended(r.bridge(builtin, call, result, builtin_tools=["brave_search"])),
        lambda: _appended(r.bridge(plain, cut, result)),
    )


def test_deepseek_r1_bridges_see_their_own_tool_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    r = renderers.create_renderer(ours("deepseek-r1"))
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with_outputs = r.render_ids([
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "first"},
    ], add_generation_prompt=True)
    without = r.render_ids([{"role": "user", "content": "go"}], add_generation_prompt=True)
    reply = [*r.tokenizer.encode("done"), r.turn_close_id]
    result = [{"role": "tool", "content": "second"}]
    _interleaved(
        monkeypatch,
        type(r),
        "_family_break",  # after the bridge began, before it renders the new messages
        lambda: _appended(r.bridge(with_outputs, reply, result)),
        lambda: _appended(r.bridge(without, reply, result)),
    )
