"""The token-in/token-out engine protocol: the only thing the rollout loop knows about an engine.

Engines never see text. A request carries prompt ids and explicit sampling settings (``max_tokens``
is required: no engine-side default silently truncates a turn); a result carries the sampled ids,
each sampled token's logprob under the distribution actually sampled from (after temperature and
top-k/top-p), why generation ended, and what the engine reused from its cache.

On request it also carries, as vLLM does: the ``top_logprobs`` most likely tokens at each sampled
position (from the same distribution as the sampled token's logprob) with the sampled token's rank, and
``prompt_logprobs``, the score of each prompt token given its prefix (raw log-softmax of the model's
logits, as vLLM scores prompts). ``min_tokens`` keeps stop ids and EOS from being sampled before that many
tokens (they are masked out of the distribution, so the reported logprobs are of the masked one).

Weight versions: a result's ``weight_version`` is the version of the weights that sampled its tokens. A weight
update that keeps running requests running (``update_weights(..., keep_running=True)``, the embedded engine's:
prime-rl's and SkyRL's pause mode "keep") lets one completion span two versions; such a result also carries
``token_versions``, the version that sampled each completion token (one per completion id, non-decreasing), and
its ``weight_version`` is the lowest of them. ``token_versions`` is None whenever one version sampled every token.

Every backend (embedded torch, vLLM, replay) implements :class:`EngineBackend` and passes the
conformance suite in tests/engine_conformance.py.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal, Protocol, runtime_checkable

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]


class EngineError(ValueError):
    """A request the engine refuses (bad input); the text names the problem. The engine keeps serving.
    ``param`` names the offending field of the request when there is one (``sampling.seed`` -> ``"seed"``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # keep ``param`` through pickling (Ray)
        return (type(self), (str(self), self.param))


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# below this a temperature makes logits / temperature overflow float32 to inf (NaN probabilities);
# vLLM clamps such values up to 1e-2, here they are refused so what is sampled is what was asked
MIN_TEMPERATURE = 1e-2
# the most alternatives per position a request may ask for (top_logprobs, prompt_logprobs): vLLM's default
# max_logprobs, and the most OpenAI's chat API accepts
MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: int  # required: the number of tokens this turn may sample
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no top-k
    seed: int | None = None  # per-request generator; None = nondeterministic
    stop_token_ids: tuple[int, ...] = ()  # the stop token is included in the completion and ends it
    logprobs: bool = True  # return the sampled tokens' logprobs
    ignore_eos: bool = False  # keep sampling through stop ids (benchmarks)
    n: int = 1  # completions per request (each is one GenerateResult in GenerateOutput.results)
    min_tokens: int = 0  # stop ids and EOS are masked out until this many tokens are sampled
    top_logprobs: int = 0  # this many most likely tokens per sampled position, with the sampled one's rank
    prompt_logprobs: int | None = None  # score the prompt: each token's logprob given its prefix, + k alternatives


class GenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None  # a rollout's id: the engine may keep its KV for the next turn
    lora: str | None = None  # the name of a loaded LoRA adapter to sample with (vLLM: `model: <lora_name>`)


class Timings(msgspec.Struct):
    queue_s: float = 0.0  # waiting before the first forward pass
    prefill_s: float = 0.0
    decode_s: float = 0.0


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The scores at one position: the token's logprob and its rank (as vLLM counts it: the number of tokens
    at least as likely, so the most likely token has rank 1), then the ``k`` most likely tokens there, most
    likely first, with their logprobs (-inf for a token the sampler's filters removed)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class GenerateResult(msgspec.Struct):
    completion_ids: list[int]
    logprobs: list[float] | None  # float32 values, one per completion id
    finish_reason: FinishReason
    stop_token_id: int | None = None  # the stop id that ended it (it is the last completion id)
    cached_prompt_tokens: int = 0  # prompt tokens served from cache (session KV / prefix cache)
    weight_version: int = 0
    timings: Timings = msgspec.field(default_factory=Timings)
    error: str | None = None  # set when finish_reason == "error"
    # sampling.top_logprobs > 0: one entry per completion id, from the distribution ``logprobs`` is of
    top_logprobs: list[TokenLogprobs] | None = None
    # the version that sampled each completion id, set only when they differ (a keep_running weight update landed
    # mid-request); None: every token is ``weight_version``'s, which is always the lowest
    token_versions: list[int] | None = None


class GenerateOutput(msgspec.Struct):
    request_id: str
    prompt_len: int
    results: list[GenerateResult]  # n entries
    # sampling.prompt_logprobs set: one entry per prompt token, the first None (nothing precedes it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class EngineInfo(msgspec.Struct):
    backend: str  # "embedded" | "vllm" | "replay"
    model: str
    vocab_size: int
    max_model_len: int
    weight_version: int
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    max_logprobs: int = MAX_LOGPROBS  # the most top_logprobs / prompt_logprobs alternatives it reports; 0: none
    scores_prompts: bool = True  # whether it computes prompt_logprobs (a model forward over the prompt)
    max_loras: int = 0  # the most LoRA adapters it holds at once (load_lora_adapter); 0: it serves none


class SchedulerStats(msgspec.Struct):
    """What an engine's scheduler holds at this moment, in vLLM's terms (its ``SchedulerStats`` and cache config):
    the server exports it as vLLM's ``vllm:`` metric families, which prime-rl's concurrency controller sizes its
    episodes in flight by. Counts are of sequences (a request with ``n`` completions counts ``n``, as vLLM's
    scheduler counts its child requests). A backend reports it with an optional ``scheduler_stats()`` method."""

    running: int  # sequences in the running batch
    waiting: int  # sequences queued, not yet admitted
    kv_cache_usage: float  # fraction of the KV budget the running sequences hold, in [0, 1]
    kv_cache_size_tokens: int  # the KV budget in tokens (vLLM: num_gpu_blocks x block_size)
    block_size: int = 1  # tokens per KV block (the embedded engine allocates per token)
    preemptions: int = 0  # sequences preempted since start (cumulative)
    waiting_for_capacity: int | None = None  # of ``waiting``, those queued for lack of KV or batch room


@runtime_checkable
class EngineBackend(Protocol):
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample completions for ``request``. Bad input raises :class:`EngineError` for this request only."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Stop a running request; its result comes back with finish_reason "abort". False if unknown."""
        ...

    async def update_weights(self, path: str, version: int, *, keep_running: bool = False) -> None:
        """Load weights from a checkpoint directory; later results carry ``version``. By default the running
        requests finish first (every result from one version). ``keep_running=True``: they go on under the new
        weights on the KV the old ones computed, each token stamped (``token_versions``); a backend that cannot
        attribute tokens to versions raises :class:`Unsupported`. A backend written before this option may omit
        the keyword: callers pass it only when it is True."""
        ...

    def info(self) -> EngineInfo: ...


async def load_weights(backend: EngineBackend, path: str, version: int, keep_running: bool) -> None:
    """``backend.update_weights``, with ``keep_running`` passed only when True; a backend whose ``update_weights``
    takes no such keyword (written before the option) raises :class:`Unsupported` for it, so the caller drains."""
    if not keep_running:
        return await backend.update_weights(path, version)
    params = inspect.signature(backend.update_weights).parameters
    if "keep_running" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise Unsupported(f"{type(backend).__name__}.update_weights takes no keep_running: it cannot keep requests "
                          "running through a weight update")
    await backend.update_weights(path, version, keep_running=True)


async def close_backend(backend: object) -> None:
    """Release a backend's resources: its ``aclose``, ``close`` or ``shutdown`` (the first it has),
    awaited when it is a coroutine. Backends are not required to have any of them."""
    for name in ("aclose", "close", "shutdown"):
        fn = getattr(backend, name, None)
        if callable(fn):
            res = fn()
            if inspect.isawaitable(res):
                await res
            return


def validate_request(request: GenerateRequest, info: EngineInfo) -> None:
    """The checks every backend applies before touching the model; raises EngineError naming the problem."""
    ids = request.prompt_ids
    s = request.sampling
    if not ids:
        raise EngineError(f"request {request.request_id}: empty prompt", "prompt")
    bad = next((t for t in ids if not isinstance(t, int) or t < 0 or t >= info.vocab_size), None)
    if bad is not None:
        raise EngineError(f"request {request.request_id}: token id {bad!r} is outside the vocabulary [0, {info.vocab_size})",
                          "prompt")
    if s.max_tokens < 1:
        raise EngineError(f"request {request.request_id}: max_tokens must be >= 1, got {s.max_tokens}", "max_tokens")
    if len(ids) + s.max_tokens > info.max_model_len:
        raise EngineError(
            f"request {request.request_id}: prompt ({len(ids)} tokens) + max_tokens ({s.max_tokens}) "
            f"exceeds max_model_len {info.max_model_len}", "max_tokens"
        )
    if s.n < 1:
        raise EngineError(f"request {request.request_id}: n must be >= 1, got {s.n}", "n")
    if s.temperature < 0 or not 0 < s.top_p <= 1:
        raise EngineError(f"request {request.request_id}: temperature must be >= 0 and top_p in (0, 1]",
                          "top_p" if s.temperature >= 0 else "temperature")
    if not math.isfinite(s.temperature) or 0 < s.temperature < MIN_TEMPERATURE:
        raise EngineError(f"request {request.request_id}: temperature must be 0 (greedy) or in "
                          f"[{MIN_TEMPERATURE}, inf), got {s.temperature!r}", "temperature")
    if s.top_k < -1:
        raise EngineError(f"request {request.request_id}: top_k must be -1 or 0 (off) or >= 1, got {s.top_k}", "top_k")
    if s.seed is not None and not INT64_MIN <= s.seed <= INT64_MAX:
        raise EngineError(f"request {request.request_id}: seed must fit in a signed 64-bit integer, got {s.seed}",
                          "seed")
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise EngineError(f"request {request.request_id}: min_tokens must be in [0, max_tokens={s.max_tokens}], "
                          f"got {s.min_tokens}", "min_tokens")
    for name, k in (("top_logprobs", s.top_logprobs), ("prompt_logprobs", s.prompt_logprobs or 0)):
        if not 0 <= k <= info.max_logprobs:
            raise EngineError(f"request {request.request_id}: {name} must be in [0, {info.max_logprobs}] on this "
                              f"{info.backend} engine, got {k}", name)
    if s.prompt_logprobs is not None and not info.scores_prompts:
        raise EngineError(f"request {request.request_id}: prompt_logprobs: the {info.backend} engine does not "
                          "score prompts (it runs no model)", "prompt_logprobs")
    if request.lora is not None and not info.max_loras:
        raise EngineError(f"request {request.request_id}: the {info.backend} engine serves no LoRA adapters "
                          f"(asked for {request.lora!r})", "model")
    bad_stop = next((t for t in s.stop_token_ids if t < 0 or t >= info.vocab_size), None)
    if bad_stop is not None:
        raise EngineError(f"request {request.request_id}: stop token id {bad_stop} is outside the vocabulary",
                          "stop_token_ids")


def root_cause(exc: BaseException) -> BaseException:
    """A Ray task error's original exception (its str is the message alone, not the remote traceback)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def decode_request(data: bytes | dict) -> GenerateRequest:
    """A request from JSON bytes or a dict, with msgspec's precise errors as EngineError
    (a missing ``max_tokens`` is named, not defaulted)."""
    try:
        if isinstance(data, (bytes, bytearray, str)):
            return msgspec.json.decode(data, type=GenerateRequest)
        return msgspec.convert(data, type=GenerateRequest)
    except msgspec.ValidationError as exc:
        raise EngineError(f"invalid request: {exc}") from None


class Unsupported(RuntimeError):
    """An admin operation this backend cannot do here (HTTP 501); the text names the backend and why.
    Raised instead of pretending: a caller that must free memory or reset a cache learns it did not happen."""

    status = 501

    def __reduce__(self):  # keep the type through pickling (Ray)
        return (type(self), (str(self),))


class EngineDead(RuntimeError):
    """The engine can serve nothing more (vLLM's ``EngineDeadError``: its EngineCore process died). Raised by a
    backend instead of answering each later request with finish "error": the Ray actor hosting it then exits,
    so callers see an actor death and move its requests to the other engines (or stop, when none is left)."""

    def __reduce__(self):  # keep the type through pickling (Ray)
        return (type(self), (str(self),))
