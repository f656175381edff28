"""``stream=true`` on ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's chunk shapes over SSE,
token by token from the engine (``Fleet.generate_stream``; an engine without ``generate_stream`` gives its
whole result as one delta).

Text is released only when final (rollout/serve/stops.py): never the start of a possible stop string, never
half a UTF-8 character. Chat deltas come from parsing the tokens so far (the same parser as the whole
answer), so content and reasoning stream separately; tool calls come whole in the last chunk. The streamed
text concatenates to the whole answer's; a session turn is recorded from the same final output as a whole
one, while the session's lock is held. ``stream_options.include_usage`` adds a usage chunk (empty
``choices``); the stream ends with ``data: [DONE]``. An error after the stream started is an
``{"error": {...}}`` event, then ``[DONE]``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from ..engines.protocol import root_cause
from ..engines.streaming import StreamDelta
from . import calls
from .logprobs import chat_logprobs, completion_logprobs
from .responses import Call, chat_choice, chat_finish, token_decoder
from .schemas import ChatBody, CompletionsBody
from .sse import DONE, SSEResponse, event
from .state import ServerState


def _error_event(exc: BaseException) -> bytes:
    cause = root_cause(exc)
    status = getattr(cause, "status", 400 if isinstance(cause, ValueError) else 500)
    return event({"error": {"message": str(cause), "type": type(cause).__name__, "param": getattr(cause, "param", None),
                            "code": status}})


def _include_usage(body: ChatBody | CompletionsBody) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _response(state: ServerState, events: AsyncIterator[bytes], c: Call, turn: Any = None) -> SSEResponse:
    async def on_close(client_gone: bool) -> None:
        if client_gone:
            state.metrics.inc("client_disconnects_total", stage="running")
            state.metrics.inc("aborts_total", cause="client_disconnect")
        if turn is not None:
            await turn.close()

    headers = {"X-Tito-Ignored": ",".join(c.ignored)} if c.ignored else None
    return SSEResponse(events, on_close, headers)


def stream_completion(state: ServerState, request: Request, body: CompletionsBody, c: Call,
                      decode_text: Callable[[list[int]], str]) -> SSEResponse:
    req, prompt = c.reqs[0], c.prompts[0]
    token_text = token_decoder(state)
    created, model = int(time.time()), state.model_names[0]

    def chunk(choices: list[dict], **extra: Any) -> bytes:
        return event({"id": c.rid, "object": "text_completion", "created": created, "model": model,
                      "choices": choices, **extra})

    async def events() -> AsyncIterator[bytes]:
        texts = c.texts(decode_text)
        first = [True] * req.sampling.n
        sent: list[list[int]] = [[] for _ in range(req.sampling.n)]  # each completion's ids so far
        try:
            async for item in calls.sample_stream(state, request, req, c.key, texts):
                if isinstance(item, StreamDelta):
                    i = item.index
                    piece = texts[i].take()
                    ch: dict[str, Any] = {"index": i, "text": piece, "logprobs": None, "finish_reason": None,
                                          "stop_reason": None}
                    if body.logprobs is not None and item.logprobs is not None:
                        ch["logprobs"] = completion_logprobs(token_text, item.token_ids, item.logprobs,
                                                             item.top_logprobs, body.logprobs,
                                                             body.return_tokens_as_token_ids, sent[i])
                    if body.return_token_ids:
                        ch["token_ids"] = item.token_ids
                        if first[i]:
                            ch["prompt_token_ids"] = prompt
                    first[i] = False
                    sent[i] += item.token_ids
                    if piece or len(ch) > 5 or ch["logprobs"] is not None:
                        yield chunk([ch])
                    continue
                out, _ = item
                for i, r in enumerate(out.results):
                    texts[i].finish()
                    yield chunk([{"index": i, "text": texts[i].take(), "logprobs": None,
                                  "finish_reason": r.finish_reason, "stop_reason": calls.stop_reason(state, r, texts[i])}])
                if _include_usage(body):
                    yield chunk([], usage=calls.usage(len(prompt), sum(len(r.completion_ids) for r in out.results),
                                                      max(r.cached_prompt_tokens for r in out.results)))
        except Exception as exc:  # after the headers went out: the error is an event
            yield _error_event(exc)
        yield DONE

    return _response(state, events(), c)


def _safe_content(content: str, stops: list[str]) -> str:
    """The part of partial content that is final: before any stop string, without a suffix that could
    start one, without a trailing incomplete character."""
    end = len(content)
    for s in stops:
        at = content.find(s)
        if at >= 0:
            end = min(end, at)
    for s in stops:
        for h in range(min(len(s) - 1, end), 0, -1):
            if s.startswith(content[end - h: end]):
                end -= h
                break
    while end and content[end - 1] == "\ufffd":
        end -= 1
    return content[:end]


def _extend(sent: str, now: str) -> str:
    """What to send so the client's text becomes ``now`` (nothing when ``now`` does not extend it)."""
    return now[len(sent):] if len(now) > len(sent) and now.startswith(sent) else ""


