"""Token-by-token results: the optional ``generate_stream`` of an engine backend.

``generate_stream(request)`` is an async iterator of :class:`StreamDelta` (new tokens of completion
``index``, as they are sampled) ending with the request's :class:`GenerateOutput`, which is
authoritative: the deltas of a completion are a prefix of its final ``completion_ids`` (a consumer that
missed some takes the rest from the output). A backend without it is streamed as one final output
(:func:`stream_of`). Stopping early is an ``abort`` of the request id, after which the stream still ends
with the output (finish_reason "abort"); cancelling the iteration aborts the request too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from .protocol import GenerateOutput, GenerateRequest, TokenLogprobs

# listener(index, new ids, their logprobs, their top logprobs or None): called on the event loop as tokens come
Listener = Callable[..., None]


class StreamDelta(msgspec.Struct):
    index: int  # which of the request's n completions
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[TokenLogprobs] | None = None  # sampling.top_logprobs > 0


async def stream_with_listener(run: Callable[[Listener], Awaitable[GenerateOutput]]) -> AsyncIterator[Any]:
    """Turn a generate that calls ``listener(index, ids, logprobs[, top_logprobs])`` as it samples (on the
    event loop) into a stream: deltas as they come (coalesced when several arrived at once), then the output."""
    queue: asyncio.Queue = asyncio.Queue()

    def listener(i: int, ids: list[int], lps: list[float], tops: list[TokenLogprobs] | None = None) -> None:
        queue.put_nowait(StreamDelta(i, list(ids), list(lps), None if tops is None else list(tops)))

    task = asyncio.ensure_future(run(listener))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while True:
            item = await queue.get()
            if item is None:
                break
            merged = [item]
            while not queue.empty():  # coalesce what piled up while the consumer was busy
                nxt = queue.get_nowait()
                if nxt is None:
                    queue.put_nowait(None)
                    break
                if nxt.index == merged[-1].index:
                    merged[-1].token_ids += nxt.token_ids
                    if merged[-1].logprobs is not None and nxt.logprobs is not None:
                        merged[-1].logprobs += nxt.logprobs
                    if merged[-1].top_logprobs is not None and nxt.top_logprobs is not None:
                        merged[-1].top_logprobs += nxt.top_logprobs
                else:
                    merged.append(nxt)
            for delta in merged:
                yield delta
        yield task.result()
    finally:
        if not task.done():  # the consumer went away: cancelling generate aborts the request
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def stream_of(backend: Any, request: GenerateRequest) -> AsyncIterator[Any]:
    """``backend.generate_stream(request)`` when the backend has one, else its whole output at once."""
    stream = getattr(backend, "generate_stream", None)
    if stream is None:
        yield await backend.generate(request)
        return
    async for item in stream(request):
        yield item
