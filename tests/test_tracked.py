"""renderers/tracked.py: what a template does with message texts, from one render with them tracked,
and the generic bridge's recipe path that relies on it (no render where every test the template made
of a text gives the same answer).

The contract checked here is soundness: on templates that branch on, transform or escape a tool
result's text, every bridge equals transformers' full render (the reference), whichever side of the
template's branch the text falls on.
"""

from __future__ import annotations

import pytest

from tito_renderers import Bridged, create_renderer
from tito_renderers.template_env import ChatTemplate
from tito_renderers.tracked import trace_render, tracked

from ._support import ours, reference

QWEN3 = "qwen3-0.6b"
TOOL_TURN = '{%- elif message.role == "tool" %}'


def trace_of(source: str, body: str, role: str = "tool"):
    """The trace of ``source`` rendering a user turn, an assistant reply and one tracked ``body``."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
            {"role": role, "content": tracked(body, 0)}]
    return trace_render(source, ChatTemplate.context(msgs, None, True))


def tiny(tool_line: str) -> str:
    """A ChatML-like template whose tool turn is ``tool_line``."""
    return ("{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n" + tool_line + "<|im_end|>\n"
            "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("line, unsafe", [
    ("{{ m.content }}", None),
    ("{{ '<r>' + m.content + '</r>' }}", None),
    ("{{ m.content | trim }}", None),
    ("{% if m.content.startswith('ERR') %}E:{% endif %}{{ m.content }}", None),
    ("{% if m.content is string and m.content %}{{ m.content }}{% endif %}", None),
    ("{{ m.content | tojson }}", "the tojson filter"),
    ("{{ m.content.split('\\n')[0] }}", "split"),
    ("{{ m.content[:10] }}", "__getitem__"),
    ("{{ '<r>' ~ m.content }}", "__str__"),
    ("{{ m.content | replace('a', 'b') }}", "__str__"),  # Jinja2's replace makes a str of it first
    ("{% if m.content in 'ERROR FAIL' %}E{% endif %}{{ m.content }}", "tested with `in` against a string"),
    ("{{ m.content | int }}", "the int filter"),
    ("{% macro show(c) %}{{ c }}{% endmacro %}{{ show(m.content) }}", "printed inside a macro or a captured block"),
    ("{% set c %}{{ m.content }}{% endset %}{{ c }}", "printed inside a macro or a captured block"),
    ("{% for ch in m.content %}{{ ch }}{% endfor %}", "__iter__"),
    ("{{ m.content | upper }}", "upper"),
    ("{{ '%s' | format(m.content) }}", "the format filter"),
])
def test_each_use_of_a_text_is_allowed_tested_or_unsafe(line: str, unsafe: str | None) -> None:
    text, trace = trace_of(tiny(line), "\U000f8300")
    assert trace.unsafe == unsafe, (line, trace.unsafe)
    if unsafe is None:  # what the tracked render printed is the plain render's text
        plain = ChatTemplate(tiny(line)).render(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
             {"role": "tool", "content": "\U000f8300"}], None, True)
        assert text == plain


def test_a_test_is_asked_again_of_the_real_text() -> None:
    _text, trace = trace_of(tiny("{% if m.content.startswith('ERR') %}E:{% endif %}{{ m.content | trim }}"), "\U000f8300")
    assert trace.unsafe is None
    assert trace.holds(["all good"])  # the same answers: startswith('ERR') False, no edge to trim
    assert not trace.holds(["ERR: boom"])  # the other branch
    assert not trace.holds(["all good\n"])  # trim would change it


def test_qwen3_tool_and_user_texts() -> None:
    source = ours(QWEN3).chat_template
    _t, tool = trace_of(source, "\U000f8300", "tool")
    assert tool.unsafe is None and tool.tests == []  # Qwen3 prints a tool result as it is
    _t, user = trace_of(source, "\U000f8300", "user")
    # a user message that looks like a tool response changes where the last query is (and which reasoning stays)
    assert user.unsafe is None and not user.holds(["<tool_response>\nx\n</tool_response>"]) and user.holds(["hello"])


@pytest.mark.parametrize("line", [
    "{%- if message.content.startswith('ERR') %}<error>{{- message.content }}</error>{%- else %}{{- message.content }}{%- endif %}",
    "{%- if message.content | length > 12 %}[long]{%- endif %}{{- message.content }}",
    "{{- message.content | tojson }}",
    "{{- message.content | trim }}",
])
def test_bridges_equal_the_reference_on_either_side_of_a_branch(line: str) -> None:
    """Qwen3's template with its tool turn changed to branch on, measure, escape or trim the text: the
    generic bridge (recipe path included) gives transformers' render of the whole conversation."""
    base = ours(QWEN3)
    source = base.chat_template
    tool_at = source.index(TOOL_TURN)
    at = source.index("{{- message.content }}", tool_at)
    variant = source[:at] + line + source[at + len("{{- message.content }}"):]
    r = create_renderer(base.with_chat_template(variant, "qwen3-variant"), name="generic")
    hf = reference(QWEN3)
    user = [{"role": "user", "content": "Check the logs."}]
    prompt = r.render_ids(user, add_generation_prompt=True)
    reply = {"role": "assistant", "content": "", "reasoning_content": "Look first.", "tool_calls": [
        {"type": "function", "function": {"name": "logs", "arguments": {"n": 1}}}]}
    turn = r.render_ids([*user, reply])[len(prompt):]
    completion = turn[: max(i for i, t in enumerate(turn) if t in r.stop_token_ids) + 1]
    renders = []
    text = r._text
    r._text = lambda *a, **k: renders.append(1) or text(*a, **k)  # counts the template renders of each bridge
    for body in ("all good here", "ERR: disk full", "ok", "ERR", "a much longer line of output", " padded  ", "all good"):
        tool = {"role": "tool", "content": body}
        renders.clear()
        out = r.bridge(prompt, completion, [tool])
        if body == "all good" and "tojson" not in line and "length" not in line:  # (a length is asked as is: never equal)
            assert renders == [], "the recipe path should not render"
        want = hf.apply_chat_template([*user, reply, tool], tokenize=True, add_generation_prompt=True,
                                      chat_template=variant)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert isinstance(out, Bridged), (line, body, out)
        assert out.token_ids == want, (line, body)
