"""The engine conformance suite: behaviour every :class:`rollout.engines.protocol.EngineBackend` must show.

Each check is an ``async def check(backend) -> None`` that takes only the backend and derives everything else
from ``backend.info()`` (vocabulary size, ``max_model_len``, eos ids) and from the backend's own outputs (e.g. the
stop token is a token the backend itself sampled). A check raises ``AssertionError`` (or whatever the backend
raised) on failure and :class:`ConformanceSkip` when it cannot apply (e.g. no weights path was given).

Using it from a backend's test module (about ten lines)::

    from tests.engine_conformance import conformance_tests

    def make_backend():                       # sync or async; called once, inside the suite's event loop
        return MyEngine(...)

    TestMyEngineConformance = conformance_tests(make_backend, weights_path="/path/to/checkpoint")

``conformance_tests`` returns a pytest test class with one parametrized test per entry of
:data:`CONFORMANCE_CHECKS`. Backends hold loop-bound state (asyncio tasks, locks, vLLM's output handler), so the
class creates ONE backend and ONE :class:`asyncio.Runner` for all of its checks (class-scoped fixture) and closes
both at the end (``await backend.aclose()`` / ``close()`` / ``shutdown()`` if the backend has one).

Weight updates: the ``weight_version`` check calls ``backend.update_weights(path, info().weight_version + 1)``.
The path comes from the backend attribute ``conformance_weights_path`` (see :data:`WEIGHTS_PATH_ATTR`), which
``conformance_tests(..., weights_path=...)`` sets; without one the check is skipped with a reason. Use a checkpoint
of the SAME model (the check does not assume outputs change, only that results are stamped with the new version).

Timing assumption of the ``abort`` check: a generation of ``min(max_model_len - prompt_len, 4096)`` tokens with
``ignore_eos`` must still be running a moment after it starts (a fast fake engine needs a per-token delay).

The checks, in order: ``info``, ``greedy_determinism``, ``seeded_sampling``, ``max_tokens``, ``stop_tokens``,
``logprobs``, ``n_completions``, ``abort``, ``bad_input``, ``weight_version``, ``min_tokens``, ``top_logprobs``,
``prompt_logprobs`` (an engine whose info() says it reports no alternatives / scores no prompts must refuse them).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from rollout.engines.protocol import (
    EngineBackend,
    EngineError,
    EngineInfo,
    GenerateOutput,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    TokenLogprobs,
    close_backend,
    decode_request,
)

ConformanceCheck = Callable[[EngineBackend], Awaitable[None]]

WEIGHTS_PATH_ATTR = "conformance_weights_path"
"""Backend attribute holding the checkpoint path the ``weight_version`` check loads (absent/None: skipped)."""

LOGPROB_ATOL = 1e-3  # identical greedy requests run alone: logprobs agree to this (fp32 CPU: ~1e-6; GPU kernels vary)
VALID_FINISH = ("stop", "length", "abort", "error")


class ConformanceSkip(Exception):
    """A check that does not apply to this backend/configuration; the message says why."""


# ----------------------------------------------------------------------------------------------------- helpers


def _rid(tag: str) -> str:
    return f"conf-{tag}-{uuid.uuid4().hex[:8]}"


def _prompts(info: EngineInfo, length: int = 8, count: int = 4) -> Iterator[list[int]]:
    """Deterministic prompts of in-vocabulary, non-eos ids spread over the vocabulary (skipping the low,
    usually special, ids when the vocabulary is large enough)."""
    vocab = info.vocab_size
    low = 32 if vocab > 1024 else 0
    span = vocab - low
    eos = set(info.eos_token_ids)
    for p in range(count):
        ids: list[int] = []
        i = 0
        while len(ids) < length:
            t = low + ((p + 1) * 7919 + i * 104729 + i * i * 31) % span
            i += 1
            if t not in eos:
                ids.append(t)
        yield ids


def _prompt(info: EngineInfo, length: int = 8) -> list[int]:
    return next(_prompts(info, length))


def _request(
    prompt: list[int], *, tag: str = "req", max_tokens: int = 8, temperature: float = 0.0, **sampling: Any
) -> GenerateRequest:
    return GenerateRequest(
        request_id=_rid(tag),
        prompt_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, **sampling),
    )


def check_result(result: GenerateResult, request: GenerateRequest, info: EngineInfo) -> None:
    """Invariants of every result: in-vocabulary ids, at most max_tokens of them, a valid finish reason, a stop
    token that is the last id, logprobs (when returned) one finite value <= 0 per id, sane cache accounting."""
    s = request.sampling
    ids = result.completion_ids
    assert result.finish_reason in VALID_FINISH, f"unknown finish_reason {result.finish_reason!r}"
    if result.finish_reason == "error":
        raise AssertionError(f"request {request.request_id} failed inside the engine: {result.error}")
    assert all(isinstance(t, int) and 0 <= t < info.vocab_size for t in ids), f"ids outside the vocabulary: {ids}"
    assert len(ids) <= s.max_tokens, f"{len(ids)} completion ids > max_tokens {s.max_tokens}"
    if result.finish_reason == "length":
        assert len(ids) == s.max_tokens or len(request.prompt_ids) + len(ids) == info.max_model_len, (
            f"finish 'length' after {len(ids)} of max_tokens {s.max_tokens}"
        )
        assert result.stop_token_id is None, "finish 'length' with a stop_token_id"
    if result.finish_reason == "stop":
        allowed = set(s.stop_token_ids) | set(info.eos_token_ids)
        assert result.stop_token_id is not None, "finish 'stop' without stop_token_id"
        assert result.stop_token_id in allowed, f"stop_token_id {result.stop_token_id} not in {sorted(allowed)}"
        assert ids and ids[-1] == result.stop_token_id, "the stop token must be the last completion id"
    if s.logprobs:
        assert result.logprobs is not None, "logprobs requested but not returned"
    if result.logprobs is not None:
        assert len(result.logprobs) == len(ids), f"{len(result.logprobs)} logprobs for {len(ids)} ids"
        for lp in result.logprobs:
            assert isinstance(lp, float) and math.isfinite(lp) and lp <= 1e-6, f"bad logprob {lp!r}"
    assert 0 <= result.cached_prompt_tokens <= len(request.prompt_ids), (
        f"cached_prompt_tokens {result.cached_prompt_tokens} outside [0, {len(request.prompt_ids)}]"
    )


async def run_checked(backend: EngineBackend, request: GenerateRequest) -> GenerateOutput:
    """Generate and check the output's envelope and every result (see :func:`check_result`)."""
    out = await backend.generate(request)
    info = backend.info()
    assert out.request_id == request.request_id, f"request_id {out.request_id!r} != {request.request_id!r}"
    assert out.prompt_len == len(request.prompt_ids), f"prompt_len {out.prompt_len} != {len(request.prompt_ids)}"
    assert len(out.results) == request.sampling.n, f"{len(out.results)} results for n={request.sampling.n}"
    for r in out.results:
        check_result(r, request, info)
    return out


