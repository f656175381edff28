"""What every route does around an engine call: read the body within limits, build and validate the
sampling settings (errors name the request's own field), route and run the request (whole, or token by
token with stop strings), abort it when the client goes away, and account it in the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from ..engines.protocol import (
    EngineError,
    GenerateOutput,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    validate_request,
)
from ..engines.streaming import StreamDelta
from .schemas import BadRequest, Conflict, NotFound, PromptTokensDetails, Timing, TooLarge, Usage, decode
from .state import ServerState
from .stops import TextStream

_encoder = msgspec.json.Encoder()


class ClientGone(Exception):
    """The client disconnected: while its request ran (``stage`` "running": the engine request was
    aborted), or before its body was in ("body": nothing ran)."""

    def __init__(self, stage: str = "running") -> None:
        super().__init__(stage)
        self.stage = stage


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type="application/json")


def error_response(status: int, message: str, kind: str, param: str | None = None) -> Response:
    return json_response({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


async def read_struct(state: ServerState, request: Request, type_: type) -> Any:
    """The JSON body (:func:`read_body`) as ``type_``; an empty body is ``{}`` (all defaults; a required field is
    named missing)."""
    raw = await read_body(state, request)
    return decode(raw if raw.strip() else b"{}", type_)


async def read_body(state: ServerState, request: Request) -> bytes:
    """The body, refused with 413 when over ``state.max_body_bytes``: from Content-Length before a byte
    is read, and while reading a body without one (chunked)."""
    limit = state.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"request body of {int(declared)} bytes is over the server's limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"request body is over the server's limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # hung up mid-body: the client's doing, not a server or engine failure
        raise ClientGone("body") from None
    return b"".join(chunks)


async def _until_disconnect(request: Request) -> None:
    # the body has been read: the next ASGI message is the disconnect (uvicorn sends it when the socket closes)
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def watched(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work`` unless the client goes away first; then cancel it (which aborts the engine request)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


def check_model(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter ``model`` names (vLLM serves an adapter as a model of its name), None for the base model;
    404 for a name the server does not serve, as vLLM answers."""
    if model is None or model in state.model_names:
        return None
    if model in state.loras:
        return model
    adapters = f" or a loaded LoRA adapter ({', '.join(map(repr, state.loras))})" if state.loras else ""
    raise NotFound(f"The model `{model}` does not exist: this server serves {state.model_names[0]!r}{adapters}",
                   "model")


MAX_UNKNOWN_KEYS = 64  # distinct unknown sampling_params keys counted by name; the rest under "_other"


def note_unknown_sampling(state: ServerState, keys: list[str]) -> None:
    """Count ``sampling_params`` keys that vLLM's server, and so this one, ignores, and say so once per key on
    stderr, so that a typo (``max_token``) is visible. The label's set is bounded: a client sending made-up
    keys cannot grow /metrics without end."""
    m = state.metrics
    for key in keys:
        if m.get("unknown_sampling_params_total", key=key) == 0:
            if len(m.values.get("unknown_sampling_params_total", ())) >= MAX_UNKNOWN_KEYS or len(key) > 64:
                key = "_other"
            if m.get("unknown_sampling_params_total", key=key) == 0:
                print(f"tito serve: note: ignoring the unknown key sampling_params.{key!r} on "
                      "/inference/v1/generate (as vLLM does; counted in tito_unknown_sampling_params_total)",
                      file=sys.stderr, flush=True)
        m.inc("unknown_sampling_params_total", key=key)


def max_tokens_for(state: ServerState, prompt_len: int, requested: int | None, prompt_param: str = "prompt") -> int:
    room = state.fleet.max_model_len - prompt_len
    if requested is not None:
        return requested  # validate_request names an overflow with the numbers
    if room < 1:  # the prompt's fault: no max_tokens was sent
        raise BadRequest(f"{prompt_param}: the prompt ({prompt_len} tokens) leaves no room to sample: max_model_len "
                         f"is {state.fleet.max_model_len}", prompt_param)
    return min(room, state.default_max_tokens) if state.default_max_tokens else room


