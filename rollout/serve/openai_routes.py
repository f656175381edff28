"""The OpenAI-compatible routes: ``/v1/completions`` (token-id prompts) and ``/v1/chat/completions``
(stateless, or a session turn with ``X-Session-ID``), whole or streamed (``stream=true``, see
streaming.py), with stop strings; and vLLM's ``/tokenize`` and ``/detokenize``.

Fields OpenAI and vLLM clients send are accepted; those the engines cannot honour (IGNORED_OPENAI in
schemas.py) are listed in the ``X-Tito-Ignored`` response header. Everything is validated before a
session is opened or an engine is called, so a refused request leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..engines.protocol import GenerateRequest
from . import calls
from .logprobs import completion_logprobs, engine_top, prompt_logprobs
from .responses import Call, chat_choice, chat_response, system_fingerprint, token_decoder
from .schemas import (
    BadRequest,
    ChatBody,
    CompletionsBody,
    DetokenizeBody,
    TokenizeBody,
    check_unsupported,
    decode,
    struct_values,
    weight_spans,
)
from .sessions import check_session_id, session_header
from .state import ServerState
from .stops import MAX_STOP_STRINGS
from .streaming import stream_chat, stream_completion
from .text_bound import check_chat_text, check_text

# names Renderer.render takes itself: a chat_template_kwargs entry cannot override them
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "conversation",
                            "documents", "chat_template", "tokenize", "return_dict")


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(stops)}", "stop")
    if any(not s for s in stops):
        raise BadRequest("stop: a stop string must not be empty", "stop")
    return stops


def _headers(ignored: list[str]) -> dict[str, str]:
    return {"X-Tito-Ignored": ",".join(ignored)} if ignored else {}


def _with_headers(response: Response, ignored: list[str]) -> Response:
    for k, v in _headers(ignored).items():
        response.headers[k] = v
    return response


# ---- /v1/completions -----------------------------------------------------------------------------


def _token_ids_prompt(prompt: Any) -> list[list[int]]:
    def ids(p: Any, where: str) -> list[int]:
        if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise BadRequest(f"{where} must be a list of token ids (integers)", "prompt")
        return p

    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
        raise BadRequest("prompt: text prompts are not supported by this token-in/token-out server; send token ids",
                         "prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return [ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [ids(prompt, "prompt")]


def _completion_text(state: ServerState, body: CompletionsBody):
    tok = state.parser.tokenizer
    skip = body.skip_special_tokens
    return lambda ids: tok.decode(ids, skip_special_tokens=skip)


async def completions(state: ServerState, request: Request) -> Response:
    body: CompletionsBody = decode(await calls.read_body(state, request), CompletionsBody)
    lora = calls.check_model(state, body.model)
    if body.echo:
        raise BadRequest("echo is not supported", "echo")
    if body.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    if body.best_of not in (None, 1, body.n):
        raise BadRequest("best_of is not supported", "best_of")
    ignored = check_unsupported(struct_values(body), where="", openai=True)
    stops = _stops(body.stop)
    prompts = _token_ids_prompt(body.prompt)
    if body.stream and len(prompts) > 1:
        raise BadRequest("stream=true takes one prompt (a list of token ids), not a batch", "prompt")
    rid = calls.request_id(body.request_id, "cmpl")
    # logprobs=k lists the sampled token and the k most likely; logprobs=1 (the usual "give me logprobs") on an
    # engine that lists no alternatives (replay) gives the sampled token alone rather than a refusal
    k = body.logprobs or 0
    top = engine_top(k, k if k >= 2 else 0, state.engine_info().max_logprobs)
    reqs = []
    for i, prompt in enumerate(prompts):
        sp = calls.sampling(state, len(prompt), body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, seed=body.seed, n=body.n, stop_token_ids=body.stop_token_ids,
                            ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, top_logprobs=top,
                            prompt_logprobs=body.prompt_logprobs)
        sub = rid if len(prompts) == 1 else f"{rid}-{i}"
        reqs.append(GenerateRequest(request_id=sub, prompt_ids=prompt, sampling=sp, session_id=body.cache_salt,
                                    lora=lora))
    for r in reqs:  # refuse the whole batch before anything runs
        calls.validated(state, r)
    c = Call(rid, reqs, prompts, body.cache_salt, stops, body.include_stop_str_in_output, ignored)
    decode_text = _completion_text(state, body)
    if body.stream:
        return stream_completion(state, request, body, c, decode_text)
    texts = [c.texts(decode_text) if stops else None for _ in reqs]
    outs = await asyncio.gather(*(calls.run_to_end(state, request, r, c.key, t) for r, t in zip(reqs, texts)))
    token_text = token_decoder(state)
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for prompt, (out, _), ts in zip(prompts, outs, texts):
        prompt_tokens += len(prompt)
        cached += max(r.cached_prompt_tokens for r in out.results)
        scored = prompt_logprobs(token_text, prompt, out.prompt_logprobs)
        for j, r in enumerate(out.results):
            completion_tokens += len(r.completion_ids)
            text = ts[j].final_text if ts is not None else decode_text(r.completion_ids)
            choice: dict[str, Any] = {"index": len(choices), "text": text, "finish_reason": r.finish_reason,
                                      "stop_reason": calls.stop_reason(state, r, ts[j] if ts else None)}
            if body.logprobs is not None and r.logprobs is not None:
                choice["logprobs"] = completion_logprobs(token_text, r.completion_ids, r.logprobs, r.top_logprobs,
                                                         body.logprobs, body.return_tokens_as_token_ids)
            else:
                choice["logprobs"] = None
            if body.return_token_ids:
                choice["token_ids"] = r.completion_ids
                choice["prompt_token_ids"] = prompt
            choice.update(prompt_logprobs=scored, routed_experts=None,
                          weight_versions=weight_spans(r.weight_version, len(r.completion_ids), r.token_versions))
            choices.append(choice)
    return _with_headers(calls.json_response({
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_names[0],
        "choices": choices, "service_tier": None, "system_fingerprint": system_fingerprint(),
        "usage": calls.usage(prompt_tokens, completion_tokens, cached),
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}), ignored)


# ---- /v1/chat/completions ------------------------------------------------------------------------


def _template_kwargs(state: ServerState, body: ChatBody, session: bool, ignored: list[str]) -> dict:
    kwargs = dict(body.chat_template_kwargs or {})
    for name in kwargs:
        if name in RESERVED_TEMPLATE_KWARGS:
            raise BadRequest(f"chat_template_kwargs.{name}: {name!r} is set by the request itself, not a template "
                             "kwarg", f"chat_template_kwargs.{name}")
    if body.reasoning_effort is not None:
        if "reasoning_effort" in state.parser.template_kwargs_allowed:
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        else:
            ignored.append("reasoning_effort")  # the template has no effort levels
    if session and kwargs:
        raise BadRequest("chat_template_kwargs and reasoning_effort cannot change within a session; set "
                         "renderer.template_kwargs in the server config",
                         "reasoning_effort" if body.reasoning_effort is not None else "chat_template_kwargs")
    try:
        state.parser.check_template_kwargs(kwargs)
    except ValueError as exc:
        raise BadRequest(f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None
    return kwargs


def _check_chat(state: ServerState, body: ChatBody, session: bool) -> list[str]:
    """Every check that needs no prompt, before anything is opened or rendered; returns ignored fields."""
    calls.check_model(state, body.model)
    ignored = check_unsupported(struct_values(body), where="", openai=True)
    if body.tool_choice not in (None, "auto", "none"):
        raise BadRequest(f"tool_choice {body.tool_choice!r} is not supported (only 'auto' or 'none')", "tool_choice")
    fmt = body.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        raise BadRequest(f"response_format {fmt.get('type')!r} is not supported (only 'text'): sampling is not "
                         "constrained", "response_format")
    if body.add_generation_prompt and body.continue_final_message:
        raise BadRequest("continue_final_message needs add_generation_prompt=false", "continue_final_message")
    if session:
        if body.n != 1:
            raise BadRequest("a session (X-Session-ID) samples one trajectory: n must be 1", "n")
        if body.continue_final_message or not body.add_generation_prompt:
            raise BadRequest("a session turn answers the last message: add_generation_prompt must be true and "
                             "continue_final_message false", "add_generation_prompt")
    check_chat_text(state, body.messages, body.tools)
    return ignored


def _stateless_prompt(state: ServerState, body: ChatBody, kwargs: dict) -> list[int]:
    parser = state.parser
    if body.continue_final_message:
        if not body.messages or body.messages[-1].get("role") != "assistant":
            raise BadRequest("continue_final_message needs an assistant message last", "messages")
        ids = parser.render(body.messages, body.tools, add_generation_prompt=False, **kwargs).token_ids
        # the final message stays open: drop its turn close and whatever the template puts after it
        close = len(ids) - 1 - ids[::-1].index(parser.turn_close_id) if parser.turn_close_id in ids else len(ids)
        ids = ids[:close]
    else:
        ids = parser.render(body.messages, body.tools, add_generation_prompt=body.add_generation_prompt,
                            **kwargs).token_ids
    bos = parser.tokenizer.bos_token
    if body.add_special_tokens and bos:
        bos_id = parser.tokenizer.added_tokens.get(bos)
        if bos_id is not None and ids[:1] != [bos_id]:
            ids = [bos_id, *ids]
    return ids


async def chat_completions(state: ServerState, request: Request) -> Response:
    body: ChatBody = decode(await calls.read_body(state, request), ChatBody)
    session_id = session_header(request.headers)
    if session_id is not None:
        check_session_id(session_id)
    ignored = _check_chat(state, body, bool(session_id))
    kwargs = _template_kwargs(state, body, bool(session_id), ignored)
    stops = _stops(body.stop)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    rid = calls.request_id(body.request_id, "chatcmpl")
    # chat's top_logprobs=k lists the first k of (sampled, most likely...): alternatives are needed from k=2
    top = (body.top_logprobs or 0) if body.logprobs else 0
    sampling_kw = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed, n=body.n,
                       stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                       extra_stops=tuple(state.parser.stop_token_ids), min_tokens=body.min_tokens,
                       top_logprobs=top if top >= 2 else 0, prompt_logprobs=body.prompt_logprobs,
                       prompt_param="messages")
    max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    # the sampling settings alone (a one-token stand-in prompt, max_tokens >= min_tokens), so a bad value is
    # refused before a session opens; max_tokens against the real prompt is checked once it is rendered.
    # (check_unsupported refused max_tokens < 1 and min_tokens outside [0, max_tokens], each by its name.)
    limit = state.fleet.max_model_len
    if body.min_tokens >= limit:
        raise BadRequest(f"min_tokens={body.min_tokens} must be below max_model_len {limit} (a prompt takes at "
                         "least one token)", "min_tokens")
    calls.validated(state, GenerateRequest(rid, [0], calls.sampling(state, 1, max(1, body.min_tokens), **sampling_kw)),
                    prompt_param="messages")
    turn = None
    if session_id:
        from .chat_session import open_turn

        turn = await open_turn(state, session_id, body)  # holds the session's lock until turn.close()
        prompt = turn.prompt
    else:
        # in a worker thread: a long prompt under the bytes bound may take seconds to tokenize, the loop serves on
        prompt = await asyncio.to_thread(_stateless_prompt, state, body, kwargs)
    try:
        sp = calls.sampling(state, len(prompt), max_tokens, **sampling_kw)
        req = GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=sp,
                              session_id=session_id or body.cache_salt, lora=calls.check_model(state, body.model))
        calls.validated(state, req, prompt_param="messages", max_param=max_param)
        if turn is not None:
            turn.validated()
            turn.session.lora = req.lora
        c = Call(rid, [req], [prompt], session_id or body.cache_salt, stops, body.include_stop_str_in_output, ignored)
        if body.stream:
            response = stream_chat(state, request, body, c, turn)
            turn = None  # the stream closes it
            return response
        tok = state.parser.tokenizer
        texts = c.texts(lambda ids: tok.decode(ids, skip_special_tokens=True)) if stops else None
        out, _ = await calls.run_to_end(state, request, req, c.key, texts)
        parsed_all = [chat_choice(state, body, r, prompt, texts[i] if texts else None)
                      for i, r in enumerate(out.results)]
        if turn is not None:
            await turn.record(out.results[0], parsed_all[0][1])
        return _with_headers(calls.json_response(chat_response(state, body, rid, prompt, out, parsed_all, turn)),
                             ignored)
    finally:
        if turn is not None:
            await turn.close()


# ---- /tokenize, /detokenize (vLLM) ---------------------------------------------------------------


async def tokenize(state: ServerState, request: Request) -> Response:
    """vLLM's /tokenize. Text that cannot fit ``max_model_len`` tokens is refused before it is tokenized
    (as chat's messages are, text_bound.py), and a text prompt or messages are tokenized in a worker thread
    (``encode_batch`` releases the GIL), so other requests, /health included, are answered meanwhile."""
    body: TokenizeBody = decode(await calls.read_body(state, request), TokenizeBody)
    calls.check_model(state, body.model)
    tok = state.parser.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise BadRequest("send either prompt (text) or messages (chat)", "prompt")
    if body.messages is not None:
        check_chat_text(state, body.messages, body.tools)
        chat = ChatBody(messages=body.messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
                        continue_final_message=body.continue_final_message,
                        chat_template_kwargs=body.chat_template_kwargs)
        if chat.add_generation_prompt and chat.continue_final_message:
            raise BadRequest("continue_final_message needs add_generation_prompt=false", "continue_final_message")
        ids = await asyncio.to_thread(_stateless_prompt, state, chat, _template_kwargs(state, chat, False, []))
    else:
        check_text(state, {"prompt": [body.prompt]}, state.fleet.max_model_len, "its tokens")
        # what the tokenizer's own post-processor adds (HF's tokenizer(text), vLLM's /tokenize): SmolLM2 adds no BOS
        encoded = await asyncio.to_thread(tok.backend.encode_batch, [body.prompt],
                                          add_special_tokens=body.add_special_tokens)
        ids = encoded[0].ids
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.fleet.max_model_len, "tokens": ids,
                           "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = await asyncio.to_thread(tok.backend.decode_batch, [[t] for t in ids],
                                                    skip_special_tokens=False)
    return calls.json_response(out)


async def detokenize(state: ServerState, request: Request) -> Response:
    """vLLM's /detokenize: at most ``max_model_len`` ids (what one sequence can hold), decoded in a worker
    thread (``decode_batch`` releases the GIL)."""
    body: DetokenizeBody = decode(await calls.read_body(state, request), DetokenizeBody)
    calls.check_model(state, body.model)
    limit = state.fleet.max_model_len
    if len(body.tokens) > limit:
        raise BadRequest(f"tokens: {len(body.tokens)} token ids are more than max_model_len {limit}; send at "
                         "most that many", "tokens")
    vocab = state.fleet.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    # the tokenizer's decode (special tokens kept), as decode_batch: that one releases the GIL
    texts = await asyncio.to_thread(state.parser.tokenizer.backend.decode_batch, [body.tokens],
                                    skip_special_tokens=False)
    return calls.json_response({"prompt": texts[0]})
