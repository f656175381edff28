"""The generic bridge where the load-time probe finds a template not append-only: render the whole
conversation and bridge when it extends the previous tokens exactly.

The probe answers for every conversation at once, from sentinel histories. A template that keeps
conversation-wide state (DeepSeek's first tool round, a system prompt or tool list placed next to the
last user message, Llama 3.1's tool calls that drop the reply's text) is flagged for all of them, yet
for a given conversation its full render very often does start with the previous prompt plus the
completion as sampled. So, for those turns, the bridge renders history + the sampled turn (as its
parsed assistant message) + the new messages, and keeps the render's tail when its ids start with
``prev_prompt_ids + prev_completion_ids`` exactly: the check is on the ids the model sampled, never
on a re-render of them. Where they differ, the Break names the first diverging position.

The bridge is given ids, not messages: :class:`Conversations` remembers which conversation each
prompt the renderer produced was rendered from (``render(..., add_generation_prompt=True)`` and every
successful bridge), so a caller that only passes ids back (the renderer service) needs nothing more.
A caller may also pass the history itself (``GenericRenderer.bridge(..., history=messages)``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .base import TemplateRejected
from .messages import MessageError
from .types import Break, BreakReason, Bridged, RenderedTokens

if TYPE_CHECKING:
    from .generic import GenericRenderer

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


def assistant_message(renderer: GenericRenderer, completion: list[int], tools: list[dict] | None) -> dict:
    """The sampled turn as the message a re-render uses: parsed, tool-call arguments in the form the
    template renders in history."""
    return renderer.parse_response(completion, tools=tools).to_message(renderer.history_arguments)


def full_bridge(
    renderer: GenericRenderer,
    prompt: list[int],
    completion: list[int],
    history: list[dict],
    assistant: dict,
    msgs: list[dict],
    tools: list[dict] | None,
    closing_ids: Collection[int],
    why: str,
) -> Bridged | Break:
    """Bridge by rendering ``history + [assistant] + msgs``: the render's tail when its ids start with
    ``prompt + completion`` exactly (after a completion that did not close its turn, the render's
    close right after it is the synthesized token), else a Break naming where they diverge. ``why``:
    what the probe found, for the Break's detail."""
    prefix = [*prompt, *completion]
    n = len(prefix)
    conversation = [*history, assistant, *msgs]
    try:
        rendered = renderer._render_tokens(conversation, tools, True)
    except (TemplateRejected, MessageError) as exc:
        return Break(BreakReason.TEMPLATE_ERROR, f"the template rejects the conversation with the new messages: {exc}", n)
    ids = rendered.token_ids
    if ids[:n] != prefix:
        at = next((i for i, (a, b) in enumerate(zip(ids, prefix)) if a != b), min(len(ids), n))
        where = f"token {at} of the previous prompt" if at < len(prompt) else f"token {at - len(prompt)} of the completion"
        moves = why.startswith("MOVES: ") and any(m["role"] == "system" for m in msgs)
        reason = BreakReason.SYSTEM_MESSAGE_MOVES if moves else BreakReason.TEMPLATE_NOT_APPEND_ONLY
        got = ids[at] if at < len(ids) else None
        return Break(
            reason,
            f"the full render with the new messages differs from the previous tokens at {where} "
            f"(render id {got}, previous id {prefix[at] if at < n else None}); the probe found: {why.removeprefix('MOVES: ')}",
            at,
        )
    synthesized = 0
    if not completion or completion[-1] not in closing_ids:
        if n >= len(ids) or ids[n] not in closing_ids:
            return Break(
                BreakReason.NO_SPECIAL_TOKEN_ANCHOR,
                "the completion ended without a stop token and the full render puts no turn-closing token right after it",
                n,
            )
        synthesized = 1
    h = len(history) + 1
    start = n + synthesized
    appended = RenderedTokens(
        token_ids=ids[n:],
        message_indices=[-1] * synthesized + [i - h if i >= h else -1 for i in rendered.message_indices[start:]],
        sampled_mask=[False] * (len(ids) - n),  # context: the model samples none of it
        is_content=[False] * synthesized + rendered.is_content[start:],
    )
    return Bridged(prefix_len=n, appended=appended, synthesized=synthesized, prev_prompt_ids=prompt,
                   prev_completion_ids=list(completion))