def sampling(state: ServerState, prompt_len: int, max_tokens: int | None, *, temperature: float, top_p: float,
             top_k: int, seed: int | None, n: int, stop_token_ids: list[int] | None, ignore_eos: bool,
             extra_stops: tuple[int, ...] = (), min_tokens: int = 0, top_logprobs: int = 0,
             prompt_logprobs: int | None = None, prompt_param: str = "prompt") -> SamplingParams:
    """The engine's sampling settings. As in vLLM, a completion stops at the model's EOS ids unless
    ``ignore_eos``, whatever ``stop_token_ids`` says (the engines themselves stop only where told), and
    ``min_tokens`` holds back those stops (and EOS) until that many tokens are sampled. ``prompt_param``:
    the route's name for the prompt, blamed when it leaves no room to sample."""
    eos = () if ignore_eos else tuple(state.engine_info().eos_token_ids)
    stops = tuple(dict.fromkeys([*extra_stops, *(stop_token_ids or []), *eos]))
    return SamplingParams(max_tokens=max_tokens_for(state, prompt_len, max_tokens, prompt_param), temperature=temperature,
                          top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=stops, logprobs=True,
                          ignore_eos=ignore_eos, n=n, min_tokens=min_tokens, top_logprobs=top_logprobs,
                          prompt_logprobs=prompt_logprobs)


def validated(state: ServerState, req: GenerateRequest, prefix: str = "", prompt_param: str = "prompt",
              max_param: str = "max_tokens") -> None:
    """validate_request, its errors named as this route's fields (``sampling_params.seed`` on the vLLM
    route, ``seed`` on the OpenAI ones; the prompt is ``token_ids``, ``prompt`` or ``messages``; chat's
    ``max_completion_tokens`` when it was the one sent). The message starts with the field's name unless
    it already says it."""
    try:
        validate_request(req, state.engine_info())
    except EngineError as exc:
        param = exc.param
        if param == "prompt":
            param = prompt_param
        elif param:
            param = prefix + (max_param if param == "max_tokens" else param)
        message = str(exc)
        if param and param.rsplit(".", 1)[-1] not in message:
            message = f"{param}: {message}"
        raise BadRequest(message, param) from None
    if req.request_id in state.fleet.where:
        raise Conflict(f"request_id {req.request_id!r} is already running; use another id (or abort it first)",
                       "request_id")


def account(state: ServerState, request: Request, req: GenerateRequest, out: GenerateOutput, call_s: float) -> None:
    """Fail a request the engine failed, and count it in the metrics."""
    failed = [r for r in out.results if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"the engine failed request {req.request_id}: {failed[0].error}")
    m = state.metrics
    engine_s = timing(out, call_s).engine_s
    m.observe("engine_seconds", engine_s)
    request.state.engine_s = getattr(request.state, "engine_s", 0.0) + engine_s  # for the overhead histogram
    cached = max((r.cached_prompt_tokens for r in out.results), default=0)
    m.inc("prompt_tokens_total", len(req.prompt_ids))
    m.inc("cached_prompt_tokens_total", cached)
    for r in out.results:
        m.inc("completion_tokens_total", len(r.completion_ids))
        m.observe("completion_tokens", len(r.completion_ids))
        m.inc("finish_total", finish=r.finish_reason)
        if r.finish_reason == "abort":
            m.inc("aborts_total", cause="engine")


async def generate(state: ServerState, request: Request, req: GenerateRequest, key: str | None,
                   ) -> tuple[GenerateOutput, float]:
    """Route, run (aborting on disconnect) and account one engine request (validated by the caller)."""
    out, call_s, _ = await watched(request, state.fleet.generate(req, key))
    account(state, request, req, out, call_s)
    return out, call_s


