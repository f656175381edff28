"""The HTTP routes (Starlette): vLLM's token-in/token-out API, OpenAI chat with sessions, admin, metrics.

Bodies are decoded and encoded with msgspec (schemas.py). Every refusal is a JSON error
``{"error": {"message", "type", "code"}}``: 400 for bad input (the message names the problem), 404 for
an unknown session, 429 when too many sessions are held, 500 when an engine failed the request, 503
when an engine died; the server keeps serving in every case. A client that disconnects while its
request runs has that request aborted on its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from renderers import Renderer

from ..engines.protocol import (
    EngineError,
    EngineInfo,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    validate_request,
)
from .fleet import EngineUnavailable, Fleet
from .metrics import Metrics, server_metrics
from .schemas import (
    AbortBody,
    BadRequest,
    ChatBody,
    ChoiceLogprobs,
    CompletionsBody,
    GenerateBody,
    GenerateChoice,
    GenerateResponse,
    PromptTokensDetails,
    Timing,
    TokenLogprob,
    UpdateWeightsBody,
    Usage,
    check_unsupported,
    decode,
    struct_values,
)
from .sessions import SessionLimit, SessionManager

_encoder = msgspec.json.Encoder()


class ClientGone(Exception):
    """The client disconnected; its request was aborted."""


@dataclass
class ServerState:
    """Everything the routes use. ``parser`` is a renderer on the served model's tokenizer: it renders
    session-less chat calls, parses completions and supplies the stop ids (the same code as the
    renderer actors, as in ``tito run``)."""

    fleet: Fleet
    sessions: SessionManager
    parser: Renderer
    model_names: list[str]  # the first is the served name; all are accepted as `model`
    root: str
    default_max_tokens: int | None = None
    sweep_interval_s: float = 5.0
    metrics: Metrics = field(default_factory=server_metrics)
    created: int = field(default_factory=lambda: int(time.time()))

    def engine_info(self) -> EngineInfo:
        info = self.fleet.infos[0]
        return EngineInfo(backend=info.backend, model=info.model, vocab_size=self.fleet.vocab_size,
                          max_model_len=self.fleet.max_model_len, weight_version=self.fleet.weight_version)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type="application/json")


def _error(status: int, message: str, kind: str) -> Response:
    return _json({"error": {"message": message, "type": kind, "code": status}}, status)


def _root_cause(exc: BaseException) -> BaseException:
    """A Ray task error's original exception (its str is the message alone, not the remote traceback)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


async def _until_disconnect(request: Request) -> None:
    # the body has been read: the next ASGI message is the disconnect (uvicorn sends it when the socket closes)
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _watched(request: Request, work: Awaitable[Any]) -> Any:
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


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise BadRequest(f"unknown model {model!r}: this server serves {state.model_names[0]!r}")


def _max_tokens(state: ServerState, prompt_len: int, requested: int | None) -> int:
    room = state.fleet.max_model_len - prompt_len
    if requested is not None:
        return requested  # validate_request names an overflow with the numbers
    if room < 1:
        raise BadRequest(f"prompt ({prompt_len} tokens) leaves no room to sample: max_model_len is "
                         f"{state.fleet.max_model_len}")
    return min(room, state.default_max_tokens) if state.default_max_tokens else room


def _sampling(state: ServerState, prompt_len: int, max_tokens: int | None, *, temperature: float, top_p: float,
              top_k: int, seed: int | None, n: int, stop_token_ids: list[int] | None, ignore_eos: bool,
              extra_stops: tuple[int, ...] = ()) -> SamplingParams:
    stops = tuple(dict.fromkeys([*extra_stops, *(stop_token_ids or [])]))
    return SamplingParams(max_tokens=_max_tokens(state, prompt_len, max_tokens), temperature=temperature, top_p=top_p,
                          top_k=top_k, seed=seed, stop_token_ids=stops, logprobs=True, ignore_eos=ignore_eos, n=n)


async def _generate(state: ServerState, request: Request, req: GenerateRequest, key: str | None,
                    ) -> tuple[GenerateOutput, float]:
    """Validate, route, run (aborting on disconnect) and account one engine request."""
    validate_request(req, state.engine_info())
    out, call_s, _ = await _watched(request, state.fleet.generate(req, key))
    failed = [r for r in out.results if r.finish_reason == "error"]
    if failed:
        raise RuntimeError(f"the engine failed request {req.request_id}: {failed[0].error}")
    m = state.metrics
    engine_s = _timing(out, call_s).engine_s
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
    return out, call_s


