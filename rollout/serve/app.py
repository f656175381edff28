"""The HTTP routes (Starlette): vLLM's token-in/token-out API, admin, sessions, metrics; the OpenAI routes
are in openai_routes.py (streaming in streaming.py, the answers both build in responses.py), what they share
around an engine call in calls.py.

Bodies are decoded and encoded with msgspec (schemas.py). Every refusal is a JSON error in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` (``param`` names the offending field): 400 for bad
input, 404 for an unknown session or route, 405 for a wrong method, 409 for a request id already running,
408 for a body that did not arrive in time (guard.py), 401 without the API key (guard.py), 403 for a
weight directory outside ``server.weights_root``, 413 for a body over the limit, 429 when too many sessions are held, 500 when an engine failed the
request, 501 for what cannot be real here (admin.py), 503 when an engine died or the engines are asleep;
the server keeps serving in every case. A client that disconnects
while its request runs has that request aborted on its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from ..engines.protocol import EngineError, GenerateOutput, GenerateRequest, Unsupported, root_cause
from . import admin, calls, weight_routes
from .calls import ClientGone, error_response, json_response
from .chat_session import SESSION_END, end_session, evict_over_budget
from .fleet import DuplicateRequest, EngineUnavailable
from .guard import Guard
from .logprobs import generate_extras, generate_logprobs, prompt_logprobs
from .metrics import vllm_families
from .openai_routes import chat_completions, completions, detokenize, tokenize
from .responses import token_decoder
from .schemas import (
    AbortBody,
    BadRequest,
    GenerateBody,
    GenerateChoice,
    GenerateResponse,
    VLLMSamplingParams,
    check_unsupported,
    decode,
    decode_sampling,
    struct_values,
    weight_spans,
)
from .sessions import SessionLimit, check_session_id, session_header
from .state import ServerState

__all__ = ["ServerState", "create_app"]

VLLM_GENERATE_PREFIX = "generate-tokens-"


def _count_abandoned(state: ServerState, out: GenerateOutput) -> None:
    """How a request ended whose client went away (the engine's answer to the abort)."""
    for r in out.results:
        state.metrics.inc("finish_total", finish=r.finish_reason)
        state.metrics.inc("completion_tokens_total", len(r.completion_ids))


# ---- routes --------------------------------------------------------------------------------------


class _GenerateCall(msgspec.Struct, frozen=True):
    """A /inference/v1/generate request once decoded and checked: nothing below reads the raw body again."""

    body: GenerateBody
    sampling: VLLMSamplingParams
    session: str | None  # X-Session-ID, else the salt: keys the engine's session KV and the routing
    lora: str | None = None  # the LoRA adapter `model` names; None: the base model


def _decode_generate(state: ServerState, raw: bytes, headers) -> _GenerateCall:
    """Step 1: decode and validate once. Every refusal names the request's own field."""
    body: GenerateBody = decode(raw, GenerateBody)
    lora = calls.check_model(state, body.model)
    if body.stream:
        raise BadRequest("stream=true is not supported on /inference/v1/generate (stream on /v1/completions "
                         "with a token-id prompt)", "stream")
    if body.output_mode != "tokens":
        raise BadRequest(f"output_mode {body.output_mode!r} is not supported: this server is tokens-only",
                         "output_mode")
    if body.kv_transfer_params:
        raise BadRequest("kv_transfer_params (disaggregated prefill) is not supported", "kv_transfer_params")
    sp, unknown = decode_sampling(body.sampling_params)
    calls.note_unknown_sampling(state, unknown)
    check_unsupported(struct_values(sp))
    if body.cache_salt is not None and sp.cache_salt is not None and body.cache_salt != sp.cache_salt:
        raise BadRequest(f"cache_salt {body.cache_salt!r} and sampling_params.cache_salt {sp.cache_salt!r} differ: "
                         "send one salt", "sampling_params.cache_salt")
    # vLLM's check (verifiers' TrainClient sends the field on a bridged turn); no routing is returned here
    if not 0 <= sp.routed_experts_prompt_start <= len(body.token_ids):
        raise BadRequest(f"sampling_params.routed_experts_prompt_start={sp.routed_experts_prompt_start} must be in "
                         f"[0, {len(body.token_ids)}] (the prompt length)", "sampling_params.routed_experts_prompt_start")
    # The X-Session-ID header verifiers' TrainClient and SkyRL send per rollout, else the salt, keys the engine's
    # session KV and the routing: the turns of one rollout reuse their KV on the engine that holds it. The header
    # wins (as on chat): prime-rl's salt is its policy step, one for every rollout of a step.
    salt = body.cache_salt if body.cache_salt is not None else sp.cache_salt
    return _GenerateCall(body, sp, session_header(headers) or salt, lora)


def _engine_request(state: ServerState, call: _GenerateCall) -> GenerateRequest:
    """Step 2: the engine's sampling settings and request (errors under ``sampling_params.``)."""
    body, sp = call.body, call.sampling
    extras = generate_extras(state, sp)  # how many top logprobs the engine computes, prompt logprobs
    try:
        sampling = calls.sampling(state, len(body.token_ids), sp.max_tokens, temperature=sp.temperature,
                                  top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed, n=sp.n,
                                  stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                                  prompt_param="token_ids", **extras)
    except BadRequest as exc:
        raise BadRequest(str(exc), exc.param if exc.param in (None, "token_ids") else
                         f"sampling_params.{exc.param}") from None
    req = GenerateRequest(request_id=calls.request_id(body.request_id, "gen"), prompt_ids=body.token_ids,
                          sampling=sampling, session_id=call.session, lora=call.lora)
    calls.validated(state, req, prefix="sampling_params.", prompt_param="token_ids")
    return req


def _generate_response(state: ServerState, call: _GenerateCall, req: GenerateRequest, out: GenerateOutput,
                       call_s: float) -> GenerateResponse:
    """Step 4: vLLM's response body: the choices, usage and timing, then the logprobs asked for."""
    body, sp = call.body, call.sampling
    stop_reasons = [calls.stop_token_reason(state, r) for r in out.results]
    usage = calls.usage(len(body.token_ids), sum(len(r.completion_ids) for r in out.results),
                        max(r.cached_prompt_tokens for r in out.results))
    timing = calls.timing(out, call_s)
    choices = [GenerateChoice(index=i, token_ids=r.completion_ids, finish_reason=r.finish_reason,
                              stop_reason=stop_reasons[i],
                              logprobs=None if sp.logprobs is None or r.logprobs is None else
                              generate_logprobs(r.completion_ids, r.logprobs, r.top_logprobs, sp.logprobs),
                              weight_versions=weight_spans(r.weight_version, len(r.completion_ids), r.token_versions))
               for i, r in enumerate(out.results)]
    return GenerateResponse(request_id=req.request_id, model=state.model_names[0], created=int(time.time()),
                            choices=choices, prompt_token_ids=body.token_ids, usage=usage, metrics=timing,
                            prompt_logprobs=prompt_logprobs(token_decoder(state), body.token_ids,
                                                            out.prompt_logprobs))


async def generate(state: ServerState, request: Request) -> Response:
    """``POST /inference/v1/generate``, top-down: decode and validate once, sampling, the call, the response."""
    call = _decode_generate(state, await calls.read_body(state, request), request.headers)
    req = _engine_request(state, call)
    out, call_s = await calls.generate(state, request, req, call.session)
    return json_response(_generate_response(state, call, req, out, call_s))


async def abort_requests(state: ServerState, request: Request) -> Response:
    body: AbortBody = decode(await calls.read_body(state, request), AbortBody)
    # vLLM's server runs a /inference/v1/generate request as "generate-tokens-<request_id>" and aborts by that
    # name; both spellings are accepted here, so a client written against vLLM aborts the same way
    running = state.fleet.where
    ids = [rid[len(VLLM_GENERATE_PREFIX):] if rid.startswith(VLLM_GENERATE_PREFIX) and rid not in running else rid
           for rid in body.request_ids]
    aborted = await state.fleet.abort(ids)
    state.metrics.inc("aborts_total", len(aborted), cause="abort_requests")
    return json_response({"aborted": aborted})


async def models(state: ServerState, request: Request) -> Response:
    # vLLM's model card, its permission entry included (OpenAI clients of old read it)
    permission = {"id": f"modelperm-{state.model_names[0]}", "object": "model_permission", "created": state.created,
                  "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                  "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                  "group": None, "is_blocking": False}
    card = {"id": state.model_names[0], "object": "model", "created": state.created, "owned_by": "tito",
            "root": state.root, "parent": None, "max_model_len": state.fleet.max_model_len,
            "permission": [permission]}
    # each LoRA adapter as vLLM lists it: a card of its name, its path as root, the base model as parent
    adapters = [{**card, "id": name, "root": lora["path"], "parent": state.model_names[0], "max_model_len": None,
                 "permission": [{**permission, "id": f"modelperm-{name}"}]} for name, lora in state.loras.items()]
    return json_response({"object": "list", "data": [card, *adapters]})


async def health(state: ServerState, request: Request) -> Response:
    reports = await state.fleet.health()
    alive = sum(bool(r.get("ok")) for r in reports)
    status = "ok" if alive == len(reports) else ("degraded" if alive else "unavailable")
    healer = state.fleet.healer
    counts = {} if healer is None else {"engines_lost": healer.lost_total, "engines_restarted": healer.restarted_total}
    return json_response({"status": status, "engines": reports, **counts}, 200 if alive else 503)


async def metrics(state: ServerState, request: Request) -> Response:
    m, fleet = state.metrics, state.fleet
    m.set("sessions_active", len(state.sessions.sessions))
    m.set("requests_in_flight", fleet.in_flight)
    prompt = m.get("prompt_tokens_total")
    m.set("cache_reuse_ratio", m.get("cached_prompt_tokens_total") / prompt if prompt else 0.0)
    m.set("routing_moves", fleet.router.moves)
    for i, load in enumerate(fleet.router.load):
        m.set("engine_load", 0 if i in fleet.dead else load, engine=str(i))
    m.set("sessions_bytes", state.sessions.nbytes)
    m.set("sleeping", int(bool(fleet.sleep_level)))
    m.set("paused", int(fleet.paused))
    m.set("weight_version", fleet.weight_version)
    if fleet.healer is not None:  # lost engines (killed, OOM, hung) and those restarted and back
        m.set("engines_lost_total", fleet.healer.lost_total)
        m.set("engines_restarted_total", fleet.healer.restarted_total)
    m.set("engines_serving", fleet.alive)
    loads = [0 if i in fleet.dead else load for i, load in enumerate(fleet.router.load)]
    vllm = vllm_families(state.model_names[0], await fleet.scheduler_stats(), loads, fleet.held)
    return PlainTextResponse(m.render() + vllm, media_type="text/plain; version=0.0.4")


async def session_sample(state: ServerState, request: Request) -> Response:
    sid = check_session_id(request.path_params["session_id"], "session_id")
    s = state.sessions.get(sid)
    if s is None or not s.prompt_ids:
        return error_response(404, f"no session {sid!r} (never started, deleted or expired)", "NotFoundError")
    async with s.lock:  # a turn in progress finishes first: the sample is consistent
        return json_response(await state.sessions.sample(sid))


async def session_delete(state: ServerState, request: Request) -> Response:
    """End a session now: its samples written (to a shard file before answering, with an output
    directory), its KV dropped on its engine."""
    sid = check_session_id(request.path_params["session_id"], "session_id")
    s = state.sessions.get(sid)
    if s is None:
        return error_response(404, f"no session {sid!r} (never started, deleted or expired)", "NotFoundError")
    rows = await end_session(state, s, "deleted", how="delete", flush=True)
    return json_response({"id": sid, "deleted": True, "rows_written": rows})


async def version(state: ServerState, request: Request) -> Response:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        v = package_version("tito")
    except PackageNotFoundError:  # a source checkout that was never installed
        v = "unknown"
    return json_response({"version": v})


async def sessions_list(state: ServerState, request: Request) -> Response:
    """The sessions held, least recently used first (the next to be evicted), with what each holds."""
    now = time.monotonic()
    sm = state.sessions
    held = sorted(sm.sessions.values(), key=lambda s: s.last_used)
    return json_response({"object": "list", "count": len(held), "bytes": sum(s.nbytes for s in held),
                  "max_idle_bytes": sm.max_idle_bytes, "idle_timeout_s": sm.idle_timeout_s,
                  "sessions": [{"id": s.id, "turns": s.turn, "bridged_turns": s.bridged, "breaks": s.breaks,
                            "tokens": s.sample_tokens, "bytes": s.nbytes, "idle_s": round(now - s.last_used, 3),
                            "busy": s.lock.locked()} for s in held]})


SESSION_END_HEADER = "x-session-end"


async def chat(state: ServerState, request: Request) -> Response:
    """/v1/chat/completions; ``X-Session-End: true`` with ``X-Session-ID`` ends the session after this turn."""
    value = request.headers.get(SESSION_END_HEADER)
    end = False
    if value is not None:
        low = value.strip().lower()
        if low not in ("true", "1", "false", "0"):
            raise BadRequest(f"X-Session-End must be true or false, got {value!r}", "X-Session-End")
        end = low in ("true", "1")
        if end and session_header(request.headers) is None:
            raise BadRequest("X-Session-End needs X-Session-ID: it ends that session", "X-Session-End")
    token = SESSION_END.set(end)
    try:
        return await chat_completions(state, request)
    finally:
        SESSION_END.reset(token)


# ---- the app -------------------------------------------------------------------------------------

Handler = Callable[[ServerState, Request], Awaitable[Response]]


def wrap_route(state: ServerState, name: str, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    m = state.metrics

    async def endpoint(request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            response = await handler(state, request)
        except ClientGone as exc:  # 499 (nginx's "client closed request"): never a 5xx, nothing failed here
            m.inc("client_disconnects_total", stage=exc.stage)
            if exc.stage == "running":
                m.inc("aborts_total", cause="client_disconnect")
                message = "client disconnected; the request was aborted"
            else:
                message = "client disconnected before its request body was in; nothing ran"
            response = error_response(499, message, "ClientClosedRequest")
        except BadRequest as exc:
            response = error_response(exc.status, str(exc), exc.kind, exc.param)
            if exc.status == 408:  # the rest of the body may still come: this connection cannot be reused
                response.headers["Connection"] = "close"
        except DuplicateRequest as exc:
            response = error_response(409, str(exc), "ConflictError", exc.param)
        except (EngineError, ValueError) as exc:  # EngineError, MessageError, TemplateRejected are ValueErrors
            cause = root_cause(exc)
            response = error_response(400, str(cause), "BadRequestError", getattr(cause, "param", None))
        except SessionLimit as exc:
            response = error_response(429, str(exc), "RateLimitError")
        except Unsupported as exc:  # an admin call this backend cannot do: never a pretend success
            response = error_response(501, str(root_cause(exc)), "NotImplementedError")
        except EngineUnavailable as exc:
            response = error_response(503, str(exc), "ServiceUnavailableError")
        except Exception as exc:  # an engine failure: this request fails, the server keeps serving
            cause = root_cause(exc)
            if isinstance(cause, ValueError):  # an engine's refusal that crossed Ray as a task error
                response = error_response(400, str(cause), "BadRequestError", getattr(cause, "param", None))
            elif isinstance(cause, Unsupported):
                response = error_response(501, str(cause), "NotImplementedError")
            else:
                m.inc("engine_errors_total")
                response = error_response(500, f"{type(cause).__name__}: {cause}", "InternalServerError")
        elapsed = time.perf_counter() - t0
        m.inc("requests_total", route=name, status=str(response.status_code))
        m.observe("request_latency_seconds", elapsed, route=name)
        engine_s = getattr(request.state, "engine_s", None)
        if engine_s is not None and response.status_code == 200:
            m.observe("server_overhead_seconds", max(elapsed - engine_s, 0.0), route=name)
        return response

    return endpoint


async def http_error(request: Request, exc: Exception) -> Response:
    """Unknown routes and wrong methods, in the same JSON shape as every other error."""
    status = getattr(exc, "status_code", 500)
    if status == 404:
        return error_response(404, f"no route {request.url.path!r}", "NotFoundError", None)
    if status == 405:
        response = error_response(405, f"{request.method} is not allowed on {request.url.path!r}",
                                  "MethodNotAllowedError", None)
        allow = getattr(exc, "headers", None) or {}
        if "Allow" in allow:
            response.headers["Allow"] = allow["Allow"]
        return response
    return error_response(status, str(getattr(exc, "detail", exc)), "HTTPError", None)


def create_app(state: ServerState) -> Starlette:
    """The Starlette app over ``state``; a background task expires idle sessions while it runs."""
    state.fleet.on_abandoned = lambda out: _count_abandoned(state, out)
    # the bytes bound's figures (text_bound.py), now rather than inside the first long request that needs them
    # (0.15 s over Qwen's vocabulary, on the event loop)
    _ = state.max_token_bytes, state.normalizer_forms
    routes = [
        ("/inference/v1/generate", generate, ["POST"]),
        ("/inference/v1/abort_requests", abort_requests, ["POST"]),
        ("/abort_requests", abort_requests, ["POST"]),
        ("/v1/completions", completions, ["POST"]),
        ("/v1/chat/completions", chat, ["POST"]),
        ("/v1/models", models, ["GET"]),
        ("/health", health, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        *admin.ROUTES,
        *weight_routes.ROUTES,
        ("/v1/sessions", sessions_list, ["GET"]),
        ("/v1/sessions/{session_id}/sample", session_sample, ["GET"]),
        ("/v1/sessions/{session_id}", session_delete, ["DELETE"]),
        ("/tokenize", tokenize, ["POST"]),
        ("/detokenize", detokenize, ["POST"]),
        ("/version", version, ["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        def count_expired(sid: str) -> None:
            state.metrics.inc("sessions_expired_total")
            state.metrics.inc("sessions_ended_total", how="expired")

        async def sweep() -> None:
            while True:
                await asyncio.sleep(state.sweep_interval_s)
                with contextlib.suppress(Exception):
                    for sid in await state.sessions.expire(on_end=count_expired):
                        await state.fleet.end_session(sid)
                    await evict_over_budget(state)

        task = asyncio.create_task(sweep())
        # the engines' heartbeat: a lost engine is restarted and brought back (rollout/engines/healer.py)
        healer = state.fleet.healer
        heal = asyncio.create_task(healer.watch()) if healer is not None else None
        try:
            yield
        finally:
            task.cancel()
            if heal is not None:
                heal.cancel()
                await healer.close()

    guard = Middleware(Guard, api_key=state.api_key, admin_api_key=state.admin_api_key,
                       body_timeout_s=state.body_timeout_s)
    return Starlette(routes=[Route(path, wrap_route(state, path, fn), methods=methods) for path, fn, methods in routes],
                     lifespan=lifespan, exception_handlers={HTTPException: http_error}, middleware=[guard])
