"""The vLLM backend: vLLM 0.33's ``AsyncLLM`` in-process, token ids in and out.

vLLM is imported lazily (in :class:`VLLMEngine`'s constructor), so this module imports without vLLM installed.
vLLM's wheel is CUDA-only: on CPU machines this backend is tested against a stand-in with vLLM's method names and
output shapes (tests/vllm_standin.py); the real conformance suite runs on a GPU via scripts/gpu_check.sh.

What it sends to vLLM (see docs/engines.md and the vLLM 0.33 notes):

* Engine: ``AsyncEngineArgs(skip_tokenizer_init=True, enable_prefix_caching=True, max_logprobs>=1,
  logprobs_mode="processed_logprobs", ...)`` — no tokenizer, so no text anywhere; logprobs are those of the
  distribution actually sampled from (after temperature / top-k / top-p).
* Every request: ``SamplingParams(n, temperature, top_p, top_k, seed, max_tokens, stop_token_ids,
  ignore_eos, logprobs=0 | None, detokenize=False, output_kind=FINAL_ONLY)`` with explicit ``max_tokens`` and
  ``stop_token_ids`` (``ignore_eos=True`` sends no stop ids: the protocol's ignore_eos samples through all of
  them), and the prompt as ``tokens_input(ids, cache_salt="tito-w<version>")``: prefix caching is salted by the
  weight version, so KV computed under old weights is never reused.
* Weight update from a checkpoint directory (:meth:`VLLMEngine.update_weights`): new requests wait at a gate,
  in-flight ones drain (or are aborted, ``update_pause_mode="abort"``), then ``pause_generation(mode=...,
  clear_cache=True)`` → ``collective_rpc("reload_weights", kwargs={"weights_path": path})`` (vLLM's built-in
  in-place disk reload, ``GPUModelRunner.reload_weights``; it does not need ``weight_transfer_config``, unlike the
  NCCL/IPC weight-transfer API, which is for a trainer pushing tensors) → ``reset_prefix_cache(
  reset_running_requests=True)`` → version bump → ``resume_generation()``. Every completion is therefore sampled
  under exactly one weight version, the one it is stamped with.
* Results: ``finish_reason`` "stop" | "length" | "abort" | "error" pass through ("repetition" maps to "stop"),
  an int ``stop_reason`` becomes ``stop_token_id`` (vLLM includes the stop token in ``token_ids``),
  ``logprobs[i][token_ids[i]].logprob`` becomes the float logprob, ``num_cached_tokens`` becomes
  ``cached_prompt_tokens``. vLLM's ``ValueError`` s (input validation) become :class:`EngineError`; any other
  engine exception becomes results with finish "error" and the message in ``error``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from rollout.engines.protocol import (
    EngineError,
    EngineInfo,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    GenerateResult,
    Timings,
    validate_request,
)


def local_vllm_problem() -> str | None:
    """Why ``engine.backend: vllm`` cannot run on this machine (no vllm, no visible CUDA GPU), or None.
    Checked before Ray starts: an engine actor asking for a GPU that no node has would wait forever."""
    import importlib.util

    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append("vllm is not installed: pip install 'tito[vllm]' (on a machine with a CUDA GPU)")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        cuda = False
    if not cuda:
        problems.append("engine.backend=vllm needs a CUDA GPU; none visible (torch.cuda.is_available() is False)")
    return "; ".join(problems) or None


def cluster_gpu_problem(count: int, num_gpus: float | None) -> str | None:
    """Why the joined Ray cluster cannot place ``count`` vLLM engines of ``num_gpus`` GPUs each, or None."""
    import ray

    need = count * (1.0 if num_gpus is None else num_gpus)
    have = ray.cluster_resources().get("GPU", 0.0)
    if have < need:
        return (f"engine.backend=vllm needs {need:g} GPU(s) for {count} engine(s); the Ray cluster has {have:g} "
                "(engines would wait for a GPU forever)")
    return None


_FORCED_ARGS: dict[str, Any] = {
    "skip_tokenizer_init": True,
    "enable_prefix_caching": True,
    "logprobs_mode": "processed_logprobs",
}
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
    "repetition": "stop",
}


def cache_salt(version: int) -> str:
    """The prefix-cache salt for a weight version: prompts under different versions never share cached KV."""
    return f"tito-w{version}"


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class VLLMEngine:
    """An :class:`~rollout.engines.protocol.EngineBackend` over vLLM's ``AsyncLLM`` (see the module doc).

    Construct it on the event loop that will use it (e.g. inside a Ray async actor's method, or via
    :meth:`create`): vLLM's output handler binds to the running loop.

    Args:
        model: a model directory or hub id (read by vLLM; tito never loads its tokenizer here).
        eos_token_ids: ids reported by :meth:`info` (the caller still sends stop ids explicitly). Default: the
            model config's / generation config's ``eos_token_id``.
        update_pause_mode: how :meth:`update_weights` treats in-flight requests: "wait" (drain them under the old
            weights) or "abort" (finish them with "abort").
        engine_args: further ``AsyncEngineArgs`` fields (e.g. ``tensor_parallel_size``, ``kv_cache_memory_bytes``);
            the three forced ones (skip_tokenizer_init, enable_prefix_caching, logprobs_mode) cannot be overridden.
    """

    def __init__(
        self,
        model: str,
        *,
        max_model_len: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        seed: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.85,
        max_num_seqs: int | None = None,
        enforce_eager: bool = False,
        weight_version: int = 0,
        update_pause_mode: Literal["wait", "abort"] = "wait",
        engine_args: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            from vllm import AsyncEngineArgs
            from vllm.inputs import tokens_input
            from vllm.sampling_params import RequestOutputKind, SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise ImportError(
                f"the vLLM backend needs vllm (`pip install tito[vllm]`, CUDA machines only): {exc}"
            ) from exc
        if update_pause_mode not in ("wait", "abort"):
            raise ValueError(f"update_pause_mode must be 'wait' or 'abort', got {update_pause_mode!r}")
        extra = dict(engine_args or {})
        clash = {k: extra[k] for k in _FORCED_ARGS if k in extra and extra[k] != _FORCED_ARGS[k]}
        if clash:
            raise ValueError(f"VLLMEngine needs {_FORCED_ARGS}; engine_args tried to set {clash}")
        kwargs: dict[str, Any] = dict(
            model=model,
            seed=seed,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            disable_log_stats=True,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        kwargs.update(extra)
        kwargs.update(_FORCED_ARGS)
        kwargs["max_logprobs"] = max(1, int(kwargs.get("max_logprobs") or 1))

        self._SamplingParams = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._tokens_input = tokens_input
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self._model = model
        self._version = int(weight_version)
        self._pause_mode = update_pause_mode

        model_config = getattr(self._engine, "model_config", None) or self._engine.vllm_config.model_config
        self._vocab_size = int(model_config.get_vocab_size())
        self._max_model_len = int(model_config.max_model_len)
        if eos_token_ids is None:
            eos = _eos_ids(getattr(model_config.hf_config, "eos_token_id", None))
            try:
                gen = model_config.try_get_generation_config() or {}
            except Exception:  # noqa: BLE001 - a missing/odd generation config only loses extra eos ids
                gen = {}
            eos += [t for t in _eos_ids(gen.get("eos_token_id")) if t not in eos]
            eos_token_ids = eos
        self._eos = list(eos_token_ids)

        self._active: set[str] = set()  # submitted to vLLM
        self._waiting: dict[str, bool] = {}  # held at the gate -> aborted while waiting
        self._open = asyncio.Event()  # set: new requests may be submitted (cleared during weight updates)
        self._open.set()
        self._idle = asyncio.Event()  # set: no request of ours is in flight
        self._idle.set()
        self._update_lock = asyncio.Lock()

    @classmethod
    async def create(cls, model: str, **kwargs: Any) -> VLLMEngine:
        """Construct on the running event loop (what a Ray async actor should call)."""
        return cls(model, **kwargs)

    # -- protocol ---------------------------------------------------------------------------------------------

    def info(self) -> EngineInfo:
        return EngineInfo(
            backend="vllm",
            model=self._model,
            vocab_size=self._vocab_size,
            max_model_len=self._max_model_len,
            weight_version=self._version,
            eos_token_ids=list(self._eos),
        )

    def sampling_params(self, request: GenerateRequest) -> Any:
        """The vLLM ``SamplingParams`` sent for ``request`` (explicit max_tokens and stop ids, no detokenizing)."""
        s = request.sampling
        return self._SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            seed=s.seed,
            max_tokens=s.max_tokens,
            stop_token_ids=[] if s.ignore_eos else list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=0 if s.logprobs else None,
            detokenize=False,
            output_kind=self._final_only,
        )

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        validate_request(request, self.info())
        rid = request.request_id
        if rid in self._active or rid in self._waiting:
            raise EngineError(f"request {rid}: a request with this id is already running")
        if not self._open.is_set():  # a weight update or pause is under way: wait here, abortable
            self._waiting[rid] = False
            try:
                while not self._open.is_set():
                    await self._open.wait()
            finally:
                aborted = self._waiting.pop(rid)
            if aborted:
                return self._empty_output(request, "abort", None, self._version)
        self._active.add(rid)
        self._idle.clear()
        version = self._version
        t0 = time.perf_counter()
        try:
            prompt = self._tokens_input(list(request.prompt_ids), cache_salt=cache_salt(version))
            final = None
            async for out in self._engine.generate(prompt, self.sampling_params(request), rid):
                final = out
        except asyncio.CancelledError:
            raise
        except ValueError as exc:  # vLLM's input validation (VLLMValidationError is a ValueError)
            raise EngineError(f"request {rid}: vLLM refused the request: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - engine failures become finish "error" for this request
            return self._empty_output(request, "error", f"{type(exc).__name__}: {exc}", version)
        finally:
            self._active.discard(rid)
            if not self._active:
                self._idle.set()
        if final is None:
            return self._empty_output(request, "error", "vLLM returned no output", version)
        elapsed = time.perf_counter() - t0
        cached = int(getattr(final, "num_cached_tokens", 0) or 0)
        results = [
            self._result(c, request, version, cached, elapsed) for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        return GenerateOutput(request_id=rid, prompt_len=len(request.prompt_ids), results=results)

    async def abort(self, request_id: str) -> bool:
        if self._waiting.get(request_id) is False:  # held at the gate: it finishes "abort" without reaching vLLM
            self._waiting[request_id] = True
            return True
        if request_id not in self._active:
            return False
        await self._engine.abort(request_id)
        return True

    async def update_weights(self, path: str, version: int) -> None:
        """Reload weights from checkpoint directory ``path``; later results carry ``version`` (see module doc)."""
        async with self._update_lock:
            self._open.clear()
            try:
                if self._pause_mode == "abort":
                    for rid in list(self._active):
                        await self._engine.abort(rid)
                await self._idle.wait()
                await self._engine.pause_generation(mode=self._pause_mode, clear_cache=True)
                try:
                    await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
                    await self._engine.reset_prefix_cache(reset_running_requests=True)
                    self._version = int(version)
                finally:
                    await self._engine.resume_generation()
            finally:
                self._open.set()

    # -- extras -----------------------------------------------------------------------------------------------

    async def pause(self, mode: Literal["abort", "wait", "keep"] = "keep", clear_cache: bool = True) -> None:
        """``AsyncLLM.pause_generation``, for a trainer that pushes weights itself (e.g. vLLM's NCCL weight
        transfer). New requests wait in this backend until :meth:`resume`; in "keep" mode the in-flight ones are
        frozen and finish after resume (their tokens may then span two weight versions; they are stamped with the
        version they started under)."""
        self._open.clear()
        await self._engine.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self, weight_version: int | None = None) -> None:
        """``AsyncLLM.resume_generation``; ``weight_version`` stamps the requests submitted from now on (and
        changes their cache salt)."""
        if weight_version is not None:
            self._version = int(weight_version)
        try:
            await self._engine.resume_generation()
        finally:
            self._open.set()

    async def health(self) -> dict[str, Any]:
        try:
            await self._engine.check_health()
        except Exception as exc:  # noqa: BLE001
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "running": len(self._active)}
        return {"ok": True, "running": len(self._active), "weight_version": self._version}

    def close(self) -> None:
        """Shut vLLM's engine core down."""
        self._engine.shutdown()

    # -- helpers ----------------------------------------------------------------------------------------------

    def _result(self, c: Any, request: GenerateRequest, version: int, cached: int, elapsed: float) -> GenerateResult:
        ids = [int(t) for t in c.token_ids]
        finish = _FINISH.get(c.finish_reason or "", "error")
        stop_id = c.stop_reason if finish == "stop" and isinstance(c.stop_reason, int) else None
        if (
            finish == "stop"
            and stop_id is None
            and ids
            and ids[-1] in set(request.sampling.stop_token_ids) | set(self._eos)
        ):
            stop_id = ids[-1]
        logprobs = None
        if request.sampling.logprobs and c.logprobs is not None:
            logprobs = [float(_sampled_logprob(c.logprobs[i], t)) for i, t in enumerate(ids)]
        return GenerateResult(
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,
            stop_token_id=stop_id,
            cached_prompt_tokens=min(cached, len(request.prompt_ids)),
            weight_version=version,
            timings=Timings(decode_s=elapsed),
            error=None if finish != "error" else f"vLLM finished with {c.finish_reason!r}",
        )

    def _empty_output(
        self, request: GenerateRequest, finish: FinishReason, message: str | None, version: int
    ) -> GenerateOutput:
        logprobs: list[float] | None = [] if finish == "abort" and request.sampling.logprobs else None
        results = [
            GenerateResult(
                completion_ids=[], logprobs=logprobs, finish_reason=finish, weight_version=version, error=message
            )
            for _ in range(request.sampling.n)
        ]
        return GenerateOutput(request_id=request.request_id, prompt_len=len(request.prompt_ids), results=results)


def _sampled_logprob(position: Mapping[int, Any] | Iterable[Any], token: int) -> float:
    """The sampled token's logprob from one position of vLLM's logprobs (``{token_id: Logprob}``)."""
    if isinstance(position, Mapping):
        entry = position.get(token)
        if entry is None:  # logprobs=0: the sampled token is the only (first) entry
            entry = next(iter(position.values()))
        return entry.logprob
    raise TypeError(f"unexpected logprobs entry {type(position).__name__}")
