"""Rendering a chat template with minijinja exactly as transformers renders it with Jinja2.

transformers compiles a chat template in an ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` with the ``loopcontrols`` extension and installs a few helpers (see
``transformers.utils.chat_template_utils._cached_compile_jinja_template``): a ``tojson`` filter on
``json.dumps`` (``ensure_ascii=False``, optional indent/separators/sort_keys, no HTML escaping),
``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``. The template sees ``messages``,
``tools``, ``documents``, ``add_generation_prompt``, the tokenizer's special tokens and the caller's
kwargs; a message's reasoning is also offered as ``thinking`` (transformers 5 aliases it, for gpt-oss).

minijinja in ``pycompat`` mode prints Python values the way Jinja2 does (``True``, ``None``, dict
reprs) and offers the str/dict methods templates call; ``loop.*``, ``namespace`` and ``break`` /
``continue`` are built in. The tests compare the text with transformers' on every fixture template.
"""

from __future__ import annotations

import re
from datetime import datetime
from functools import lru_cache
from typing import Any

import minijinja

from .base import TemplateRejected
from .json_text import tojson

# What transformers passes besides the caller's kwargs (a kwarg of the same name would override them)
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# Globals the environment provides: not template kwargs
HELPERS = frozenset({"raise_exception", "strftime_now", "namespace", "dict", "range", "lipsum", "cycler", "joiner"})


class _TemplateRaised(Exception):
    """``raise_exception(message)`` inside the template: carried through minijinja to name the message."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _jinja2_int(value: Any, default: int = 0, base: int = 10) -> int:
    """Jinja2's ``int`` filter: a number in ``base`` (a string in base 10 may be a float), else ``default``."""
    try:
        return int(value, base) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError, OverflowError):
            return default


