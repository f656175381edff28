"""One chat-completions call on a session (``X-Session-ID``): its prompt (first render, bridge or break,
sessions.py), the record of what was sampled, and the session's lock held from the prompt to the record,
so a streamed turn is serialized and recorded exactly as a whole one. A turn refused before it reached an
engine leaves no new session behind. A turn sent with ``X-Session-End: true`` ends its session once it is
recorded (still under the lock, so no other call slips in between); how every session ends is
:func:`end_session`."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

from ..engines.protocol import GenerateResult
from .schemas import ChatBody
from .sessions import Prepared, Session
from .state import ServerState

# set by the chat route from the X-Session-End header, read when the turn opens (one value per request)
SESSION_END: contextvars.ContextVar[bool] = contextvars.ContextVar("tito_session_end", default=False)


@dataclass
class Turn:
    state: ServerState
    session: Session
    new: bool  # the session was opened by this call
    prepared: Prepared
    valid: bool = False  # passed every check: from here on, the session stays whatever happens
    recorded: bool = False
    closed: bool = False
    end: bool = False  # X-Session-End: end the session once this turn is recorded

    @property
    def prompt(self) -> list[int]:
        return self.prepared.prompt_ids

    @property
    def info(self) -> dict[str, Any]:
        s = self.session
        brk = self.prepared.brk
        return {"id": s.id, "turn": s.turn - 1, "prompt": self.prepared.kind, "break": brk.to_dict() if brk else None,
                "ended": self.end}

    def validated(self) -> None:
        self.valid = True
        m = self.state.metrics
        m.inc("session_turns_total", kind=self.prepared.kind)
        if self.prepared.brk is not None:
            m.inc("breaks_total", reason=self.prepared.brk.reason)

    async def record(self, result: GenerateResult, assistant: dict) -> None:
        """Record the sampled turn (not an aborted one: the same messages again retry it)."""
        if result.finish_reason != "abort":
            await self.state.sessions.record(self.session, result.completion_ids, result.logprobs,
                                             result.weight_version, assistant)
            self.recorded = True

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        ended = False
        try:
            if self.new and not self.valid:  # refused before the engine: no session was created
                await discard_new(self.state, self.session)
            elif self.end and self.recorded:  # a failed last turn keeps the session: the client may retry it
                await end_session(self.state, self.session, "ended", how="header", locked=True)
                ended = True
        finally:
            self.session.lock.release()
        if not ended:
            await evict_over_budget(self.state)


async def discard_new(state: ServerState, s: Session) -> None:
    if state.sessions.sessions.get(s.id) is s:
        del state.sessions.sessions[s.id]
    if s.prompt_ids:  # its renderer began the rollout
        await s.renderer.discard(s.id)


async def end_session(state: ServerState, s: Session, reason: str, *, how: str, locked: bool = False,
                      flush: bool = False) -> int:
    """End a session: its samples finished (written with the next shard when the server has an output
    directory; ``flush``: written now), its engine's KV for it dropped, its routing forgotten. ``locked``:
    the caller holds ``s.lock``. Returns the rows written."""
    if not locked:
        await s.lock.acquire()
    try:
        if state.sessions.get(s.id) is not s:  # ended meanwhile (expired, evicted, deleted)
            return 0
        rows = await state.sessions.close(s.id, reason)
        if flush and rows and state.sessions.write_samples:
            await s.renderer.flush()
    finally:
        if not locked:
            s.lock.release()
    await state.fleet.end_session(s.id)
    state.metrics.inc("sessions_ended_total", how=how)
    return rows


async def evict_over_budget(state: ServerState) -> None:
    """Enforce ``sessions.max_idle_bytes``: the least recently used idle sessions go first."""
    def counted(sid: str) -> None:
        state.metrics.inc("sessions_ended_total", how="evicted")

    for sid in await state.sessions.evict_over_budget(counted):
        await state.fleet.end_session(sid)


async def open_turn(state: ServerState, session_id: str, body: ChatBody) -> Turn:
    """Open (or create) the session, take its lock and build this turn's prompt; a message problem is a
    ValueError (400) and a new session is dropped again."""
    new = state.sessions.get(session_id) is None
    s = state.sessions.open(session_id)
    await s.lock.acquire()
    try:
        prepared = await state.sessions.prepare(s, body.messages, body.tools)
    except BaseException:
        try:
            if new:
                await discard_new(state, s)
        finally:
            s.lock.release()
        raise
    return Turn(state, s, new, prepared, end=SESSION_END.get())
