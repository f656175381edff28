"""Thinking controls shared by every renderer: template kwargs per renderer and per call, the
reasoning_effort nearest-level rule, and capabilities."""

from __future__ import annotations

import pytest

import tito_renderers as renderers
from tito_renderers import EFFORT_LEVELS, BreakReason, nearest_effort

from ._support import ours, reference_ids


@pytest.mark.parametrize(
    "requested,available,expected",
    [
        ("medium", ("low", "medium", "high"), "medium"),
        ("xhigh", ("low", "medium", "high"), "high"),
        ("max", ("low", "medium", "high"), "high"),
        ("none", ("low", "medium", "high"), "low"),
        ("minimal", ("low", "high"), "low"),
        ("medium", ("low", "high"), "high"),  # a tie goes up
        ("low", ("none", "medium"), "medium"),  # a tie goes up
        ("high", ("none", "minimal"), "minimal"),
    ],
)
def test_nearest_effort(requested, available, expected):
    assert nearest_effort(requested, available) == expected


def test_nearest_effort_rejects_unknown_levels_by_name():
    with pytest.raises(ValueError, match="reasoning_effort must be one of none, minimal, low"):
        nearest_effort("extreme", ("low", "high"))
    with pytest.raises(ValueError, match="no reasoning_effort levels"):
        nearest_effort("low", ())
    assert EFFORT_LEVELS == ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def test_template_kwargs_per_render_override_the_renderer_s():
    tok = ours("qwen3-0.6b")
    default = renderers.create_renderer(tok)
    off = renderers.create_renderer(tok, enable_thinking=False)
    msgs = [{"role": "user", "content": "2+2?"}]
    per_call = default.render_ids(msgs, add_generation_prompt=True, enable_thinking=False)
    assert per_call == off.render_ids(msgs, add_generation_prompt=True)
    assert per_call == reference_ids("qwen3-0.6b", msgs, add_generation_prompt=True, enable_thinking=False)
    assert default.render_ids(msgs, add_generation_prompt=True) != per_call  # the override did not stick
    assert off.render_ids(msgs, add_generation_prompt=True, enable_thinking=True) == default.render_ids(msgs, add_generation_prompt=True)


def test_bad_template_kwargs_are_named():
    tok = ours("qwen3-0.6b")
    r = renderers.create_renderer(tok)
    with pytest.raises(ValueError, match="no template kwarg 'reasoning_effort'"):
        r.render([{"role": "user", "content": "x"}], reasoning_effort="high")
    with pytest.raises(ValueError, match="'enable_thinking' must be bool, got str"):
        renderers.create_renderer(tok, enable_thinking="yes")
    prompt = r.render_ids([{"role": "user", "content": "x"}], add_generation_prompt=True)
    brk = r.bridge(prompt, [tok.token_id("<|im_end|>")], [{"role": "user", "content": "y"}], enable_thinking="no")
    assert isinstance(brk, renderers.Break) and brk.reason is BreakReason.INVALID_MESSAGES
    assert "enable_thinking" in brk.detail


def test_capabilities_of_the_hand_coded_families():
    qwen3 = renderers.create_renderer(ours("qwen3-0.6b")).capabilities
    assert (qwen3.thinking_switch, qwen3.reasoning_efforts, qwen3.tools, qwen3.bridge) == (True, (), True, True)
    chatml = renderers.create_renderer(ours("qwen2.5-7b-instruct"), name="chatml").capabilities
    assert (chatml.thinking_switch, chatml.tools) == (False, False)
