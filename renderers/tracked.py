"""What a chat template does with message texts: one render with the texts tracked.

The generic bridge keeps, per shape of bridge, a recipe: the render of the same messages with a
sentinel for each text (renderers/generic_bridge.py). The real render is the recipe with the texts put
in wherever the template treats the real texts as it treated the sentinels. This module tells when that
holds without rendering again:

    trace = trace_render(template, ctx)   # once per recipe: Jinja2, texts as Tracked strings
    trace.unsafe                          # None, or what the template did that no check can cover
    trace.holds(texts)                    # per bridge: every test the template made gives the same answer

The template is rendered once with transformers' own Jinja2 environment, each text wrapped in a
:class:`Tracked` string that records what the template does with it:

- printed at the top level of the output, alone or joined to other strings with ``+``: allowed;
- tested (``startswith``, ``in``, ``==``, ``length``, truthiness, ``find``, ...): the test and its answer
  are kept, and :meth:`Trace.holds` asks a real text the same question;
- stripped of whitespace (``trim``, ``strip('\\n')``): kept as a test that the real text has no such edge;
- anything else (split, replace, slicing, iteration, ``tojson``, ``~``, a number parsed from it, output
  captured by a macro or a ``set`` block, an ``in`` test against a plain string): ``unsafe`` names it,
  and the shape has no recipe check (every such bridge renders in full, as before).

Jinja2 runs the template as Python, so each of these is a method call on the text, a filter, a test or
an output statement; the code generator routes ``in`` and output through hooks, and filters and tests
that read a string's characters in C (json, str.join, markupsafe, int) refuse tracked texts. Any
operation the lists below do not name is unsafe.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_CURRENT: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("tito_trace", default=None)

# str methods whose answer is not a string: asked again of the real text
_TESTS = frozenset({
    "startswith", "endswith", "find", "rfind", "count", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
    "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper",
    "__contains__", "__len__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
})
_STRIPS = frozenset({"strip", "lstrip", "rstrip"})
# object-protocol methods that neither read the characters nor make a string of them
_INERT = frozenset({
    "__class__", "__new__", "__init__", "__getattribute__", "__setattr__", "__delattr__", "__dir__",
    "__init_subclass__", "__subclasshook__", "__reduce__", "__reduce_ex__", "__sizeof__", "__getstate__",
    "__doc__", "__getnewargs__",
})
# filters whose work on a string goes through its methods (recorded) or that only pass it on
_FILTERS_PASS = frozenset({
    "default", "d", "length", "count", "trim", "string", "list", "first", "last", "map", "select", "reject",
    "selectattr", "rejectattr", "items", "dictsort", "sort", "reverse", "unique", "lower", "upper", "capitalize",
    "title", "replace", "max", "min", "center", "batch", "slice", "indent", "groupby", "attr", "abs", "round",
})
_TESTS_PASS = frozenset({
    "string", "none", "defined", "undefined", "mapping", "iterable", "sequence", "number", "integer", "float",
    "boolean", "true", "false", "callable", "sameas", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<",
    "le", "<=", "gt", "greaterthan", ">", "ge", ">=", "odd", "even", "divisibleby", "lower", "upper", "escaped",
})


@dataclass
class Trace:
    """What one render did with the tracked texts."""

    unsafe: str | None = None  # the first operation no check covers
    tests: list[tuple[int, Callable, tuple, Any]] = field(default_factory=list)  # (text index, test, args, answer)

    def fail(self, what: str) -> None:
        if self.unsafe is None:
            self.unsafe = what

    def holds(self, texts: list[str]) -> bool:
        """Whether the template, given ``texts``, answers every test as it did for the tracked texts."""
        for i, test, args, answer in self.tests:
            got = test(texts[i], *args)
            if got != answer or got.__class__ is not answer.__class__:
                return False
        return True


def _trace() -> Trace:
    trace = _CURRENT.get()
    if trace is None:  # a Tracked string used outside trace_render: nothing to record into
        raise RuntimeError("a Tracked string is used outside trace_render")
    return trace


def _holds_tracked(value: Any, depth: int = 0) -> bool:
    if isinstance(value, Tracked):
        return True
    if depth > 16:
        return True  # deeper than any chat data: assume the worst
    if isinstance(value, dict):
        return any(_holds_tracked(k, depth + 1) or _holds_tracked(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds_tracked(v, depth + 1) for v in value)
    return False


class Tracked(str):
    """A message text whose use by the template is recorded in the current :class:`Trace`. ``origin``:
    the text's index, or None for a string joined from it (a test of one is unsafe: it is not re-asked)."""

    origin: int | None = None

    def __add__(self, other: Any) -> Any:
        if not isinstance(other, str):
            return NotImplemented
        return _joined(str.__add__(self, other))

    def __radd__(self, other: Any) -> Any:  # str has no __radd__: Python asks this one first
        if not isinstance(other, str):
            return NotImplemented
        return _joined(str.__add__(other, self))

    def __bool__(self) -> bool:
        answer = str.__len__(self) > 0
        _record(self, "truth", _nonempty, (), answer)
        return answer

    def __hash__(self) -> int:
        _trace().fail("hashed (a dict key or set member)")
        return str.__hash__(self)


