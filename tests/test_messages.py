"""Bad input gets a clear error naming the problem; the OpenAI message forms tito accepts."""

from __future__ import annotations

import jinja2
import pytest

import tito_renderers as renderers
from tito_renderers import MessageError, TemplateRejected, build_training_sample, normalize_messages

from ._support import ours, reference_ids


@pytest.mark.parametrize(
    "messages,match",
    [
        ([{"role": "robot", "content": "x"}], r"message 0: unknown role 'robot'"),
        ([{"role": "user"}], r"message 0: a user message needs content"),
        ([{"role": "user", "content": 3}], r"message 0.content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"only text parts"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}], r"tool_calls\[0\] has no function name"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}], r"arguments must be an object"),
        ([{"role": "user", "content": "x", "tool_calls": []}], r"only assistant messages carry tool_calls"),
        ([{"role": "user", "content": "x", "colour": "red"}], r"unknown field\(s\) \['colour'\]"),
        ("hello", r"messages must be a list"),
        ([], r"messages is empty"),
    ],
)
def test_bad_messages_are_named(messages, match):
    r = renderers.create_renderer(ours("qwen2.5-7b-instruct"))
    with pytest.raises(MessageError, match=match):
        r.render(messages)


def test_accepted_forms_normalize():
    msgs = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning": "", "tool_calls": [{"name": "f", "arguments": '{"x": 1}'}]},
        {"role": "assistant", "content": "ok", "reasoning": "because"},
    ])
    assert msgs[0] == {"role": "user", "content": "a\nb"}
    assert msgs[1] == {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert msgs[2] == {"role": "assistant", "content": "ok", "reasoning_content": "because"}


def test_template_rejection_is_a_value_error_naming_the_message():
    r = renderers.create_renderer(ours("qwen3-0.6b"))
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    with pytest.raises(TemplateRejected, match="message 1"):
        r.render(msgs)
    with pytest.raises(jinja2.exceptions.UndefinedError):  # the reference rejects it too
        reference_ids("qwen3-0.6b", msgs)


def test_training_sample_masks_only_sampled_assistant_tokens():
    tok = ours("qwen2.5-7b-instruct")
    r = renderers.create_renderer(tok)
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    sample = build_training_sample(r, msgs)
    assert sample.token_ids == reference_ids("qwen2.5-7b-instruct", msgs)
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask) if m]
    assert tok.decode(trained) == "4<|im_end|>6<|im_end|>"
    last = build_training_sample(r, msgs, train_on="last_assistant")
    assert tok.decode([t for t, m in zip(last.token_ids, last.loss_mask) if m]) == "6<|im_end|>"
    with pytest.raises(ValueError, match="train_on"):
        build_training_sample(r, msgs, train_on="everything")
