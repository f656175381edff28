"""Chat sessions: the rollout loop's bridging for clients that speak OpenAI chat completions.

A session (``X-Session-ID``) is one rollout held by a renderer service (``RendererService``: the same
begin / record / bridge / restart code ``tito run`` uses, as a Ray actor or a local object). The first
call renders its messages. A later call whose messages are the previous call's messages, then the
assistant message this server returned, then new messages, is bridged append-only: the new prompt is
the previous prompt + the sampled completion + the new messages' tokens, so no sampled token is ever
re-rendered. Any other call (an edited history, changed tools, a retry after a failed turn) is not
silently bridged: it records a Break with its reason and starts a new segment from a full render.

Calls on one session are serialized (a lock per session). A session ends when its client says so
(``X-Session-End: true`` on its last chat call, or ``DELETE /v1/sessions/{id}``), when it has been idle
longer than the configured timeout, or when the sessions together hold more than ``max_idle_bytes``: then
the least recently used idle ones are evicted first. An ended session is finished (its samples written when
the server has an output directory) and dropped.

Memory is counted as payload bytes (:attr:`Session.nbytes`): the token ids this server keeps for the
session's next bridge (int64) plus the samples its renderer holds (per token an int64 id, a float32
logprob and a one-byte loss mask, as a shard stores them). Python's objects holding them take more (3.7x
the payload, measured with tracemalloc over four-turn chats, messages included); the bound is on the payload,
which grows with the same tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tito_renderers import MessageError, normalize_messages

from ..handles import RendererHandle
from ..turns import RolloutMeta, SampledTurn, SegmentBreak
from .schemas import BadRequest

# Break reasons that come from the session layer, next to the renderer's BreakReason values
HISTORY_EDITED = "history_edited"
TOOLS_CHANGED = "tools_changed"
RETRY_AFTER_FAILED_TURN = "previous_turn_not_sampled"
ID_BYTES = 8  # a token id held by this server for the next bridge (int64)
SAMPLE_TOKEN_BYTES = 8 + 4 + 1  # a sample token the renderer holds: int64 id, float32 logprob, bool mask


SESSION_ID_RULE = "1 to 256 ASCII letters, digits and . _ : - (not dots alone)"
_SESSION_ID = re.compile(r"(?!\.+$)[A-Za-z0-9._:-]{1,256}")


def check_session_id(session_id: str, param: str = "X-Session-ID") -> str:
    """``session_id`` if it follows SESSION_ID_RULE, else BadRequest naming the rule. The rule makes every
    accepted id addressable: no ``/`` (``/v1/sessions/a/b/sample`` is another route), nothing a URL or a
    latin-1 header would change (a UTF-8 header arrives as latin-1 mojibake), a bounded length, no ``.`` or ``..`` (URL clients resolve them as path segments)."""
    if not _SESSION_ID.fullmatch(session_id):
        shown = session_id if len(session_id) <= 40 else f"{session_id[:40]}... ({len(session_id)} characters)"
        raise BadRequest(f"{param} {shown!r} is not a valid session id: it must be {SESSION_ID_RULE}", param)
    return session_id


def session_header(headers: Any) -> str | None:
    """The ``X-Session-ID`` header's value, None when the header is absent. Present but empty or blank (a
    parser strips the spaces: ``X-Session-ID:   `` arrives empty) is a 400 naming it: a client that meant a
    session must not be served stateless with nothing recorded."""
    value = headers.get("x-session-id")
    if value is not None and not value.strip():
        raise BadRequest(f"X-Session-ID is empty: send a session id ({SESSION_ID_RULE}) or leave the header out",
                         "X-Session-ID")
    return value


class SessionLimit(RuntimeError):
    """Too many sessions are held (429)."""


@dataclass
class Session:
    id: str
    renderer: RendererHandle
    messages: list[dict] = field(default_factory=list)  # the last call's messages (normalized)
    tools: list[dict] | None = None
    prompt_ids: list[int] = field(default_factory=list)  # the last call's prompt
    last_completion: list[int] = field(default_factory=list)  # what the engine sampled for it
    assistant: dict | None = None  # what the last call returned; None until a turn was sampled
    turn: int = 0  # the next turn's index
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    bridged: int = 0
    breaks: int = 0
    closed_segment_tokens: int = 0  # sample tokens of segments a break closed (the renderer still holds them)
    lora: str | None = None  # the LoRA adapter its last turn was sampled with (`model: <lora_name>`), for its rows

    @property
    def sample_tokens(self) -> int:
        """Tokens of the samples the renderer holds: closed segments + the current prompt and completion."""
        return self.closed_segment_tokens + len(self.prompt_ids) + len(self.last_completion)

    @property
    def nbytes(self) -> int:
        """Payload bytes held for this session (see the module doc)."""
        return ID_BYTES * (len(self.prompt_ids) + len(self.last_completion)) + SAMPLE_TOKEN_BYTES * self.sample_tokens


@dataclass
class Prepared:
    """The prompt for a session turn and how it was built: "first", "bridged", "break" or "retry"."""

    prompt_ids: list[int]
    kind: str
    brk: SegmentBreak | None = None


def _same_assistant(sent: dict, ours: dict) -> bool:
    """Does the client's copy of an assistant turn match what this server returned? Content and tool
    calls (name + arguments, as JSON values) must match; call ids and a dropped reasoning_content are
    tolerated (clients commonly regenerate ids and drop reasoning), a changed reasoning_content is not."""
    if sent.get("role") != "assistant" or (sent.get("content") or "") != (ours.get("content") or ""):
        return False
    if "reasoning_content" in sent and sent["reasoning_content"] != ours.get("reasoning_content"):
        return False

    def calls(m: dict) -> list[tuple[str, Any]]:
        out = []
        for c in m.get("tool_calls") or []:
            fn = c.get("function", c)
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            out.append((fn.get("name"), args))
        return out

    return calls(sent) == calls(ours)


def _first_difference(a: list[dict], b: list[dict]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class SessionManager:
    def __init__(self, renderers: list[RendererHandle], *, idle_timeout_s: float, max_sessions: int,
                 write_samples: bool = False, max_idle_bytes: int | None = None) -> None:
        if not renderers:
            raise ValueError("need at least one renderer service")
        self.renderers = renderers
        self.sessions: dict[str, Session] = {}
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        self.max_idle_bytes = max_idle_bytes  # None: no bound by memory
        self.write_samples = write_samples
        self._next_renderer = itertools.cycle(range(len(renderers)))
        self.expired = 0
        self.evicted = 0

    @property
    def nbytes(self) -> int:
        """Payload bytes held by all sessions (see the module doc)."""
        return sum(s.nbytes for s in self.sessions.values())

    def get(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    def open(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            if len(self.sessions) >= self.max_sessions:
                raise SessionLimit(f"{len(self.sessions)} sessions are held (sessions.max_sessions); "
                                   "delete finished sessions or raise the limit")
            s = self.sessions[session_id] = Session(session_id, self.renderers[next(self._next_renderer)])
        s.last_used = time.monotonic()
        return s

    async def prepare(self, s: Session, messages: list[dict], tools: list[dict] | None) -> Prepared:
        """The prompt for this call (the caller holds ``s.lock``). Raises ValueError naming the problem
        for messages that cannot be rendered; the session is unchanged then."""
        msgs = normalize_messages(messages)
        if not msgs:
            raise MessageError("messages is empty")
        if msgs[-1]["role"] == "assistant":
            raise MessageError("the last message is an assistant message: nothing to answer")
        if not s.prompt_ids:  # a new session
            prepared = Prepared((await s.renderer.begin(s.id, msgs, tools)).ids, "first")
        elif s.assistant is None:  # the previous turn was never sampled (an engine error, a disconnect)
            if msgs == s.messages and tools == s.tools:
                prepared = Prepared(s.prompt_ids, "retry")
            else:
                prepared = await self._restart(s, msgs, tools, RETRY_AFTER_FAILED_TURN,
                                               "the previous call produced no completion and this one changes "
                                               "the conversation")
        elif tools != s.tools:
            prepared = await self._restart(s, msgs, tools, TOOLS_CHANGED, "the tool definitions changed")
        else:
            n = len(s.messages)
            extends = len(msgs) > n and msgs[:n] == s.messages and _same_assistant(msgs[n], s.assistant)
            if extends:
                nxt = await s.renderer.bridge_next(s.id, msgs[n + 1:], s.turn)
                prompt = nxt.after(s.prompt_ids, s.last_completion)
                prepared = Prepared(prompt, "bridged") if nxt.brk is None else Prepared(prompt, "break", nxt.brk)
            else:
                at = _first_difference(msgs, [*s.messages, s.assistant])
                prepared = await self._restart(
                    s, msgs, tools, HISTORY_EDITED,
                    f"message {at} differs from the conversation this session sampled (edited or dropped history)")
        if prepared.brk is not None and s.prompt_ids:
            # the renderer closed the previous segment (prompt + its sampled completion) and keeps it
            s.closed_segment_tokens += len(s.prompt_ids) + (len(s.last_completion) if s.assistant else 0)
        s.last_completion = []  # bridged: it is in the new prompt now; otherwise the new prompt does not extend it
        s.messages, s.tools, s.prompt_ids, s.assistant = msgs, tools, prepared.prompt_ids, None
        s.bridged += prepared.kind == "bridged"
        s.breaks += prepared.brk is not None
        return prepared

    async def _restart(self, s: Session, msgs: list[dict], tools: list[dict] | None, reason: str,
                       detail: str) -> Prepared:
        nxt = await s.renderer.restart(s.id, msgs, tools, s.turn, reason, detail)
        return Prepared(nxt.ids, "break", nxt.brk)

    async def record(self, s: Session, completion_ids: list[int], logprobs: list[float] | None,
                     weight_version: int, assistant: dict) -> None:
        """Record a sampled turn (trainable tokens + logprobs) and what the client was answered."""
        await s.renderer.record_turn(s.id, SampledTurn(s.turn, completion_ids, logprobs, weight_version, assistant))
        s.assistant = assistant
        s.last_completion = list(completion_ids)
        s.turn += 1
        s.last_used = time.monotonic()

    async def sample(self, session_id: str) -> dict:
        s = self.sessions[session_id]
        out = await s.renderer.sample(session_id)
        out.update(session_id=session_id, turns=s.turn, bridged_turns=s.bridged)
        return out

    async def close(self, session_id: str, reason: str = "deleted") -> int:
        """Drop a session; with an output directory its samples are written first. Returns rows written."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            raise KeyError(session_id)
        if not s.prompt_ids:
            return 0
        if self.write_samples:
            meta = RolloutMeta(task_id=session_id, group_id=session_id, finish_reason=reason,
                               messages=[*s.messages, *([s.assistant] if s.assistant else [])], lora=s.lora)
            return await s.renderer.finish(session_id, meta)
        await s.renderer.discard(session_id)
        return 0

    async def evict_over_budget(self, on_end: Callable[[str], None] = lambda sid: None) -> list[str]:
        """While the sessions hold more than ``max_idle_bytes``, close the least recently used idle one (not
        one in a call); returns the evicted ids. Busy sessions alone may still exceed the bound. ``on_end``
        is called with each id as it leaves the table, so a metric counted there never lags the listing."""
        if self.max_idle_bytes is None:
            return []
        total = self.nbytes
        evicted: list[str] = []
        for s in sorted(self.sessions.values(), key=lambda s: s.last_used):
            if total <= self.max_idle_bytes:
                break
            if s.lock.locked():
                continue
            total -= s.nbytes
            # counted before close() awaits the renderer: the session leaves the listing at once, and the
            # count must never lag behind it
            self.evicted += 1
            evicted.append(s.id)
            on_end(s.id)
            await self.close(s.id, "evicted")
        return evicted

    async def expire(self, now: float | None = None, on_end: Callable[[str], None] = lambda sid: None) -> list[str]:
        """Close the sessions idle longer than the timeout (not those in a call); ``on_end`` as in
        :meth:`evict_over_budget`."""
        now = time.monotonic() if now is None else now
        stale = [sid for sid, s in self.sessions.items()
                 if now - s.last_used > self.idle_timeout_s and not s.lock.locked()]
        for sid in stale:
            if sid not in self.sessions:  # deleted by its client while an earlier one was being closed
                continue
            self.expired += 1  # counted before close() awaits, as in evict_over_budget
            on_end(sid)
            await self.close(sid, "expired")
        return stale
