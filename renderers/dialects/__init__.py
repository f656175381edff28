"""Dialects: how one model family writes reasoning and tool calls in its completions, chosen by the
vocabulary's marker tokens and parsed by token ids.

The contract (one subclass of :class:`Dialect` per format, one module per family under this package):

- ``name``: a short unique name (``"glm"``, ``"kimi_k2"``).
- ``priority``: the registry tries dialects in ascending order and the first that detects wins;
  bands: 10 formats with their own message grammar (Harmony), 20 call markers unique to one family
  (Gemma 4 ``<|tool_call>``, Kimi K2 sections, MiniMax ``<minimax:tool_call>``, DeepSeek
  ``<｜tool▁calls▁begin｜>``, Mistral ``[TOOL_CALLS]``), 30 formats that share ``<tool_call>`` but add
  their own argument tokens (GLM ``<arg_key>``), 80 ``<tool_call>`` formats told apart by their body,
  90 the plain ``<tool_call>`` JSON / ``<think>`` scan (hermes).
- ``detect(tokenizer)``: an instance only when the vocabulary has the format's ``markers`` as added
  tokens (its :attr:`~renderers.tokenizer.Tokenizer.markers`: text never produces them). A channel
  (reasoning ``think``, tool calls ``call``, a block around the calls ``section``) is wired only when
  the vocabulary has that marker pair; otherwise those ids are None and the channel is plain text.
- ``parse(completion_ids, tools, prompt_ids=, stop_ids=)`` -> :class:`~renderers.types.ParsedResponse`:
  scans ids (never text) with :func:`renderers.scan.scan_ids` for reasoning, content and call spans;
  each call body goes to ``parse_call`` (or ``parse_block`` where one block holds several calls) and
  gets a status, its token span and raw text; arguments of formats that carry them as text
  (``string_arguments``) are typed by the offered tools' JSON schemas as Qwen3-Coder's are
  (:func:`renderers.dialects.xml_calls.type_call`); JSON formats go through
  :func:`renderers.dialects.json_calls.checked_call`. It never raises on any id sequence. The dialect's own markers
  (``think``, ``call``, ``section``) are never stops, whatever ``stop_ids`` says. In a block cut off
  before its close marker, the last call is ``unclosed`` (with ``several_per_block``, only when its own
  structure is incomplete: MiniMax's invokes close themselves).

Register a dialect with :func:`register` and import its module at the bottom of this file. The
generic renderer parses with :func:`dialect_for`; a hand-coded renderer opts in with its ``dialect``
class attribute (:meth:`renderers.base.Renderer.parse_response`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ..messages import normalize_tools, tool_names
from ..scan import Scan, prompt_opens_reasoning, scan_ids
from ..tokenizer import Tokenizer
from ..types import ParsedResponse, ToolCall, ToolCallStatus
from .xml_calls import function_schemas, type_call


@dataclass(frozen=True)
class Offered:
    """The tools a completion was sampled with: names (for ``unknown_tool``) and parameter schemas (for
    typing text arguments). Both None when no tools were given: then any name is accepted and text
    arguments stay strings."""

    names: set[str] | None
    schemas: dict[str, dict] | None

    @classmethod
    def of(cls, tools: Any) -> Offered:
        defs = normalize_tools(tools)
        return cls(tool_names(defs), function_schemas(defs))


def _pair(added: dict[str, int], names: tuple[str, str] | None) -> tuple[int, int] | None:
    if names is None or not all(n in added for n in names):
        return None
    return added[names[0]], added[names[1]]


class Dialect:
    """One completion format (see the module docstring for the contract)."""

    name: ClassVar[str]
    priority: ClassVar[int]
    markers: ClassVar[tuple[str, ...]]  # added tokens that must all be in the vocabulary
    think: ClassVar[tuple[str, str] | None] = ("<think>", "</think>")
    call: ClassVar[tuple[str, str] | None] = None
    section: ClassVar[tuple[str, str] | None] = None
    restart: ClassVar[bool] = False  # a call's open inside a call ends that call (see scan_ids)
    string_arguments: ClassVar[bool] = False
    several_per_block: ClassVar[bool] = False  # one call-marker pair holds several self-closed calls
    stops: ClassVar[tuple[str, ...]] = ()  # stop tokens when the caller gives none (with the tokenizer's EOS)

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        added = tokenizer.markers
        self.think_ids = _pair(added, self.think)
        self.call_ids = _pair(added, self.call)
        self.section_ids = _pair(added, self.section)
        self.stop_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*(added[t] for t in self.stops if t in added), *tokenizer.eos_token_ids])
        )

    @classmethod
    def detect(cls, tokenizer: Tokenizer) -> Dialect | None:
        """An instance when the vocabulary has every one of ``markers`` as an added (marker) token."""
        markers = tokenizer.markers
        return cls(tokenizer) if all(m in markers for m in cls.markers) else None

    def parse(
        self,
        completion_ids: Sequence[int],
        tools: Any = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        stop_ids: Collection[int] | None = None,
    ) -> ParsedResponse:
        """Reasoning, content and tool calls of ``completion_ids``, up to the first stop id (``stop_ids``,
        default this dialect's ``stops``). ``prompt_ids``: a prompt whose last turn opened reasoning
        (a generation prompt ending in ``<think>``) makes the completion start inside it."""
        offered = Offered.of(tools)
        ids = list(completion_ids)
        scan = self._scan(ids, stop_ids, prompt_ids)
        calls: list[ToolCall] = []
        for start, end, closed in scan.calls:
            body = ids[start + 1 : end - 1 if closed else end]
            block = self.parse_block(body, (start, end), offered)
            if not block:  # a block that holds no call (an empty JSON array of calls)
                continue
            last = block[-1]
            # the last call of a block cut off is the one that was cut; where a block holds several calls
            # with their own closing tags (MiniMax's </invoke>), only if its own structure is incomplete
            if not closed and not (self.several_per_block and last.status is ToolCallStatus.OK):
                last.status, last.error = ToolCallStatus.UNCLOSED, "the tool call ended before its close marker"
            calls.extend(type_call(c, offered.schemas) if self.types_arguments(c) else c for c in block)
        return scan.response(calls, self.tokenizer.decode)

    def _scan(self, ids: list[int], stop_ids: Collection[int] | None, prompt_ids: Sequence[int] | None = None) -> Scan:
        """The scan of ``ids`` up to the first stop (``stop_ids``, default this dialect's ``stops``)."""
        # This format's own markers are structure, never a stop, whatever the caller's stop ids say (a
        # template probe may take GLM's </tool_call>, the last token of a tool-call turn, for a stop).
        structure = {*(self.think_ids or ()), *(self.call_ids or ()), *(self.section_ids or ())}
        stops = frozenset(self.stop_ids if stop_ids is None else stop_ids) - structure
        return scan_ids(ids, stop_ids=stops, think=self.think_ids, call=self.call_ids, section=self.section_ids,
                        restart=self.restart, in_reasoning=prompt_opens_reasoning(prompt_ids, self.think_ids, stops))

    def call_names_and_reasoning(self, completion_ids: Sequence[int], stop_ids: Collection[int]) -> tuple[tuple[str, ...], bool]:
        """What :meth:`parse` would give as its calls' names (``""`` for a call without one) and whether its
        reasoning holds text, without decoding the content or typing arguments: the shape of a sampled
        turn that the generic bridge's sentinel history copies. A dialect with a ``parse`` of its own
        (Harmony, Gemma 4, Llama 3 JSON, Mistral) answers from it."""
        if type(self).parse is not Dialect.parse:
            parsed = self.parse(completion_ids, stop_ids=stop_ids)
            return tuple(c.name or "" for c in parsed.tool_calls), bool(parsed.reasoning_content)
        ids = list(completion_ids)
        scan = self._scan(ids, stop_ids)
        offered = Offered(None, None)
        names = tuple(c.name or "" for start, end, closed in scan.calls
                      for c in self.parse_block(ids[start + 1 : end - 1 if closed else end], (start, end), offered))
        reasons = scan.saw_reasoning and bool(scan.reasoning) and bool(self.tokenizer.decode(scan.reasoning).strip())
        return names, reasons

    def parse_block(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> list[ToolCall]:
        """The calls between one pair of call markers; one by default (``parse_call``)."""
        return [self.parse_call(body_ids, span, offered)]

    def parse_call(self, body_ids: list[int], span: tuple[int, int], offered: Offered) -> ToolCall:
        """One call's body (the ids between its markers) -> a ToolCall with a status, never an exception.
        ``span`` is the call's ``[start, end)`` in completion ids, markers included."""
        raise NotImplementedError

    def types_arguments(self, call: ToolCall) -> bool:
        """Whether this call's arguments are text to type by schema (``string_arguments`` by default)."""
        return self.string_arguments

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.tokenizer.name_or_path!r})"


def token_index_at(decode: Callable[[list[int]], str], ids: list[int], char_pos: int) -> int:
    """The smallest k with ``len(decode(ids[:k])) >= char_pos``: where text offset ``char_pos`` of
    ``decode(ids)`` falls in ``ids`` (for spans of several calls inside one block). Binary search on
    prefix decodes, so O(log n) decodes."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= char_pos:
            hi = mid
        else:
            lo = mid + 1
    return lo


# ---- the registry ------------------------------------------------------------------------------

D = TypeVar("D", bound=type[Dialect])
_REGISTRY: dict[str, type[Dialect]] = {}
_DETECTED: dict[int, tuple[Tokenizer, list[Dialect]]] = {}


def register(cls: D) -> D:
    """Class decorator: add a dialect to the registry (a name registered twice is an error)."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a dialect named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    _DETECTED.clear()
    return cls


def registered() -> list[type[Dialect]]:
    """Every registered dialect class, in detection order (priority, then name)."""
    return sorted(_REGISTRY.values(), key=lambda c: (c.priority, c.name))


def detect_dialects(tokenizer: Tokenizer) -> list[Dialect]:
    """Every dialect whose markers this vocabulary has, in detection order; cached per tokenizer."""
    known = _DETECTED.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:  # the entry holds its tokenizer: the id is not reused
        return known[1]
    found = [d for d in (cls.detect(tokenizer) for cls in registered()) if d is not None]
    if len(_DETECTED) > 64:
        _DETECTED.clear()
    _DETECTED[id(tokenizer)] = (tokenizer, found)
    return found


def dialect_for(tokenizer: Tokenizer) -> Dialect | None:
    """The dialect a completion from this vocabulary is parsed with: the first detected, or None (plain text)."""
    found = detect_dialects(tokenizer)
    return found[0] if found else None


def dialect_named(name: str, tokenizer: Tokenizer) -> Dialect | None:
    """The dialect ``name`` on this tokenizer, or None when the vocabulary lacks its markers. An unknown
    name is a ``KeyError`` naming the registered ones."""
    if name not in _REGISTRY:
        raise KeyError(f"no dialect named {name!r} (registered: {', '.join(sorted(_REGISTRY))})")
    return next((d for d in detect_dialects(tokenizer) if d.name == name), None)


# Dialect modules register themselves on import. Keep one line per module.
from . import deepseek as deepseek  # noqa: E402
from . import gemma4 as gemma4  # noqa: E402
from . import glm as glm  # noqa: E402
from . import harmony as harmony  # noqa: E402
from . import hermes as hermes  # noqa: E402
from . import kimi as kimi  # noqa: E402
from . import llama3_json as llama3_json  # noqa: E402
from . import minimax as minimax  # noqa: E402
from . import mistral as mistral  # noqa: E402
from . import nemotron as nemotron  # noqa: E402