async def sample_stream(state: ServerState, request: Request, req: GenerateRequest, key: str | None,
                        texts: list[TextStream] | None = None) -> AsyncIterator[Any]:
    """One engine request token by token: ``StreamDelta`` items (each completion's new tokens, already cut
    at a stop string), then ``(output, call_s)`` with the stopped completions truncated to the token that
    completed their stop string (finish_reason "stop"). ``texts``: one TextStream per completion, fed here,
    when stop strings are watched; once every completion stopped, the engine request is aborted."""
    fed = [0] * req.sampling.n
    aborted = False
    async with contextlib.aclosing(state.fleet.generate_stream(req, key)) as items:
        async for item in items:
            if isinstance(item, StreamDelta):
                ids, lps, tops = item.token_ids, item.logprobs, item.top_logprobs
                if texts is not None:
                    t = texts[item.index]
                    if t.stopped:
                        continue
                    t.feed(ids)
                    if t.stopped:  # only the tokens up to the one that completed the stop string
                        keep = t.cut - fed[item.index]
                        ids, lps, tops = ids[:keep], _head(lps, keep), _head(tops, keep)
                        if not aborted and all(x.stopped for x in texts):
                            aborted = True
                            await state.fleet.abort([req.request_id])
                fed[item.index] += len(ids)
                if ids:
                    yield StreamDelta(item.index, ids, lps, tops)
                continue
            out, call_s, _ = item
            if texts is not None:
                out = _cut_at_stops(out, texts)
            account(state, request, req, out, call_s)
            # the tokens the engine sent with its output only (a backend that does not stream)
            for i, r in enumerate(out.results):
                if len(r.completion_ids) > fed[i]:
                    yield StreamDelta(i, r.completion_ids[fed[i]:],
                                      r.logprobs[fed[i]:] if r.logprobs is not None else None,
                                      r.top_logprobs[fed[i]:] if r.top_logprobs is not None else None)
            yield out, call_s


def _head(items: list | None, n: int) -> list | None:
    return items[:n] if items is not None else None


def _cut_at_stops(out: GenerateOutput, texts: list[TextStream]) -> GenerateOutput:
    results = []
    for r, t in zip(out.results, texts):
        if not t.stopped:  # the engine's output may hold tokens no delta carried: feed them
            t.feed(r.completion_ids[len(t.ids):])
        if t.stopped:
            r = msgspec.structs.replace(
                r, completion_ids=r.completion_ids[: t.cut], logprobs=_head(r.logprobs, t.cut),
                top_logprobs=_head(r.top_logprobs, t.cut), finish_reason="stop", stop_token_id=None)
        results.append(r)
    return GenerateOutput(out.request_id, out.prompt_len, results, out.prompt_logprobs)


async def run_to_end(state: ServerState, request: Request, req: GenerateRequest, key: str | None,
                     texts: list[TextStream] | None) -> tuple[GenerateOutput, float]:
    """A whole result: the plain engine call, or (with stop strings) the token stream consumed here."""
    if texts is None:
        return await generate(state, request, req, key)

    async def consume() -> tuple[GenerateOutput, float]:
        last = None
        async for item in sample_stream(state, request, req, key, texts):
            last = item
        return last

    return await watched(request, consume())


def timing(out: GenerateOutput, call_s: float) -> Timing:
    t = max((r.timings for r in out.results), key=lambda t: t.queue_s + t.prefill_s + t.decode_s)
    return Timing(engine_s=t.queue_s + t.prefill_s + t.decode_s, queue_s=t.queue_s, prefill_s=t.prefill_s,
                  decode_s=t.decode_s, engine_call_s=call_s)


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, cached_tokens=cached,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def request_id(given: str | None, prefix: str) -> str:
    return given if given else f"{prefix}-{uuid.uuid4().hex}"


def stop_token_reason(state: ServerState, r: GenerateResult) -> int | None:
    """vLLM's ``stop_reason`` for a stop token: None when the model's EOS ended the completion (vLLM checks EOS
    first and reports no reason for it), else the stop token id."""
    if r.stop_token_id is None or r.stop_token_id in state.engine_info().eos_token_ids:
        return None
    return r.stop_token_id


def stop_reason(state: ServerState, r: GenerateResult, text: TextStream | None) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string, or the stop token id (None for EOS), that ended the completion."""
    return text.stop if text is not None and text.stopped else stop_token_reason(state, r)