def _count_abandoned(state: ServerState, out: GenerateOutput) -> None:
    """How a request ended whose client went away (the engine's answer to the abort)."""
    for r in out.results:
        state.metrics.inc("finish_total", finish=r.finish_reason)
        state.metrics.inc("completion_tokens_total", len(r.completion_ids))


def _timing(out: GenerateOutput, call_s: float) -> Timing:
    t = max((r.timings for r in out.results), key=lambda t: t.queue_s + t.prefill_s + t.decode_s)
    return Timing(engine_s=t.queue_s + t.prefill_s + t.decode_s, queue_s=t.queue_s, prefill_s=t.prefill_s,
                  decode_s=t.decode_s, engine_call_s=call_s)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, cached_tokens=cached,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _request_id(given: str | None, prefix: str) -> str:
    return given if given else f"{prefix}-{uuid.uuid4().hex}"


# ---- routes --------------------------------------------------------------------------------------


async def generate(state: ServerState, request: Request) -> Response:
    body: GenerateBody = decode(await request.body(), GenerateBody)
    _check_model(state, body.model)
    if body.stream:
        raise BadRequest("stream=true is not supported on /inference/v1/generate")
    if body.output_mode != "tokens":
        raise BadRequest(f"output_mode {body.output_mode!r} is not supported: this server is tokens-only")
    if body.kv_transfer_params:
        raise BadRequest("kv_transfer_params (disaggregated prefill) is not supported")
    sp = body.sampling_params
    check_unsupported(struct_values(sp))
    rid = _request_id(body.request_id, "gen")
    sampling = _sampling(state, len(body.token_ids), sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                         top_k=sp.top_k, seed=sp.seed, n=sp.n, stop_token_ids=sp.stop_token_ids,
                         ignore_eos=sp.ignore_eos)
    # the salt keys the engine's session KV too: requests sharing a salt share their prefix cache
    req = GenerateRequest(request_id=rid, prompt_ids=body.token_ids, sampling=sampling, session_id=body.cache_salt)
    out, call_s = await _generate(state, request, req, body.cache_salt)
    want_lp = sp.logprobs is not None
    choices = []
    for i, r in enumerate(out.results):
        lps = None
        if want_lp and r.logprobs is not None:
            lps = ChoiceLogprobs([TokenLogprob(t, lp, f"token_id:{t}") for t, lp in zip(r.completion_ids, r.logprobs)])
        choices.append(GenerateChoice(index=i, token_ids=r.completion_ids, logprobs=lps, finish_reason=r.finish_reason,
                                      stop_reason=r.stop_token_id, weight_versions=[r.weight_version]))
    cached = max(r.cached_prompt_tokens for r in out.results)
    completion = sum(len(r.completion_ids) for r in out.results)
    resp = GenerateResponse(request_id=rid, choices=choices, prompt_token_ids=body.token_ids,
                            usage=_usage(len(body.token_ids), completion, cached), metrics=_timing(out, call_s))
    return _json(resp)