async def _long_free_run(backend: EngineBackend, info: EngineInfo, max_tokens: int = 16) -> tuple[list[int], list]:
    """A greedy, stop-free completion of exactly max_tokens ids for some deterministic prompt."""
    prompt = _prompt(info)
    out = await run_checked(backend, _request(prompt, tag="free", max_tokens=max_tokens, ignore_eos=True))
    r = out.results[0]
    assert r.finish_reason == "length" and len(r.completion_ids) == max_tokens, (
        f"ignore_eos + no stop ids: expected {max_tokens} ids and finish 'length', got {len(r.completion_ids)} "
        f"and {r.finish_reason!r}"
    )
    return prompt, r.completion_ids


# ------------------------------------------------------------------------------------------------------ checks


async def check_info(backend: EngineBackend) -> None:
    """info() is an EngineInfo with a positive vocabulary and context, in-vocabulary eos ids, an int version."""
    info = backend.info()
    assert isinstance(info, EngineInfo), f"info() returned {type(info).__name__}"
    assert info.backend and info.model, "info().backend and info().model must be non-empty"
    assert info.vocab_size > 0 and info.max_model_len > 1, (
        f"vocab_size {info.vocab_size}, max_model_len {info.max_model_len}"
    )
    assert all(0 <= t < info.vocab_size for t in info.eos_token_ids), f"eos ids {info.eos_token_ids} outside the vocab"
    assert isinstance(info.weight_version, int)