def _jinja2_float(value: Any, default: float = 0.0) -> float:
    """Jinja2's ``float`` filter: the number, else ``default``."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


class ChatTemplate:
    """One compiled chat template. ``now`` is the clock ``strftime_now`` reads: fixed when the template is
    loaded, so that every render within a run embeds the same date (transformers reads the clock per render)."""

    def __init__(self, source: str, now: datetime | None = None) -> None:
        self.source = source
        self.now = now or datetime.now()
        env = minijinja.Environment(
            trim_blocks=True,
            lstrip_blocks=True,
            pycompat=True,
            keep_trailing_newline=False,  # Jinja2's default, which transformers keeps
            # Jinja2's int / float give a default for text that is no number, where minijinja's raise
            # (Mistral v2-v3 try ``content|int`` on every tool result)
            filters={"tojson": tojson, "int": _jinja2_int, "float": _jinja2_float},
        )
        env.add_function("raise_exception", _raise_exception)
        env.add_function("strftime_now", self._strftime_now)
        env.add_function("dict", lambda *args, **kwargs: dict(*args, **kwargs))
        try:
            env.add_template("chat", _jinja2_iterable(source))
        except minijinja.TemplateError as exc:
            raise ValueError(f"the chat template does not compile: {_message(exc)}") from None
        self._env = env

    def _strftime_now(self, fmt: str) -> str:
        return self.now.strftime(fmt)

    @property
    def variables(self) -> frozenset[str]:
        """Names the template reads from its context that nothing inside it defines."""
        return _variables(self.source)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        special_tokens: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> str:
        """The text transformers' ``apply_chat_template(..., tokenize=False)`` produces for these
        (already normalized) messages. Raises :class:`TemplateRejected` with the template's message
        where Jinja2 would raise (``raise_exception``, an undefined value in an operation, ...)."""
        ctx = self.context(messages, tools, add_generation_prompt, special_tokens, **kwargs)
        if _has_lossy_float(tools) or _has_lossy_float(kwargs) or any(
            "tool_calls" in m and _has_lossy_float(m["tool_calls"]) for m in messages
        ):  # numbers only come in through tool calls, tool definitions and kwargs
            return self._render_jinja2(ctx)
        try:
            return self._env.render_template("chat", **ctx)
        except _TemplateRaised as exc:  # raise_exception: minijinja re-raises the callback's exception
            raise TemplateRejected(f"the chat template rejects this conversation: {exc}") from None
        except (minijinja.TemplateError, TypeError, ValueError) as exc:  # a Jinja error, or tojson on bad data
            raise TemplateRejected(f"the chat template rejects this conversation: {_message(exc)}") from None

    @staticmethod
    def context(
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        special_tokens: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The variables the template sees, as transformers passes them."""
        ctx: dict[str, Any] = dict(special_tokens or {})
        ctx.update(kwargs)
        ctx.update(messages=alias_reasoning(messages), tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
        return ctx

    def _render_jinja2(self, ctx: dict[str, Any]) -> str:
        """Jinja2 with transformers' own environment, for data minijinja cannot print like Python.

        minijinja hands an integral float (``-2.0``) to Python callbacks such as ``tojson`` as an int, and
        prints floats that Python writes with an exponent (``1e-07``, ``1e+20``) in positional form.
        Such values are rare in chat data (tool-call arguments), so they take the reference path."""
        import jinja2
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = _compile_jinja_template(self.source)
        try:  # a context variable shadows the global: this template's fixed clock
            return template.render(**ctx, strftime_now=self._strftime_now)
        except (jinja2.TemplateError, TypeError, ValueError, AttributeError) as exc:  # what Jinja2 raises on bad data
            raise TemplateRejected(f"the chat template rejects this conversation: {exc}") from None


_ITERABLE_TEST = re.compile(r"([A-Za-z_][\w.]*(?:\[[^\]\[]*\])*)\s+is\s+(not\s+)?iterable\b")


def _jinja2_iterable(source: str) -> str:
    """Jinja2 says ``none is iterable`` is false and ``undefined is iterable`` true; minijinja says true
    for both, and a Python test cannot tell the two apart (both arrive as None). So the test is
    rewritten: ``x is iterable`` -> ``(x is iterable and x is not none)`` (templates test
    ``tools is iterable``, and ``message.content is iterable`` on a missing content)."""

    def repl(m: re.Match) -> str:
        x = m.group(1)
        return f"({x} is not iterable or {x} is none)" if m.group(2) else f"({x} is iterable and {x} is not none)"

    return _ITERABLE_TEST.sub(repl, source)


def _has_lossy_float(value: Any) -> bool:
    """True when ``value`` holds a float minijinja would not hand over or print exactly as Python does."""
    if isinstance(value, float):
        return value.is_integer() or "e" in repr(value) or value != value or value in (float("inf"), float("-inf"))
    if isinstance(value, dict):
        return any(_has_lossy_float(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_lossy_float(v) for v in value)
    return False


def alias_reasoning(messages: list[dict]) -> list[dict]:
    """transformers 5 offers a message's reasoning as ``thinking`` too (first key), and keeps
    ``reasoning_content`` (``_alias_reasoning_fields``)."""
    out = []
    for m in messages:
        reasoning = m.get("reasoning_content")
        out.append({"thinking": reasoning, **m} if reasoning is not None else m)
    return out


def _message(exc: BaseException) -> str:
    """The template's own message where it called raise_exception, else minijinja's description."""
    cause = exc
    while cause is not None:
        if isinstance(cause, _TemplateRaised):
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    text = str(exc)
    marker = "_TemplateRaised: "
    if marker in text:
        return text.split(marker, 1)[1].split("\n", 1)[0].strip()
    return text.split("\n", 1)[0]


@lru_cache(maxsize=64)
def compile_template(source: str) -> ChatTemplate:
    """The compiled template, cached by its text (one per process: its clock is read once)."""
    return ChatTemplate(source)


def defuse_template_source(source: str, markers: tuple[str, ...], char: str) -> str:
    """The template with its string tests on message text rewritten to look for defused markers.

    A defused conversation (``char`` after the first character of every marker inside message text)
    must take the same template branches as the real one: ``'</think>' in content`` and
    ``content.split('</think>')`` test for the marker, so they are rewritten to test for its defused
    form. Only a marker literal that is a call argument or the left side of ``in`` is rewritten;
    literals the template prints stay as they are (they are its own special tokens)."""
    out = source
    for marker in sorted(set(markers), key=len, reverse=True):
        if marker not in out:
            continue
        defused = marker[0] + char + marker[1:]
        for q in ("'", '"'):
            out = out.replace(f"({q}{marker}{q})", f"({q}{defused}{q})")
            out = out.replace(f"{q}{marker}{q} in ", f"{q}{defused}{q} in ")
    return out


@lru_cache(maxsize=64)
def defused_template(template: ChatTemplate, markers: tuple[str, ...], char: str) -> ChatTemplate:
    """The compiled :func:`defuse_template_source` of ``template``, sharing its clock."""
    source = defuse_template_source(template.source, markers, char)
    return template if source == template.source else ChatTemplate(source, template.now)


@lru_cache(maxsize=64)
def _variables(source: str) -> frozenset[str]:
    env = minijinja.Environment(pycompat=True)
    try:
        names = env.undeclared_variables_in_str(source)
    except minijinja.TemplateError:
        return frozenset()
    return frozenset(names)
