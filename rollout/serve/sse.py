"""Server-sent events (``stream=true``): OpenAI's ``data: {json}`` lines ending with ``data: [DONE]``.

:class:`SSEResponse` sends each event as it is produced and watches the connection at the same time: a
client that hangs up cancels the producer (which aborts the engine request: rollout/serve/fleet.py),
even while nothing is being sent (e.g. text held back behind a possible stop string).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class SSEResponse(Response):
    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[bool], Awaitable[None]] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        # no body attribute: init_headers then sets no Content-Length (the length is not known)
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.events = events
        self.on_close = on_close  # called with True when the client went away first
        self.client_gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        producer, watcher = asyncio.ensure_future(pump()), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not producer.done():  # the client hung up: cancelling the producer aborts the engine request
                self.client_gone = True
                producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await producer
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await self.events.aclose()  # type: ignore[attr-defined]
            if self.on_close is not None:
                await self.on_close(self.client_gone)