def _token_ids_prompt(prompt: Any) -> list[list[int]]:
    def ids(p: Any, where: str) -> list[int]:
        if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise BadRequest(f"{where} must be a list of token ids (integers)")
        return p

    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise BadRequest("prompt: text prompts are not supported by this token-in/token-out server; send token ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return [ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [ids(prompt, "prompt")]


async def completions(state: ServerState, request: Request) -> Response:
    body: CompletionsBody = decode(await request.body(), CompletionsBody)
    _check_model(state, body.model)
    if body.stream:
        raise BadRequest("stream=true is not supported")
    if body.echo:
        raise BadRequest("echo is not supported")
    check_unsupported(struct_values(body), where="request")
    prompts = _token_ids_prompt(body.prompt)
    rid = _request_id(body.request_id, "cmpl")
    reqs = []
    for i, prompt in enumerate(prompts):
        sampling = _sampling(state, len(prompt), body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                             top_k=body.top_k, seed=body.seed, n=body.n, stop_token_ids=body.stop_token_ids,
                             ignore_eos=body.ignore_eos)
        sub = rid if len(prompts) == 1 else f"{rid}-{i}"
        reqs.append(GenerateRequest(request_id=sub, prompt_ids=prompt, sampling=sampling, session_id=body.cache_salt))
    for r in reqs:  # refuse the whole batch before anything runs
        validate_request(r, state.engine_info())
    outs = await asyncio.gather(*(_generate(state, request, r, body.cache_salt) for r in reqs))
    tok = state.parser.tokenizer
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for prompt, (out, _) in zip(prompts, outs):
        prompt_tokens += len(prompt)
        cached += max(r.cached_prompt_tokens for r in out.results)
        for r in out.results:
            completion_tokens += len(r.completion_ids)
            choice: dict[str, Any] = {"index": len(choices), "text": tok.decode(r.completion_ids),
                                      "finish_reason": r.finish_reason, "stop_reason": r.stop_token_id}
            if body.logprobs is not None and r.logprobs is not None:
                tokens = ([f"token_id:{t}" for t in r.completion_ids] if body.return_tokens_as_token_ids
                          else [tok.decode([t]) for t in r.completion_ids])
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": r.logprobs, "top_logprobs": None,
                                      "text_offset": None}
            else:
                choice["logprobs"] = None
            if body.return_token_ids:
                choice["token_ids"] = r.completion_ids
                choice["prompt_token_ids"] = prompt
            choice["weight_versions"] = [r.weight_version]
            choices.append(choice)
    return _json({"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_names[0],
                  "choices": choices, "usage": _usage(prompt_tokens, completion_tokens, cached)})


async def chat_completions(state: ServerState, request: Request) -> Response:
    body: ChatBody = decode(await request.body(), ChatBody)
    _check_model(state, body.model)
    if body.stream:
        raise BadRequest("stream=true is not supported")
    check_unsupported(struct_values(body), where="request")
    if body.tool_choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice {body.tool_choice!r} is not supported (only 'auto' or 'none')")
    if body.top_logprobs is not None and body.top_logprobs > 1:
        raise BadRequest("top_logprobs > 1 is not supported: only the sampled token's logprob is returned")
    session_id = request.headers.get("x-session-id")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    rid = _request_id(body.request_id, "chatcmpl")
    sampling_kw = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed, n=body.n,
                       stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                       extra_stops=tuple(state.parser.stop_token_ids))
    session_info = None
    if session_id:
        if body.n != 1:
            raise BadRequest("a session (X-Session-ID) samples one trajectory: n must be 1")
        if body.chat_template_kwargs:
            raise BadRequest("chat_template_kwargs cannot change within a session; set renderer.template_kwargs "
                             "in the server config")
        s = state.sessions.open(session_id)
        async with s.lock:
            prepared = await state.sessions.prepare(s, body.messages, body.tools)
            prompt = prepared.prompt_ids
            state.metrics.inc("session_turns_total", kind=prepared.kind)
            if prepared.brk is not None:
                state.metrics.inc("breaks_total", reason=prepared.brk["reason"])
            sampling = _sampling(state, len(prompt), max_tokens, **sampling_kw)
            req = GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=sampling, session_id=session_id)
            out, call_s = await _generate(state, request, req, session_id)
            result = out.results[0]
            parsed = state.parser.parse_response(result.completion_ids, prompt, body.tools)
            assistant = parsed.to_message()
            if result.finish_reason != "abort":
                await state.sessions.record(s, result.completion_ids, result.logprobs, result.weight_version,
                                            assistant)
            session_info = {"id": session_id, "turn": s.turn - 1, "prompt": prepared.kind, "break": prepared.brk}
            parsed_all = [(result, parsed, assistant)]
    else:
        prompt = state.parser.render(body.messages, body.tools, add_generation_prompt=True,
                                     **(body.chat_template_kwargs or {})).token_ids
        sampling = _sampling(state, len(prompt), max_tokens, **sampling_kw)
        req = GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=sampling, session_id=body.cache_salt)
        out, call_s = await _generate(state, request, req, body.cache_salt)
        parsed_all = []
        for r in out.results:
            parsed = state.parser.parse_response(r.completion_ids, prompt, body.tools)
            parsed_all.append((r, parsed, parsed.to_message()))
    choices = []
    for i, (r, parsed, assistant) in enumerate(parsed_all):
        message = {"role": "assistant", "content": assistant.get("content"),
                   "reasoning_content": assistant.get("reasoning_content"),
                   "tool_calls": assistant.get("tool_calls", [])}
        finish = r.finish_reason
        if finish == "stop" and assistant.get("tool_calls"):
            finish = "tool_calls"
        choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish,
                                  "stop_reason": r.stop_token_id, "weight_versions": [r.weight_version],
                                  # every tool-call attempt with its status, malformed ones included (RL rewards them)
                                  "tool_call_attempts": [{"name": c.name, "status": str(c.status), "error": c.error,
                                                          "raw": c.raw} for c in parsed.tool_calls]}
        if body.logprobs and r.logprobs is not None:
            choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None,
                                               "top_logprobs": []} for t, lp in zip(r.completion_ids, r.logprobs)]}
        else:
            choice["logprobs"] = None
        if body.return_token_ids:
            choice["token_ids"] = r.completion_ids
        choices.append(choice)
    cached = max(r.cached_prompt_tokens for r in out.results)
    resp: dict[str, Any] = {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_names[0],
        "choices": choices,
        "usage": _usage(len(prompt), sum(len(r.completion_ids) for r in out.results), cached),
    }
    if body.return_token_ids:
        resp["prompt_token_ids"] = prompt
    if session_info is not None:
        resp["session"] = session_info
    return _json(resp)