def tracked(value: str, origin: int) -> Tracked:
    """``value`` as the tracked text number ``origin``."""
    out = Tracked(value)
    out.origin = origin
    return out


def _joined(text: str) -> Tracked:
    return Tracked(text)  # origin None


def _nonempty(text: str) -> bool:
    return len(text) > 0


def _record(text: Tracked, what: str, test: Callable, args: tuple, answer: Any) -> None:
    trace = _trace()
    if text.origin is None or _holds_tracked(args):
        trace.fail(f"{what} of a joined string or against another text")
    else:
        trace.tests.append((text.origin, test, args, answer))


def _test(name: str):
    method = getattr(str, name)

    def tested(self: Tracked, *args: Any) -> Any:
        try:
            answer = method(self, *args)
        except Exception:
            _trace().fail(f"{name} raised")
            raise
        if answer is not NotImplemented:
            _record(self, name, method, args, answer)
        return answer

    tested.__name__ = f"tracked_{name}"  # never "format": the sandbox wraps methods of that name
    return tested


def _strip(name: str):
    method = getattr(str, name)

    def strips_nothing(text: str, chars: str | None) -> bool:
        return str.__eq__(method(text, chars), text)

    def stripped(self: Tracked, chars: Any = None) -> Any:
        if not (chars is None or (isinstance(chars, str) and not chars.strip())):
            _trace().fail(f"{name}({chars!r})")
            return method(self, chars)
        # whitespace only: the text itself where the real text has no such edge either (a test)
        answer = strips_nothing(self, chars)
        _record(self, name, strips_nothing, (chars,), answer)
        return self if answer else method(self, chars)

    stripped.__name__ = f"tracked_{name}"
    return stripped


def _unsafe(name: str):
    method = getattr(str, name)

    def used(self: Tracked, *args: Any, **kwargs: Any) -> Any:
        _trace().fail(name)
        return method(self, *args, **kwargs)

    used.__name__ = f"tracked_{name}"
    return used


for _name in dir(str):
    if _name in _INERT or _name in ("__add__", "__radd__", "__hash__") or not callable(getattr(str, _name)):
        continue
    if _name in _TESTS:
        setattr(Tracked, _name, _test(_name))
    elif _name in _STRIPS:
        setattr(Tracked, _name, _strip(_name))
    else:
        setattr(Tracked, _name, _unsafe(_name))
for _name in ("__rmod__", "__rmul__"):  # str has none; ``"%s" % text`` would read the text in C
    setattr(Tracked, _name, _unsafe(_name.replace("__r", "__", 1)))


# ---- the Jinja2 side ----------------------------------------------------------------------------


def _output(value: Any) -> Any:
    """Top-level output (``{{ x }}`` outside macros and blocks): a tracked text lands in the render."""
    return str.__str__(value) if isinstance(value, Tracked) else value


