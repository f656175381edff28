"""The model a verifiers episode talks to: an OpenAI chat-completions endpoint on loopback whose every call
becomes one turn of tito's own rollout loop.

Each rollout gets a path of its own, ``/episodes/<key>/v1/chat/completions`` (verifiers' ``EvalClient`` relays
its harness's requests there). A request is not sampled here: it is queued as a :class:`ModelCall` for the
rollout's environment, which hands its messages to tito's loop (tito renders, bridges and samples the tokens)
and answers the call with the assistant message tito parsed from them. Requests carry the endpoint's secret as
their bearer key, so no other local process can speak for a rollout. Streaming requests (what verifiers' chat
program sends) get the answer as one content chunk, the finish chunk and a usage chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

_SERVE_START_S = 30.0


class CallRefused(Exception):
    """The rollout will not answer this call (it ended in tito first); the endpoint replies 400 with the reason."""


@dataclass
class ModelCall:
    """One chat-completions request of an episode, waiting for tito's answer."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply: asyncio.Future = field(repr=False)


@dataclass
class Reply:
    """The answer to a call: the assistant message (OpenAI shape, arguments as JSON strings) and why it ended."""

    message: dict[str, Any]
    finish_reason: str


def _quiet_server(app: Any) -> Any:
    """uvicorn on an ephemeral loopback port, without its signal handlers: SIGINT and SIGTERM stay the run's."""
    import uvicorn  # here, not at import: the registry imports this module in every tito process

    class Quiet(uvicorn.Server):
        def capture_signals(self):  # noqa: D102 - the run owns signals
            return contextlib.nullcontext()

    return Quiet(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                access_log=False))


class Endpoint:
    def __init__(self) -> None:
        self.secret = secrets.token_urlsafe(24)
        self.episodes: dict[str, asyncio.Queue[ModelCall]] = {}
        self.port: int | None = None
        self._serving: asyncio.Task | None = None  # held: a task only the loop references can be collected
        self.app = Starlette(routes=[Route("/episodes/{key}/v1/chat/completions", self._chat, methods=["POST"])])

    async def start(self) -> None:
        server = _quiet_server(self.app)
        self._serving = asyncio.create_task(server.serve(), name="tito-verifiers-endpoint")
        deadline = time.monotonic() + _SERVE_START_S
        while not server.started:
            if self._serving.done():
                self._serving.result()  # its error
                raise RuntimeError("the verifiers endpoint stopped while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the verifiers endpoint did not start within {_SERVE_START_S:g} s")
            await asyncio.sleep(0.01)
        self.port = server.servers[0].sockets[0].getsockname()[1]

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{key}/v1"

    async def _chat(self, request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {self.secret}":
            return _error(401, "this endpoint answers only the verifiers episodes tito started")
        queue = self.episodes.get(request.path_params["key"])
        if queue is None:
            return _error(404, "no rollout is waiting on this episode (it ended, or was never started)")
        try:
            body = await request.json()
        except ValueError as e:
            return _error(400, f"the request body is not JSON: {e}")
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return _error(400, "`messages` must be a list of message objects")
        tools = body.get("tools") or None
        call = ModelCall(messages, tools if isinstance(tools, list) else None,
                         asyncio.get_running_loop().create_future())
        queue.put_nowait(call)
        try:
            reply: Reply = await call.reply
        except CallRefused as e:
            return _error(400, str(e))
        model = body.get("model") or "tito"
        if body.get("stream"):
            return StreamingResponse(_chunks(reply, model, bool((body.get("stream_options") or {}).get(
                "include_usage"))), media_type="text/event-stream")
        return JSONResponse(_completion(reply, model))


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                        status_code=status)


# no tokens are counted here: tito's loop owns the budgets (max_tokens_per_turn, max_tokens_per_rollout)
_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def _completion(reply: Reply, model: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": reply.message, "finish_reason": reply.finish_reason,
                                         "logprobs": None}], "usage": _USAGE}


async def _chunks(reply: Reply, model: str, include_usage: bool):
    base = {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}
    delta: dict[str, Any] = {"role": "assistant", "content": reply.message.get("content") or ""}
    if reply.message.get("reasoning_content"):
        delta["reasoning_content"] = reply.message["reasoning_content"]
    if reply.message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(reply.message["tool_calls"])]
    events = [{**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
              {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]}]
    if include_usage:
        events.append({**base, "choices": [], "usage": _USAGE})
    for event in events:
        yield f"data: {json.dumps(event)}\n\n".encode()
    yield b"data: [DONE]\n\n"