async def abort_requests(state: ServerState, request: Request) -> Response:
    body: AbortBody = decode(await request.body(), AbortBody)
    aborted = await state.fleet.abort(body.request_ids)
    state.metrics.inc("aborts_total", len(aborted), cause="abort_requests")
    return _json({"aborted": aborted})


async def models(state: ServerState, request: Request) -> Response:
    card = {"id": state.model_names[0], "object": "model", "created": state.created, "owned_by": "tito",
            "root": state.root, "parent": None, "max_model_len": state.fleet.max_model_len}
    return _json({"object": "list", "data": [card]})


async def health(state: ServerState, request: Request) -> Response:
    reports = await state.fleet.health()
    alive = sum(bool(r.get("ok")) for r in reports)
    status = "ok" if alive == len(reports) else ("degraded" if alive else "unavailable")
    return _json({"status": status, "engines": reports}, 200 if alive else 503)


async def metrics(state: ServerState, request: Request) -> Response:
    m, fleet = state.metrics, state.fleet
    m.set("sessions_active", len(state.sessions.sessions))
    m.set("requests_in_flight", fleet.in_flight)
    prompt = m.get("prompt_tokens_total")
    m.set("cache_reuse_ratio", m.get("cached_prompt_tokens_total") / prompt if prompt else 0.0)
    m.set("routing_moves", fleet.router.moves)
    for i, load in enumerate(fleet.router.load):
        m.set("engine_load", 0 if i in fleet.dead else load, engine=str(i))
    m.set("paused", int(fleet.paused))
    m.set("weight_version", fleet.weight_version)
    return PlainTextResponse(m.render(), media_type="text/plain; version=0.0.4")


async def pause(state: ServerState, request: Request) -> Response:
    mode = request.query_params.get("mode", "wait")
    if mode not in ("wait", "abort", "keep"):
        raise BadRequest(f"pause mode must be 'wait', 'abort' or 'keep', got {mode!r}")
    running = list(state.fleet.where)
    await state.fleet.pause(mode)
    if mode == "abort":
        state.metrics.inc("aborts_total", len(running), cause="pause")
    return _json({"paused": True, "mode": mode})


async def resume(state: ServerState, request: Request) -> Response:
    state.fleet.resume()
    return _json({"paused": False})


async def is_paused(state: ServerState, request: Request) -> Response:
    return _json({"is_paused": state.fleet.paused})


async def update_weights(state: ServerState, request: Request) -> Response:
    body: UpdateWeightsBody = decode(await request.body(), UpdateWeightsBody)
    await state.fleet.update_weights(body.weight_dir, body.version)
    return _json({"weight_version": body.version})