def _captured(value: Any) -> Any:
    """Output into a buffer (a macro's body, ``{% set %}...{% endset %}``, a call or filter block): the
    buffer is joined into a plain string the template may then test unseen."""
    if _holds_tracked(value):
        _trace().fail("printed inside a macro or a captured block")
    return _output(value)


def _contains(item: Any, container: Any) -> bool:
    """``item in container``: a tracked text looked for inside a plain string is read in C, unseen."""
    if isinstance(item, Tracked) and isinstance(container, str) and not isinstance(container, Tracked):
        _trace().fail("tested with `in` against a string")
    return item in container


def _guard_filter(name: str, fn):
    if name in _FILTERS_PASS:
        return fn

    @functools.wraps(fn)  # keeps Jinja2's pass_context / pass_environment marks
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _CURRENT.get() is not None and (_holds_tracked(args) or _holds_tracked(kwargs)):
            _trace().fail(f"the {name} filter")
        return fn(*args, **kwargs)

    return guarded


def _guard_test(name: str, fn):
    if name in _TESTS_PASS:
        return fn
    if name == "in":
        return lambda value, seq: _contains(value, seq)
    if name in ("iterable", "sequence"):  # true of every string; Jinja2's tests would iterate or measure it
        return lambda value: True if isinstance(value, Tracked) else fn(value)

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _CURRENT.get() is not None and (_holds_tracked(args) or _holds_tracked(kwargs)):
            _trace().fail(f"the {name} test")
        return fn(*args, **kwargs)

    return guarded


class _Unsupported(Exception):
    """A construct the tracking code generator does not cover (a chained comparison with ``in``)."""


@functools.lru_cache(maxsize=16)
def _tracking_template(source: str):
    """transformers' compiled environment for ``source``, as an overlay whose code routes output and
    ``in`` through the hooks above and whose filters and tests guard tracked texts; None where the
    template uses a construct this does not cover."""
    from jinja2.compiler import CodeGenerator
    from transformers.utils.chat_template_utils import _compile_jinja_template

    class TrackingCodeGenerator(CodeGenerator):
        def visit_Output(self, node, frame):
            hook = "environment.tito_captured(" if frame.buffer is not None else "environment.finalize("
            self._finalize = self._FinalizeInfo(None, hook)  # no constant folding of expressions: they may be texts
            super().visit_Output(node, frame)

        def visit_Compare(self, node, frame):
            ops = [op.op for op in node.ops]
            if not any(op in ("in", "notin") for op in ops):
                return super().visit_Compare(node, frame)
            if len(ops) != 1:
                raise _Unsupported("a chained comparison with `in`")
            self.write("(not " if ops[0] == "notin" else "(")
            self.write("environment.tito_contains(")
            self.visit(node.expr, frame)
            self.write(", ")
            self.visit(node.ops[0].expr, frame)
            self.write("))")

    base = _compile_jinja_template(source).environment
    env = base.overlay(finalize=_output)
    env.code_generator_class = TrackingCodeGenerator
    env.tito_captured = _captured
    env.tito_contains = _contains
    env.filters = {k: _guard_filter(k, v) for k, v in base.filters.items()}
    env.tests = {k: _guard_test(k, v) for k, v in base.tests.items()}
    try:
        return env.from_string(source)
    except _Unsupported:
        return None


def trace_render(source: str, ctx: dict[str, Any]) -> tuple[str | None, Trace]:
    """The template's text for ``ctx`` (whose message texts are :class:`Tracked`) and what it did with
    them; (None, a trace naming why) where the template cannot be traced or rejects the input."""
    trace = Trace()
    template = _tracking_template(source)
    if template is None:
        trace.fail("the template uses a construct the tracking does not cover")
        return None, trace
    token = _CURRENT.set(trace)
    try:
        text = template.render(**ctx)
    except Exception as exc:  # the template rejects it, or a guarded operation raised: no recipe check
        trace.fail(f"the render raised {type(exc).__name__}")
        return None, trace
    finally:
        _CURRENT.reset(token)
    return text, trace