def stream_chat(state: ServerState, request: Request, body: ChatBody, c: Call, turn: Any) -> SSEResponse:
    req, prompt = c.reqs[0], c.prompts[0]
    parser, tok, token_text = state.parser, state.parser.tokenizer, token_decoder(state)
    created, model = int(time.time()), state.model_names[0]
    n = req.sampling.n

    def chunk(choices: list[dict], **extra: Any) -> bytes:
        return event({"id": c.rid, "object": "chat.completion.chunk", "created": created, "model": model,
                      "choices": choices, **extra})

    async def events() -> AsyncIterator[bytes]:
        texts = c.texts(lambda ids: tok.decode(ids, skip_special_tokens=True)) if c.stops else None
        ids: list[list[int]] = [[] for _ in range(n)]
        sent = [{"content": "", "reasoning_content": ""} for _ in range(n)]
        try:
            for i in range(n):
                first: dict[str, Any] = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}
                yield chunk([first], **({"prompt_token_ids": prompt} if body.return_token_ids and i == 0 else {}))
            async for item in calls.sample_stream(state, request, req, c.key, texts):
                if isinstance(item, StreamDelta):
                    i = item.index
                    ids[i] += item.token_ids
                    message = parser.parse_response(ids[i], prompt, body.tools).to_message()
                    delta = {}
                    for k in ("reasoning_content", "content"):
                        now = message.get(k) or ""
                        now = _safe_content(now, c.stops) if k == "content" else now.rstrip("\ufffd")
                        piece = _extend(sent[i][k], now)
                        if piece:
                            delta[k] = piece
                            sent[i][k] = now
                    ch: dict[str, Any] = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                    if body.logprobs and item.logprobs is not None:
                        ch["logprobs"] = chat_logprobs(token_text, item.token_ids, item.logprobs, item.top_logprobs,
                                                       body.top_logprobs, body.return_tokens_as_token_ids,
                                                       ids[i][: len(ids[i]) - len(item.token_ids)])
                    if body.return_token_ids:
                        ch["token_ids"] = item.token_ids
                    if delta or ch["logprobs"] is not None or body.return_token_ids:
                        yield chunk([ch])
                    continue
                out, _ = item
                finals = [chat_choice(state, body, r, prompt, texts[i] if texts else None)
                          for i, r in enumerate(out.results)]
                if turn is not None:
                    await turn.record(out.results[0], finals[0][1])
                for i, (r, assistant, parsed, text) in enumerate(finals):
                    delta = {}
                    for k in ("reasoning_content", "content"):
                        piece = _extend(sent[i][k], assistant.get(k) or "")
                        if piece:
                            delta[k] = piece
                    if assistant.get("tool_calls"):
                        delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(assistant["tool_calls"])]
                    final: dict[str, Any] = {
                        "index": i, "delta": delta, "logprobs": None, "finish_reason": chat_finish(r, assistant),
                        "stop_reason": calls.stop_reason(state, r, text),
                        "tool_call_attempts": [{"name": t.name, "status": str(t.status), "error": t.error, "raw": t.raw}
                                               for t in parsed.tool_calls]}
                    extra = {"session": turn.info} if turn is not None and i == n - 1 else {}
                    yield chunk([final], **extra)
                if _include_usage(body):
                    yield chunk([], usage=calls.usage(len(prompt), sum(len(r.completion_ids) for r in out.results),
                                                      max(r.cached_prompt_tokens for r in out.results)))
        except Exception as exc:
            yield _error_event(exc)
        yield DONE

    return _response(state, events(), c, turn)