async def session_sample(state: ServerState, request: Request) -> Response:
    sid = request.path_params["session_id"]
    s = state.sessions.get(sid)
    if s is None or not s.prompt_ids:
        return _error(404, f"no session {sid!r} (never started, deleted or expired)", "NotFoundError")
    async with s.lock:  # a turn in progress finishes first: the sample is consistent
        return _json(await state.sessions.sample(sid))


async def session_delete(state: ServerState, request: Request) -> Response:
    sid = request.path_params["session_id"]
    s = state.sessions.get(sid)
    if s is None:
        return _error(404, f"no session {sid!r} (never started, deleted or expired)", "NotFoundError")
    async with s.lock:
        rows = await state.sessions.close(sid)
    state.fleet.forget(sid)
    return _json({"id": sid, "deleted": True, "rows_written": rows})


async def sessions_list(state: ServerState, request: Request) -> Response:
    now = time.monotonic()
    return _json({"sessions": [{"id": s.id, "turns": s.turn, "bridged_turns": s.bridged, "breaks": s.breaks,
                                "idle_s": round(now - s.last_used, 3)} for s in state.sessions.sessions.values()]})


# ---- the app -------------------------------------------------------------------------------------

Handler = Callable[[ServerState, Request], Awaitable[Response]]


def _wrap(state: ServerState, name: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    m = state.metrics

    async def endpoint(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            response = await handler(state, request)
        except ClientGone:
            m.inc("aborts_total", cause="client_disconnect")
            response = _error(499, "client disconnected; the request was aborted", "ClientClosedRequest")
        except (BadRequest, EngineError, ValueError) as exc:  # EngineError, MessageError, TemplateRejected are ValueErrors
            response = _error(400, str(_root_cause(exc)), "BadRequestError")
        except SessionLimit as exc:
            response = _error(429, str(exc), "RateLimitError")
        except EngineUnavailable as exc:
            response = _error(503, str(exc), "ServiceUnavailableError")
        except Exception as exc:  # an engine failure: this request fails, the server keeps serving
            cause = _root_cause(exc)
            if isinstance(cause, ValueError):  # an engine's refusal that crossed Ray as a task error
                response = _error(400, str(cause), "BadRequestError")
            else:
                m.inc("engine_errors_total")
                response = _error(500, f"{type(cause).__name__}: {cause}", "InternalServerError")
        elapsed = time.perf_counter() - t0
        m.inc("requests_total", route=name, status=str(response.status_code))
        m.observe("request_latency_seconds", elapsed, route=name)
        engine_s = getattr(request.state, "engine_s", None)
        if engine_s is not None and response.status_code == 200:
            m.observe("server_overhead_seconds", max(elapsed - engine_s, 0.0), route=name)
        return response

    return endpoint


def create_app(state: ServerState) -> Starlette:
    """The Starlette app over ``state``; a background task expires idle sessions while it runs."""
    state.fleet.on_abandoned = lambda out: _count_abandoned(state, out)
    routes = [
        ("/inference/v1/generate", generate, ["POST"]),
        ("/inference/v1/abort_requests", abort_requests, ["POST"]),
        ("/abort_requests", abort_requests, ["POST"]),
        ("/v1/completions", completions, ["POST"]),
        ("/v1/chat/completions", chat_completions, ["POST"]),
        ("/v1/models", models, ["GET"]),
        ("/health", health, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/pause", pause, ["POST"]),
        ("/resume", resume, ["POST"]),
        ("/is_paused", is_paused, ["GET"]),
        ("/update_weights", update_weights, ["POST"]),
        ("/v1/sessions", sessions_list, ["GET"]),
        ("/v1/sessions/{session_id}/sample", session_sample, ["GET"]),
        ("/v1/sessions/{session_id}", session_delete, ["DELETE"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async def sweep() -> None:
            while True:
                await asyncio.sleep(state.sweep_interval_s)
                with contextlib.suppress(Exception):
                    for sid in await state.sessions.expire():
                        state.fleet.forget(sid)
                        state.metrics.inc("sessions_expired_total")

        task = asyncio.create_task(sweep())
        try:
            yield
        finally:
            task.cancel()

    return Starlette(routes=[Route(path, _wrap(state, path, fn), methods=methods) for path, fn, methods in routes],
                     lifespan=lifespan)
