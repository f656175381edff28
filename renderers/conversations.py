"""Prompt ids -> the conversation they were rendered from, for the generic renderer's full-render bridge.

A caller that bridges by ids alone (the renderer service) passes no messages back; a template that is
not append-only needs them, because the bridge renders the whole conversation (renderers/full_bridge.py).
:class:`Conversations` remembers them for the prompts a renderer produced: every render with the
generation prompt, and every successful bridge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TAIL = 32  # the key: a prompt's length and its last ids (the entry is verified in full before use)


@dataclass
class _Entry:
    tail: list[int]  # the prompt's ids after the parent's prompt (all of them when there is no parent)
    messages: list[dict]  # the messages after the parent's (all of them when there is no parent)
    parent: _Entry | None
    tools: list[dict] | None
    kwargs: dict[str, Any]
    completion: list[int] | None = None  # the sampled turn before ``messages``, parsed only when recalled


def _size(entry: _Entry) -> int:
    """An entry's memory, roughly: 8 bytes an id (CPython list slots to small ints) and the message
    texts' characters (their str objects; the dict scaffolding around them is not counted)."""
    texts = 0
    for m in entry.messages:
        for v in m.values():
            if isinstance(v, str):
                texts += len(v)
            elif v is not None:
                texts += len(repr(v))  # tool calls and content parts: rare, and their repr is near their size
    return 8 * (len(entry.tail) + len(entry.completion or ())) + texts + 200


class Conversations:
    """Prompt ids -> the conversation they render, for the latest prompts a renderer produced, at most
    ``max_bytes`` of them (roughly: see :func:`_size`), the oldest dropped first. (A dropped entry that a
    newer bridge's entry links to lives on with it: a rollout's chain holds its conversation once.)

    Remembering costs O(1) in the history: the key is a prompt's length and last ids, and a bridge's
    entry keeps only what it appended and a link to its parent's, so the append-only bridge stays flat
    and a rollout's entries together hold its latest prompt once. Recalling, needed only where the whole
    conversation is rendered anyway, rebuilds the prompt from the chain and compares it with the
    caller's ids exactly (a key shared by another prompt is never taken for this one)."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: dict[tuple, tuple[_Entry, int]] = {}

    @staticmethod
    def _key(ids: list[int]) -> tuple:
        return (len(ids), tuple(ids[-_TAIL:]))

    def _put(self, key: tuple, entry: _Entry) -> None:
        entries = self._entries
        old = entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        size = _size(entry)
        if size > self.max_bytes:
            return  # larger than the whole budget: kept by no one (the others stay)
        while entries and self.bytes + size > self.max_bytes:
            self.bytes -= entries.pop(next(iter(entries)))[1]  # the oldest
        entries[key] = (entry, size)
        self.bytes += size

    def _get(self, key: tuple) -> _Entry | None:
        found = self._entries.get(key)
        return None if found is None else found[0]

    def remember(self, ids: list[int], messages: list[dict], tools: list[dict] | None, kwargs: dict[str, Any]) -> None:
        """``ids`` is the prompt rendered from ``messages`` (with the generation prompt)."""
        self._put(self._key(ids), _Entry(list(ids), list(messages), None, tools, dict(kwargs)))

    def extend(
        self, prompt: list[int], completion: list[int], appended: list[int], new: list[dict], tools, kwargs: dict[str, Any]
    ) -> None:
        """Bridging from ``prompt`` appended ``completion`` (the sampled turn, kept as ids and parsed only
        if ever recalled) and ``appended`` (the ``new`` messages' ids). Nothing is kept when ``prompt`` is
        unknown. O(1) in the history: the next prompt itself is never built here."""
        parent = self._get(self._key(prompt))
        if parent is not None:
            tail = [*completion, *appended]
            # the next prompt's key: its length and last ids (from the prompt where the tail is shorter)
            last = tail[-_TAIL:] if len(tail) >= _TAIL else [*prompt[max(0, len(prompt) - (_TAIL - len(tail))):], *tail]
            entry = _Entry(tail, list(new), parent, tools, dict(kwargs), list(completion))
            self._put((len(prompt) + len(tail), tuple(last)), entry)

    def recall(
        self, prompt: list[int], tools: list[dict] | None, kwargs: dict[str, Any], parse: Callable[[list[int]], dict]
    ) -> list[dict] | None:
        """The messages ``prompt`` was rendered from with these tools and kwargs (``parse`` turns a
        sampled turn into its assistant message), or None: unknown, or a remembered chain whose ids
        are not ``prompt`` exactly."""
        key = self._key(prompt)
        entry = self._get(key)
        if entry is None or entry.tools != tools or entry.kwargs != kwargs:
            return None
        tails: list[list[int]] = []
        parts: list[list[dict]] = []
        node: _Entry | None = entry
        while node is not None:
            tails.append(node.tail)
            parts.append(node.messages)
            if node.completion is not None:
                parts.append([parse(node.completion)])
            node = node.parent
        if [t for tail in reversed(tails) for t in tail] != prompt:
            return None  # a link taken from another prompt with the same key
        messages = [m for part in reversed(parts) for m in part]
        if entry.parent is not None:  # flatten: the next recall from here walks one link
            self._put(key, _Entry(list(prompt), messages, None, tools, entry.kwargs))
        return messages