async def check_greedy_determinism(backend: EngineBackend) -> None:
    """The same greedy request twice gives the same ids; n=2 greedy gives two identical completions."""
    info = backend.info()
    prompt = _prompt(info)
    a = await run_checked(backend, _request(prompt, tag="greedy-a", max_tokens=12))
    b = await run_checked(backend, _request(prompt, tag="greedy-b", max_tokens=12))
    assert a.results[0].completion_ids == b.results[0].completion_ids, (
        f"greedy is not deterministic: {a.results[0].completion_ids} vs {b.results[0].completion_ids}"
    )
    pair = await run_checked(backend, _request(prompt, tag="greedy-n2", max_tokens=12, n=2))
    assert pair.results[0].completion_ids == pair.results[1].completion_ids == a.results[0].completion_ids, (
        "greedy n=2 completions differ from each other or from the n=1 completion"
    )


async def check_seeded_sampling(backend: EngineBackend) -> None:
    """Sampling at temperature 1 with the same seed twice gives the same ids."""
    info = backend.info()
    prompt = _prompt(info)
    req = dict(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    a = await run_checked(backend, _request(prompt, tag="seed-a", **req))
    b = await run_checked(backend, _request(prompt, tag="seed-b", **req))
    assert a.results[0].completion_ids == b.results[0].completion_ids, "same seed, different completions"


async def check_seeded_requests_over_one_step_budget(backend: EngineBackend) -> None:
    """Seeded requests sent at once whose prompts together exceed one scheduler step's token budget (3072
    tokens; vLLM's CPU default budget is 2048) all finish. vLLM 0.32's CPU runner killed its EngineCore on a
    seeded request whose prompt was split across steps (chunked prefill), ending every request with an error."""
    info = backend.info()
    requests = [_request(p, tag=f"budget-{i}", max_tokens=4, temperature=1.0, seed=i, ignore_eos=True)
                for i, p in enumerate(_prompts(info, length=96, count=32))]
    outs = await asyncio.gather(*(run_checked(backend, r) for r in requests))
    finishes = Counter(o.results[0].finish_reason for o in outs)
    assert finishes == {"length": len(requests)}, (finishes, next((o.results[0].error for o in outs
                                                                   if o.results[0].error), None))


async def check_max_tokens(backend: EngineBackend) -> None:
    """Without stop ids (ignore_eos) a completion has exactly max_tokens ids and finishes "length"."""
    info = backend.info()
    for max_tokens in (1, 5):
        out = await run_checked(backend, _request(_prompt(info), tag="len", max_tokens=max_tokens, ignore_eos=True))
        r = out.results[0]
        assert len(r.completion_ids) == max_tokens, f"max_tokens={max_tokens}: got {len(r.completion_ids)} ids"
        assert r.finish_reason == "length", f"max_tokens={max_tokens}: finish {r.finish_reason!r}, expected 'length'"
        assert r.stop_token_id is None


async def check_stop_tokens(backend: EngineBackend) -> None:
    """A stop id (the 3rd token of a free greedy run) ends the completion at its first occurrence, included,
    with finish "stop" and stop_token_id set; a stop id that never occurs changes nothing."""
    info = backend.info()
    eos = set(info.eos_token_ids)
    tried = []
    for prompt in _prompts(info):
        free = await run_checked(backend, _request(prompt, tag="stop-free", max_tokens=16, ignore_eos=True))
        ids = free.results[0].completion_ids
        stop = ids[2]
        expected = ids[: ids.index(stop) + 1]
        if eos & set(expected[:-1]):  # the backend could legitimately stop earlier at an eos id
            tried.append(ids)
            continue
        out = await run_checked(backend, _request(prompt, tag="stop", max_tokens=16, stop_token_ids=(stop,)))
        r = out.results[0]
        assert r.completion_ids == expected, f"stop id {stop}: expected {expected}, got {r.completion_ids}"
        assert r.finish_reason == "stop", f"finish {r.finish_reason!r}, expected 'stop'"
        assert r.stop_token_id == stop, f"stop_token_id {r.stop_token_id}, expected {stop}"
        if r.logprobs is not None:
            assert len(r.logprobs) == len(expected)
        absent = next(t for t in range(info.vocab_size) if t not in ids and t not in eos)
        out = await run_checked(backend, _request(prompt, tag="stop-absent", max_tokens=16, stop_token_ids=(absent,)))
        if not eos & set(ids):
            assert out.results[0].completion_ids == ids and out.results[0].finish_reason == "length", (
                f"a stop id ({absent}) that never occurs changed the completion"
            )
        # ignore_eos keeps sampling through stop ids
        out = await run_checked(
            backend, _request(prompt, tag="stop-ignored", max_tokens=16, stop_token_ids=(stop,), ignore_eos=True)
        )
        assert out.results[0].completion_ids == ids, "ignore_eos=True must sample through stop ids"
        return
    raise AssertionError(f"every probe prompt hit an eos id before its 3rd token; free runs: {tried}")


async def check_logprobs(backend: EngineBackend) -> None:
    """One finite logprob <= 0 per completion id; identical greedy runs give the same values."""
    info = backend.info()
    prompt = _prompt(info)
    runs = [
        (await run_checked(backend, _request(prompt, tag=f"lp-{i}", max_tokens=10, logprobs=True))).results[0]
        for i in range(2)
    ]
    a, b = runs
    assert a.logprobs is not None and b.logprobs is not None
    assert a.completion_ids == b.completion_ids
    diff = max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    assert diff <= LOGPROB_ATOL, f"logprobs of identical greedy runs differ by {diff} (> {LOGPROB_ATOL})"
    sampled = await run_checked(
        backend, _request(prompt, tag="lp-sampled", max_tokens=10, temperature=1.0, seed=7, logprobs=True)
    )
    assert sampled.results[0].logprobs is not None and len(sampled.results[0].logprobs) == len(
        sampled.results[0].completion_ids
    )


async def check_n_completions(backend: EngineBackend) -> None:
    """n=3 sampled completions come back as three well-formed results in one output."""
    info = backend.info()
    out = await run_checked(
        backend, _request(_prompt(info), tag="n3", max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    )
    assert [len(r.completion_ids) for r in out.results] == [6, 6, 6]


async def check_abort(backend: EngineBackend) -> None:
    """Aborting a running generation ends it with finish "abort" (fewer than max_tokens ids, logprobs matching);
    aborting an unknown id returns False; the engine then serves a new request normally."""
    info = backend.info()
    prompt = _prompt(info)
    max_tokens = min(info.max_model_len - len(prompt), 4096)
    req = _request(prompt, tag="abort", max_tokens=max_tokens, ignore_eos=True)
    task = asyncio.ensure_future(backend.generate(req))
    aborted = False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    await asyncio.sleep(0.02)
    while not task.done() and loop.time() < deadline:
        if await backend.abort(req.request_id):
            aborted = True
            break
        await asyncio.sleep(0.01)
    out = await asyncio.wait_for(task, 60.0)
    assert aborted, (
        f"abort({req.request_id!r}) never returned True while the request ran (it finished with "
        f"{out.results[0].finish_reason!r} after {len(out.results[0].completion_ids)} tokens)"
    )
    r = out.results[0]
    assert r.finish_reason == "abort", f"finish {r.finish_reason!r} after abort, expected 'abort'"
    assert len(r.completion_ids) < max_tokens
    if r.logprobs is not None:
        assert len(r.logprobs) == len(r.completion_ids)
    assert await backend.abort(_rid("unknown")) is False, "abort of an unknown request id must return False"
    assert await backend.abort(req.request_id) is False, "abort of a finished request must return False"
    after = await run_checked(backend, _request(prompt, tag="after-abort", max_tokens=4, ignore_eos=True))
    assert after.results[0].finish_reason == "length"


async def check_bad_input(backend: EngineBackend) -> None:
    """Empty prompts, out-of-vocabulary ids and prompt + max_tokens over max_model_len each raise an EngineError
    naming the request and the problem, while a concurrent valid request completes normally; a request dict
    without max_tokens is refused by decode_request with an EngineError naming the field."""
    info = backend.info()
    prompt = _prompt(info)
    over = info.max_model_len - len(prompt) + 1
    bad: Sequence[tuple[GenerateRequest, str]] = [
        (_request([], tag="bad-empty"), "empty"),
        (_request(prompt[:-1] + [info.vocab_size], tag="bad-vocab"), "vocab"),
        (_request(prompt[:-1] + [-1], tag="bad-negative"), "vocab"),
        (_request(prompt, tag="bad-long", max_tokens=over), "max_model_len"),
    ]
    good = _request(prompt, tag="good", max_tokens=24, ignore_eos=True)
    good_task = asyncio.ensure_future(backend.generate(good))
    await asyncio.sleep(0)
    for req, word in bad:
        try:
            await backend.generate(req)
        except EngineError as exc:
            msg = str(exc)
            assert req.request_id in msg, f"EngineError does not name the request: {msg!r}"
            assert word in msg.lower(), f"EngineError for {req.request_id} does not mention {word!r}: {msg!r}"
        else:
            raise AssertionError(f"{req.request_id}: expected EngineError, the engine accepted it")
    out = await asyncio.wait_for(good_task, 120.0)
    assert out.results[0].finish_reason == "length" and len(out.results[0].completion_ids) == 24, (
        "the valid request running next to the bad ones did not complete normally"
    )
    for r in out.results:
        check_result(r, good, info)
    raw = {"request_id": _rid("no-max"), "prompt_ids": prompt, "sampling": {"temperature": 0.0}}
    with pytest.raises(EngineError, match="max_tokens"):
        decode_request(raw)
    await run_checked(backend, _request(prompt, tag="after-bad", max_tokens=3, ignore_eos=True))


async def check_weight_version(backend: EngineBackend) -> None:
    """update_weights(path, v+1) makes info().weight_version and every later result carry v+1."""
    path = getattr(backend, WEIGHTS_PATH_ATTR, None)
    if not path:
        raise ConformanceSkip(
            f"no weights path: pass conformance_tests(..., weights_path=...) or set backend.{WEIGHTS_PATH_ATTR}"
        )
    info = backend.info()
    before = await run_checked(backend, _request(_prompt(info), tag="wv-before", max_tokens=3, ignore_eos=True))
    assert all(r.weight_version == info.weight_version for r in before.results), (
        f"results carry {[r.weight_version for r in before.results]}, info() says {info.weight_version}"
    )
    version = info.weight_version + 1
    await backend.update_weights(str(path), version)
    assert backend.info().weight_version == version, (
        f"info().weight_version {backend.info().weight_version} != {version}"
    )
    after = await run_checked(backend, _request(_prompt(info), tag="wv-after", max_tokens=3, n=2, ignore_eos=True))
    assert [r.weight_version for r in after.results] == [version, version], (
        f"results after update_weights carry {[r.weight_version for r in after.results]}, expected {version}"
    )


async def _refused(backend: EngineBackend, request: GenerateRequest, word: str) -> None:
    try:
        await backend.generate(request)
    except EngineError as exc:
        assert word in str(exc), f"the refusal does not name {word!r}: {exc}"
    else:
        raise AssertionError(f"{request.request_id}: expected an EngineError naming {word!r}, the engine accepted it")


async def check_min_tokens(backend: EngineBackend) -> None:
    """With min_tokens = m, no stop id is sampled among the first m tokens (vLLM masks stop ids and EOS there):
    a greedy run that stops at its stop id at position p runs past p when m > p, and agrees with the free run
    before p; min_tokens > max_tokens is refused."""
    info = backend.info()
    eos = set(info.eos_token_ids)
    for prompt in _prompts(info):
        free = (await run_checked(backend, _request(prompt, tag="mt-free", max_tokens=12, ignore_eos=True))).results[0]
        ids = free.completion_ids
        p = 2
        stop = ids[p]
        if eos & set(ids[: p + 1]) or stop in ids[:p]:
            continue
        plain = (await run_checked(backend, _request(prompt, tag="mt-0", max_tokens=12, stop_token_ids=(stop,),
                                                     min_tokens=0))).results[0]
        assert plain.completion_ids == ids[: p + 1] and plain.finish_reason == "stop", "min_tokens=0 changed a stop"
        req = _request(prompt, tag="mt", max_tokens=12, stop_token_ids=(stop,), min_tokens=p + 2)
        r = (await run_checked(backend, req)).results[0]
        got = r.completion_ids
        assert got[:p] == ids[:p], f"min_tokens changed the tokens before the masked position: {got} vs {ids}"
        assert not (set(got[: p + 2]) & ({stop} | eos)), f"a stop id among the first {p + 2} tokens: {got}"
        assert len(got) > p + 2, f"min_tokens={p + 2} but {len(got)} tokens ({r.finish_reason})"
        await _refused(backend, _request(prompt, tag="mt-bad", max_tokens=4, min_tokens=5), "min_tokens")
        return
    raise AssertionError("every probe prompt hit an eos id (or repeated its stop id) in its first 3 tokens")


def _check_scores(s: TokenLogprobs, token: int, k: int, where: str) -> None:
    assert len(s.top_ids) == len(s.top_logprobs) == k, f"{where}: {len(s.top_ids)} alternatives, asked {k}"
    assert all(a >= b for a, b in zip(s.top_logprobs, s.top_logprobs[1:])), f"{where}: not most likely first"
    assert s.rank >= 1 and s.logprob <= 1e-6, f"{where}: rank {s.rank}, logprob {s.logprob}"
    if s.rank <= k and s.logprob > -math.inf:
        assert abs(s.top_logprobs[s.rank - 1] - s.logprob) <= LOGPROB_ATOL, f"{where}: rank {s.rank} disagrees"
    if token in s.top_ids:
        assert abs(s.top_logprobs[s.top_ids.index(token)] - s.logprob) <= LOGPROB_ATOL, f"{where}: two logprobs"
    above = sum(v > s.logprob + LOGPROB_ATOL for v in s.top_logprobs)
    assert s.rank > above, f"{where}: rank {s.rank} but {above} listed tokens are more likely"


async def check_top_logprobs(backend: EngineBackend) -> None:
    """top_logprobs=k gives, per completion id, its rank and the k most likely tokens of the distribution its
    logprob is of (greedy: the argmax first, rank 1; top_k=3 sampling: nothing past the 3rd is possible);
    off by default; over info().max_logprobs refused."""
    info = backend.info()
    prompt = _prompt(info)
    if info.max_logprobs == 0:
        await _refused(backend, _request(prompt, tag="top-none", top_logprobs=1), "top_logprobs")
        return
    plain = (await run_checked(backend, _request(prompt, tag="top-off", max_tokens=4, ignore_eos=True))).results[0]
    assert plain.top_logprobs is None, "top_logprobs returned without being asked"
    k = min(5, info.max_logprobs)
    r = (await run_checked(backend, _request(prompt, tag="top-greedy", max_tokens=8, ignore_eos=True, logprobs=True,
                                             top_logprobs=k))).results[0]
    assert r.top_logprobs is not None and len(r.top_logprobs) == len(r.completion_ids)
    for i, (t, lp, s) in enumerate(zip(r.completion_ids, r.logprobs, r.top_logprobs)):
        _check_scores(s, t, k, f"greedy token {i}")
        assert s.top_ids[0] == t and s.rank == 1, f"greedy token {i}: {t} is not the most likely ({s})"
        assert abs(s.logprob - lp) <= LOGPROB_ATOL, f"greedy token {i}: logprob {lp} vs scores {s.logprob}"
    r = (await run_checked(backend, _request(prompt, tag="top-sampled", max_tokens=8, ignore_eos=True,
                                             temperature=1.0, top_k=3, seed=5, logprobs=True,
                                             top_logprobs=k))).results[0]
    for i, (t, lp, s) in enumerate(zip(r.completion_ids, r.logprobs, r.top_logprobs)):
        _check_scores(s, t, k, f"sampled token {i}")
        assert t in s.top_ids[:3] and abs(s.logprob - lp) <= LOGPROB_ATOL, f"sampled token {i}: {t}, {lp}, {s}"
        assert all(v == -math.inf for v in s.top_logprobs[3:]), f"sampled token {i}: top_k=3 let more through: {s}"
    await _refused(backend, _request(prompt, tag="top-over", top_logprobs=info.max_logprobs + 1), "top_logprobs")


async def check_prompt_logprobs(backend: EngineBackend) -> None:
    """prompt_logprobs=k scores every prompt token given its prefix (the first: None): scoring a prompt
    followed by a greedy completion gives back the completion's own logprobs, and the same scores when the
    prompt extends a session the engine holds KV for."""
    info = backend.info()
    prompt = _prompt(info)
    if not info.scores_prompts:
        await _refused(backend, _request(prompt, tag="pl-none", prompt_logprobs=0), "prompt_logprobs")
        return
    greedy = (await run_checked(backend, _request(prompt, tag="pl-greedy", max_tokens=6, ignore_eos=True,
                                                  logprobs=True))).results[0]
    full = prompt + greedy.completion_ids
    k = min(2, info.max_logprobs)
    out = await run_checked(backend, _request(full, tag="pl", max_tokens=1, ignore_eos=True, prompt_logprobs=k))
    scores = out.prompt_logprobs
    assert scores is not None and len(scores) == len(full) and scores[0] is None, "one entry per prompt token"
    for i in range(1, len(full)):
        _check_scores(scores[i], full[i], k, f"prompt token {i}")
    got = [s.logprob for s in scores[len(prompt):]]
    diff = max(abs(a - b) for a, b in zip(got, greedy.logprobs))
    assert diff <= LOGPROB_ATOL, f"prompt scores of the greedy completion differ from its logprobs by {diff}"
    assert all(s.rank == 1 for s in scores[len(prompt):]), "a greedy token scored below rank 1"
    sid = _rid("pl-session")
    first = GenerateRequest(_rid("pl-turn1"), list(prompt), SamplingParams(max_tokens=3, temperature=0.0,
                                                                            ignore_eos=True), session_id=sid)
    turn1 = (await run_checked(backend, first)).results[0]
    extended = prompt + turn1.completion_ids + greedy.completion_ids[:2]
    second = GenerateRequest(_rid("pl-turn2"), extended, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         ignore_eos=True, prompt_logprobs=k),
                             session_id=sid)
    cached = await run_checked(backend, second)
    fresh = await run_checked(backend, _request(extended, tag="pl-fresh", max_tokens=1, ignore_eos=True,
                                                prompt_logprobs=k))
    a = [s.logprob for s in cached.prompt_logprobs[1:]]
    b = [s.logprob for s in fresh.prompt_logprobs[1:]]
    assert max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_ATOL, "a session's cached prefix changed the scores"


async def check_reset_prefix_cache(backend: EngineBackend) -> None:
    """``reset_prefix_cache()`` (optional; the server's POST /reset_prefix_cache): True on an idle backend, and
    afterwards nothing is served from cache: a session's next turn, extending its prompt + completion, reports
    ``cached_prompt_tokens == 0``."""
    reset = getattr(backend, "reset_prefix_cache", None)
    if reset is None:
        raise ConformanceSkip("the backend has no reset_prefix_cache (an optional admin method)")
    prompt = _prompt(backend.info(), 16)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    session = _rid("reset-session")
    first = await run_checked(backend, GenerateRequest(_rid("reset-a"), list(prompt), greedy, session_id=session))
    assert await reset() is True, "reset_prefix_cache on an idle backend did not succeed"
    longer = [*prompt, *first.results[0].completion_ids, *prompt[:4]]
    after = await run_checked(backend, GenerateRequest(_rid("reset-b"), longer, greedy, session_id=session))
    assert after.results[0].cached_prompt_tokens == 0, "KV cached before reset_prefix_cache was reused"


async def check_sleep_wake_up(backend: EngineBackend) -> None:
    """``sleep(level)`` / ``wake_up()`` (optional; POST /sleep, /wake_up): either Unsupported naming why (and the
    backend keeps serving), or after sleep(2) + wake_up the greedy answer and its logprobs are those before."""
    from rollout.engines.protocol import Unsupported

    if getattr(backend, "sleep", None) is None:
        raise ConformanceSkip("the backend has no sleep (an optional admin method)")
    prompt = _prompt(backend.info())
    before = await run_checked(backend, _request(prompt, tag="sleep-before", max_tokens=8))
    try:
        await backend.sleep(2)
    except Unsupported as exc:
        assert str(exc), "Unsupported must say why"
    else:
        await backend.wake_up()
    after = await run_checked(backend, _request(prompt, tag="sleep-after", max_tokens=8))
    a, b = before.results[0], after.results[0]
    assert a.completion_ids == b.completion_ids, "the greedy answer changed across sleep + wake_up"
    if a.logprobs is not None and b.logprobs is not None:
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= LOGPROB_ATOL


CONFORMANCE_CHECKS: dict[str, ConformanceCheck] = {
    "info": check_info,
    "greedy_determinism": check_greedy_determinism,
    "seeded_sampling": check_seeded_sampling,
    "seeded_requests_over_one_step_budget": check_seeded_requests_over_one_step_budget,
    "max_tokens": check_max_tokens,
    "stop_tokens": check_stop_tokens,
    "logprobs": check_logprobs,
    "n_completions": check_n_completions,
    "abort": check_abort,
    "bad_input": check_bad_input,
    "weight_version": check_weight_version,
    "min_tokens": check_min_tokens,
    "top_logprobs": check_top_logprobs,
    "prompt_logprobs": check_prompt_logprobs,
    "reset_prefix_cache": check_reset_prefix_cache,
    "sleep_wake_up": check_sleep_wake_up,
}


# ------------------------------------------------------------------------------------------------ pytest glue


def conformance_tests(
    make_backend: Callable[[], Any],
    *,
    weights_path: str | None = None,
    skip: Mapping[str, str] | None = None,
    extra_checks: Mapping[str, ConformanceCheck] | None = None,
    timeout_s: float = 180.0,
) -> type:
    """A pytest test class running every check of :data:`CONFORMANCE_CHECKS` against one backend.

    ``make_backend()`` (sync, or returning an awaitable) is called once, inside the class's event loop.
    ``weights_path`` is stored on the backend as ``conformance_weights_path`` for the ``weight_version`` check.
    ``skip`` maps check names to reasons (reported as skips, never silently dropped). Each check is bounded by
    ``timeout_s``. ``extra_checks`` adds backend-specific checks (same signature) run on the same backend after
    the standard ones. Assign the result to a module-level name starting with ``Test``.
    """
    skips = dict(skip or {})
    checks = {**CONFORMANCE_CHECKS, **dict(extra_checks or {})}
    if len(checks) != len(CONFORMANCE_CHECKS) + len(extra_checks or {}):
        raise ValueError("extra_checks may not reuse the name of a standard check")
    unknown = set(skips) - set(checks)
    if unknown:
        raise ValueError(f"unknown conformance checks in skip: {sorted(unknown)}")

    class Conformance:
        @pytest.fixture(scope="class")
        @classmethod
        def conformance_engine(cls) -> Iterator[tuple[asyncio.Runner, Any]]:
            runner = asyncio.Runner()

            async def build() -> Any:
                backend = make_backend()
                if inspect.isawaitable(backend):
                    backend = await backend
                if weights_path is not None:
                    setattr(backend, WEIGHTS_PATH_ATTR, weights_path)
                return backend

            try:
                backend = runner.run(build())
                yield runner, backend
                runner.run(close_backend(backend))
            finally:
                runner.close()

        @pytest.mark.parametrize("check", list(checks))
        def test_conformance(self, conformance_engine: tuple[asyncio.Runner, Any], check: str) -> None:
            if check in skips:
                pytest.skip(skips[check])
            runner, backend = conformance_engine
            try:
                runner.run(asyncio.wait_for(checks[check](backend), timeout_s))
            except ConformanceSkip as exc:
                pytest.skip(str(exc))

    return Conformance
