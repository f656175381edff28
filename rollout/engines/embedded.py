"""The embedded engine: a transformers causal LM in torch with continuous batching and session KV reuse.

The default engine wherever there is no GPU (fp32 on CPU; CUDA where present). One asyncio scheduler
task drives the model; all torch work runs in one dedicated worker thread, so the event loop stays free
to accept requests and aborts while a step runs. A step is:

1. apply aborts; admit waiting requests (up to ``max_batch`` rows and a per-step prefill token budget, at
   least one request): each gets its own batch row(s); when its prompt extends its session's cached
   tokens, that KV is copied in and only the rest of the prompt is new;
2. ONE forward pass over a packed sequence: the next token of every running row (each at its own
   position, no padding) followed by the new prompt tokens of the admitted requests. On a CPU a forward
   is bound by reading the weights, so admitting requests into the decode pass costs little extra;
3. sample (decode rows, and each admitted request's first token), detect stop / length, and deliver
   finished results at once. A finished sequence that has a session stays one more step so that its
   last token's KV is written, then its row moves to the session store and leaves the batch.

So a request never waits for another to finish: it joins at the next step and leaves when done.
Contracts (tests/test_embedded_engine.py checks each with the real model): sampled-token logprobs match
a separate full forward pass within 1e-4 (fp32); greedy results are deterministic and independent of the
batch they ran in; seeded sampling reproduces; a session's next turn prefills only its new tokens.
On request (vLLM's options, tests/test_serve_logprobs.py): ``min_tokens`` masks the stop ids and EOS until
that many tokens are sampled; ``top_logprobs`` adds the most likely tokens of the distribution each token
was sampled from; ``prompt_logprobs`` scores the prompt from the prefill's logits (such a prompt is
prefilled whole, not from its session's KV: cached positions have no logits).

Weight updates (:meth:`EmbeddedEngine.update_weights`) swap the model between two steps. By default the running
requests finish first, so each result comes from one version. With ``keep_running=True`` the swap happens at the
next step boundary and the running sequences go on under the new weights on the KV the old ones computed (prime-rl's
and SkyRL's vLLM pause mode "keep"): each sequence records the version of every token it samples, and a result
whose tokens span versions carries ``token_versions``. Such a sequence's KV mixes versions, so it is never stored
for its session's next turn.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import CheckpointError, CheckpointValidator, expected_from_model
from .embedded_kv import (
    BatchKV,
    SamplerRow,
    SessionKV,
    SessionStore,
    prompt_scores,
    register_attention,
    sample,
)
from .lora import AdapterError, LoraAdapter, LoraSlots, hook_targets, read_adapter
from .protocol import (
    EngineError,
    EngineInfo,
    GenerateOutput,
    GenerateRequest,
    GenerateResult,
    SchedulerStats,
    Timings,
    TokenLogprobs,
    Unsupported,
    validate_request,
)
from .streaming import Listener, StreamDelta, stream_with_listener
from .weight_transfer import (
    DEFAULT_TIMEOUT_S,
    GlooReceiver,
    WeightTransfer,
    in_background,
    parse_init_info,
    parse_update_info,
    tensor_checksums,
)


def _cache_arg(model: torch.nn.Module) -> str:
    """The name a model's forward takes its KV cache by: ``cache`` from transformers 5.20 on, ``past_key_values``
    before (vLLM 0.32 pins transformers < 5.20). An unknown keyword is swallowed by ``**kwargs``: passing the
    wrong one would run every step without the KV of the tokens before it, sampling garbage without an error."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise TypeError(f"{type(model).__name__}.forward takes neither cache nor past_key_values: no KV cache to pass")


@dataclass
class _Seq:
    """One of a request's ``n`` completions while it runs."""

    req: _Req
    index: int
    tokens: list[int]  # prompt + completion so far
    generator: torch.Generator | None
    fed: int = 0  # tokens whose KV is in the row (tokens[fed] is the next input)
    logprobs: list[float] = field(default_factory=list)
    tops: list[TokenLogprobs] = field(default_factory=list)  # sampling.top_logprobs > 0: one per token
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each completion token
    finalizing: bool = False  # finished; kept one step to write its last token's KV for the session
    # in the batch at a keep_running weight swap: its KV mixes versions, so it never goes to the session store
    kept_across_update: bool = False
    streamed: int = 0  # completion tokens already told to the request's listener (generate_stream)


@dataclass
class _Req:
    request: GenerateRequest
    future: asyncio.Future
    arrival: float
    results: list[GenerateResult | None]
    admitted: float = 0.0
    prefill_s: float = 0.0
    prefill_end: float = 0.0
    cached: int = 0
    listener: Listener | None = None  # generate_stream's: told the new tokens after each step
    adapter_slot: int = -1  # request.lora's slot (see LoraSlots), -1: the base model
    adapter_key: str | None = None  # "<name>@<version>" at admission: what its session KV was computed under
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # sampling.prompt_logprobs: scored at prefill

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)


class EmbeddedEngine:
    """A transformers causal LM behind the :class:`~rollout.engines.protocol.EngineBackend` protocol.

    ``model`` is a directory (safetensors), a GGUF file or an alias (``smollm2-135m``; fetched like
    ``tito pull`` on first use unless ``fetch=False``); a GGUF file is converted once into the cache.
    Knobs: ``max_batch`` rows decode together; ``kv_cache_bytes`` bounds
    the session KV kept between turns (LRU by bytes; the running batch's own buffer is not counted);
    ``prefill_tokens_per_step`` bounds the prompt tokens one step admits (at least one request is always
    admitted, however long), which bounds how long the running rows wait for that step; ``threads`` sets
    torch's intra-op threads (process-wide; None leaves torch's setting, i.e. OMP_NUM_THREADS or all
    cores). On small CPUs one single-threaded engine per core scales best (docs/engines.md).
    """

    def __init__(self, model: str | os.PathLike = "smollm2-135m", *, device: str | None = None,
                 max_batch: int = 32, kv_cache_bytes: int = 1 << 30, prefill_tokens_per_step: int = 2048,
                 max_model_len: int | None = None, threads: int | None = None,
                 weight_version: int = 0, fetch: bool = True, max_loras: int = 8, max_lora_rank: int = 64,
                 weight_transfer: WeightTransfer = "none", weight_transfer_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        from ..models import load_causal_lm

        if weight_transfer not in ("none", "gloo"):
            raise EngineError(f"engine.weight_transfer: {weight_transfer!r} is not for the embedded engine: it receives "
                              "weights over gloo (or none); nccl is vLLM's own engine on CUDA GPUs (engine.backend: "
                              "vllm)", "weight_transfer")
        if threads is not None:
            torch.set_num_threads(threads)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model_name = str(model)
        self.model = load_causal_lm(model, device=str(self.device), fetch=fetch)
        self.model.config._attn_implementation = register_attention()
        # what every checkpoint must match; taken once: a load that changed the architecture is refused
        # the same config builds every later load (_load_weights), so a checkpoint's own config.json must agree
        self._validate = CheckpointValidator(expected_from_model(self.model), served_config=self.model.config.to_dict())
        cfg = self.model.config
        self.max_batch = max_batch
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self._max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv = BatchKV(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, self.model.dtype, self.device,
                          max_rows=max_batch, max_cols=self._max_model_len)
        self.sessions = SessionStore(kv_cache_bytes)
        self.weight_version = weight_version
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else cfg.eos_token_id
        self._eos = [eos] if isinstance(eos, int) else list(eos or [])
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tito-embedded")
        self._waiting: list[_Req] = []
        self._running: list[_Seq] = []  # row i of the batch KV is _running[i]
        self._by_id: dict[str, _Req] = {}
        self._aborts: set[str] = set()
        # (source, version, keep_running, done, same: the served weights already, nothing to load); source: a
        # checkpoint directory, tensors received over the wire, or None (a relabel: same)
        self._updates: list[tuple[str | dict | None, int, bool, asyncio.Future, bool]] = []
        self._wake: asyncio.Event | None = None
        self._scheduler: asyncio.Task | None = None
        self.stats = {"steps": 0, "prefill_tokens": 0, "cached_tokens": 0, "decode_tokens": 0, "reloads_skipped": 0}
        # LoRA adapters (rollout/engines/lora.py): up to max_loras at once, each in a slot its requests' tokens name
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self._lora_slots = LoraSlots()
        self._hooked: set[str] = set()
        self._loras: dict[str, tuple[int, int, LoraAdapter]] = {}  # name -> (slot, version, adapter)
        self._slot_version: dict[int, int] = {}
        # weights over the wire (rollout/engines/weight_transfer.py): the trainer's group, staged tensors
        self.weight_transfer = weight_transfer
        self._wire = GlooReceiver(self._validate.expected, weight_transfer_timeout_s) if weight_transfer == "gloo" else None
        self._wire_weights = False  # the served weights came over the wire: no file holds them

    # -- protocol ---------------------------------------------------------------------------------------
    def info(self) -> EngineInfo:
        return EngineInfo(backend="embedded", model=self.model_name, vocab_size=self.model.config.vocab_size,
                          max_model_len=self._max_model_len, weight_version=self.weight_version,
                          eos_token_ids=list(self._eos), max_loras=self.max_loras)

    def progress(self) -> int:
        """Engine steps so far: grows while requests make headway (a hung engine's stays put)."""
        return self.stats["steps"]

    def scheduler_stats(self) -> SchedulerStats:
        """The running batch against its KV budget (``max_batch`` rows of ``max_model_len`` tokens: the most the
        batch buffer holds) and the queue; never preempts. A queued request waits for capacity when the rows
        left cannot take its ``n``, or one ahead of it waits so (the other reason to wait is the per-step prefill budget)."""
        capacity = self.max_batch * self._max_model_len
        held = sum(seq.fed for seq in self._running)
        rows = len(self._running)
        waiting = for_capacity = 0
        blocked = False  # admission is in order: behind a request that does not fit, every later one waits too
        for req in self._waiting:
            n = req.request.sampling.n
            waiting += n
            blocked = blocked or rows + n > self.max_batch
            if blocked:
                for_capacity += n
            rows += n
        return SchedulerStats(running=len(self._running), waiting=waiting, kv_cache_usage=min(1.0, held / capacity),
                              kv_cache_size_tokens=capacity, waiting_for_capacity=for_capacity)

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | GenerateOutput]:
        """Token by token (after each scheduler step; see rollout/engines/streaming.py), then the output."""
        return stream_with_listener(lambda listener: self.generate(request, listener))

    async def generate(self, request: GenerateRequest, listener: Listener | None = None) -> GenerateOutput:
        """Sample ``request.sampling.n`` completions. Bad input raises EngineError before anything runs;
        cancelling the awaiting task aborts the request."""
        validate_request(request, self.info())
        if request.sampling.n > self.max_batch:
            raise EngineError(
                f"request {request.request_id}: n={request.sampling.n} exceeds max_batch {self.max_batch}"
            )
        if request.request_id in self._by_id:
            raise EngineError(f"request {request.request_id}: a request with this id is already running")
        slot = -1
        if request.lora is not None:
            if request.lora not in self._loras:
                raise EngineError(f"request {request.request_id}: no LoRA adapter named {request.lora!r} is loaded",
                                  "model")
            slot = self._loras[request.lora][0]
        self._ensure_scheduler()
        req = _Req(request, asyncio.get_running_loop().create_future(), time.perf_counter(),
                   [None] * request.sampling.n, listener=listener, adapter_slot=slot)
        self._by_id[request.request_id] = req
        self._waiting.append(req)
        self._wake.set()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            await self.abort(request.request_id)
            raise

    async def abort(self, request_id: str) -> bool:
        req = self._by_id.get(request_id)
        if req is None or req.future.done():
            return False
        if req in self._waiting:  # never admitted: answer now
            self._waiting.remove(req)
            for i in range(len(req.results)):
                req.results[i] = self._result(req, [], [], "abort", None)
            self._resolve(req)
        else:
            self._aborts.add(request_id)
            self._wake.set()
        return True

    async def update_weights(self, path: str, version: int, *, keep_running: bool = False) -> None:
        """Load weights from an HF safetensors directory and stamp later tokens with ``version``.

        The checkpoint is validated first (:meth:`validate_weights`), on a worker thread while the engine keeps
        serving: a refused one raises :class:`~rollout.engines.checkpoint.CheckpointError` naming the problem
        and the tensor, and nothing waits, drains or changes. Then the model is swapped between two steps:

        * ``keep_running=False`` (default): once the running requests have finished (new requests wait), so
          every result comes from exactly one weight version.
        * ``keep_running=True``: at the next step boundary, without waiting. The running sequences go on under
          the new weights on their existing KV, computed under the old weights: what "keep" means in prime-rl and
          SkyRL (vLLM's ``pause_generation(mode="keep")``). Each token is stamped with the version that sampled
          it; a result spanning versions carries ``token_versions`` (its ``weight_version`` is the lowest). The
          tokens after the swap are sampled from new weights attending to old-weight KV, so no single version's
          forward pass reproduces their logprobs. Requests admitted after the swap run wholly on the new weights.
          A sequence that was in the batch at the swap never stores its (mixed) KV for its session's next turn.

        Session KV computed with the old weights is dropped. A load that still fails raises EngineError; the old
        weights and version stay, and the running requests go on under them.
        """
        try:
            await asyncio.to_thread(self._validate, str(path))
        except CheckpointError as exc:
            raise exc.refused_by("update_weights") from None
        # prime-rl's step_0 (the starting model, republished): only the version moves, at the same step boundary a
        # load would take (so a drained update still gives each result one version); nothing is read again
        same = await asyncio.to_thread(self._same_as_served, str(path))
        self._ensure_scheduler()
        fut = asyncio.get_running_loop().create_future()
        self._updates.append((str(path), version, keep_running, fut, same))
        self._wake.set()
        await fut

    async def validate_weights(self, path: str) -> dict:
        """Check that ``path`` is a checkpoint this model can load, without loading it (rollout/engines/checkpoint.py:
        layout, config.json, every tensor's name, shape and dtype against this model, finite values). Runs on a
        worker thread, so requests go on meanwhile. Returns the report (files, tensors, bytes, seconds); raises
        CheckpointError. An unchanged checkpoint that passed is not read again by the next update_weights."""
        return (await asyncio.to_thread(self._validate, str(path))).as_dict()

    # -- weights over the wire (vLLM's weight-transfer calls; rollout/engines/weight_transfer.py) ----------------

    def _receiver(self) -> GlooReceiver:
        if self._wire is None:
            raise Unsupported("weight transfer is off on this engine: start it with engine.weight_transfer: gloo")
        return self._wire

    async def init_weight_transfer(self, init_info: dict) -> None:
        """Join the trainer's gloo group as rank ``init_info["rank_offset"]`` (blocks until the trainer is there,
        at most the timeout); the engine serves meanwhile."""
        receiver = self._receiver()
        await in_background(receiver.join, parse_init_info(init_info))

    async def start_weight_update(self) -> None:
        self._receiver().start()

    async def receive_weights(self, update_info: dict) -> dict:
        """Receive the announced tensors into the staging copy, on a thread of its own: the engine keeps serving the
        weights it has while they arrive."""
        receiver = self._receiver()
        return await in_background(receiver.receive, parse_update_info(update_info))

    async def check_weight_update(self) -> None:
        """What arrived is finite (else the update is dropped, naming the tensor); then each tensor is made the
        served parameter's dtype and device here, off the step thread, so the swap only points at it."""
        receiver = self._receiver()
        await in_background(self._prepare_staged, receiver)

    def _prepare_staged(self, receiver: GlooReceiver) -> None:
        receiver.check()
        state = self.model.state_dict()
        for name, tensor in receiver.staged.items():
            target = state[name]
            receiver.staged[name] = tensor.to(dtype=target.dtype, device=target.device).contiguous()

    async def finish_weight_update(self, version: int) -> None:
        """Swap the staged tensors in at the next step boundary, running requests kept (each token stamped with the
        version that sampled it, as ``update_weights(keep_running=True)``); later tokens carry ``version``."""
        staged = self._receiver().take()
        self._ensure_scheduler()
        fut = asyncio.get_running_loop().create_future()
        self._updates.append((staged, version, True, fut, False))
        self._wake.set()
        await fut

    async def set_weight_version(self, version: int) -> None:
        """Stamp later tokens with ``version``, weights unchanged (vLLM's /update_weight_version), at the next step
        boundary as an update would be."""
        self._ensure_scheduler()
        fut = asyncio.get_running_loop().create_future()
        self._updates.append((None, version, True, fut, True))
        self._wake.set()
        await fut

    async def abort_weight_update(self) -> None:
        if self._wire is not None:
            self._wire.abort()

    async def shutdown_weight_transfer(self) -> None:
        if self._wire is not None:
            await asyncio.to_thread(self._wire.shutdown)

    async def weight_checksums(self, dp_index: int = 0) -> dict[str, str]:
        """vLLM's weight checksums of the parameters as served (``/weight_checker``)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, tensor_checksums, self.model, dp_index)

    async def reset_weights(self) -> None:
        """Zero every parameter, as vLLM's ``/weight_checker {"action": "reset"}`` does (to prove an update covers
        them all); between two steps."""
        def zero() -> None:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.zero_()
            self.sessions.clear()

        await self.wait_idle()
        await asyncio.get_running_loop().run_in_executor(self._executor, zero)
        self._wire_weights = True  # no file holds zeros either

    # -- LoRA adapters --------------------------------------------------------------------------------------

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> int:
        """Load the peft adapter in ``path`` as ``name`` (rollout/engines/lora.py); returns its version. It is read
        and validated on a worker thread while the engine serves (AdapterError names the problem; nothing
        changes), then installed between two steps. A name already loaded is swapped in place (prime-rl reloads
        one name each step): its version becomes ``version``, else the old one + 1; its running requests go on
        under the new adapter, their tokens stamped with the version that sampled each. A new name takes a free
        slot (at most ``max_loras``) at ``version``, else 0."""
        adapter = await asyncio.to_thread(read_adapter, name, path, self.model, self.max_lora_rank)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._install_adapter, adapter, version)

    async def unload_lora_adapter(self, name: str) -> None:
        """Forget ``name``: later requests naming it are refused; requests already given it finish with it."""
        if name not in self._loras:
            raise EngineError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        del self._loras[name]

    def lora_adapters(self) -> dict[str, dict]:
        """The loaded adapters: name -> {version, path, rank, base_model}."""
        return {name: {"version": v, "path": a.path, "rank": a.rank, "base_model": a.base_model}
                for name, (_, v, a) in self._loras.items()}

    def _install_adapter(self, adapter: LoraAdapter, version: int | None) -> int:
        """On the engine's worker thread, between two steps."""
        held = self._loras.get(adapter.name)
        if held is not None:
            slot = held[0]
            version = held[1] + 1 if version is None else version
            for seq in self._running:  # their KV so far is the old adapter's: it never goes to a session
                if seq.req.adapter_slot == slot:
                    seq.kept_across_update = True
        else:
            busy = {s for s, _, _ in self._loras.values()}
            busy |= {s.req.adapter_slot for s in self._running} | {r.adapter_slot for r in self._waiting}
            slot = next((i for i in range(self.max_loras) if i not in busy), None)
            if slot is None:
                raise AdapterError(f"adapter {adapter.name!r}: {self.max_loras} adapters (max_loras) are in use; "
                                   "unload one first")
            version = 0 if version is None else version
        hook_targets(self.model, adapter, self._lora_slots, self._hooked)
        self._lora_slots.adapters[slot] = adapter
        self._slot_version[slot] = version
        self._loras[adapter.name] = (slot, version, adapter)
        return version

    async def wait_idle(self) -> None:
        """Return once nothing runs or waits (results are delivered one step before a finished sequence's
        KV reaches the session store; this waits for that too)."""
        while self._running or self._waiting or self._aborts or self._updates:
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Stop the scheduler; requests still pending get finish_reason "abort"."""
        for req in list(self._by_id.values()):
            await self.abort(req.request.request_id)
        if self._scheduler is not None:
            await self.wait_idle()
            self._scheduler.cancel()
            self._scheduler = None
        self._executor.shutdown(wait=True)

    # -- admin: prefix cache, session KV, sleep / wake_up (the server's admin routes) ---------------------
    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the session KV kept between turns. A finished request's KV reaches the store one step after its
        result, so those steps run first. False, as vLLM answers while running requests hold blocks, when a
        running request of a session will still store its KV when it ends (its rows are its own, not a cache;
        ``reset_running_requests`` cannot take them)."""
        while any(s.finalizing for s in self._running):
            await asyncio.sleep(0.005)
        self.sessions.clear()
        return not any(s.req.request.session_id for s in self._running)

    async def drop_session(self, session_id: str) -> None:
        """Forget one session's KV now (its conversation ended) instead of waiting for the LRU to evict it. Its
        last request's KV reaches the store one step after the result (the row is finalizing): wait for that."""
        while any(s.finalizing and s.req.request.session_id == session_id for s in self._running):
            await asyncio.sleep(0.005)
        self.sessions.discard(session_id)

    @property
    def sleep_level(self) -> int:
        """0 while awake; the level of the last :meth:`sleep` otherwise."""
        return getattr(self, "_sleep_level", 0)

    async def sleep(self, level: int = 1) -> None:
        """Free the weights and every KV buffer once nothing runs, as vLLM's sleep mode does on a GPU. Level 2
        drops the weights; level 1 moves them to host memory on a GPU, and on a CPU (already host memory)
        drops them too, since a copy would free nothing. The caller stops sending requests while asleep (the
        server answers them 503); :meth:`wake_up` reloads the weights last loaded (the model, or the
        checkpoint of the last ``update_weights``)."""
        if level not in (1, 2):
            raise EngineError(f"sleep level must be 1 or 2, got {level}", "level")
        if self.sleep_level:
            return
        if self._wire_weights and (level == 2 or self.device.type == "cpu"):
            raise Unsupported(f"sleep level {level}: the served weights came over the wire and no file holds them, so "
                              "waking could not restore them; send a checkpoint (/update_weights weight_dir) first")
        await self.wait_idle()
        self._sleep_level = level
        await asyncio.get_running_loop().run_in_executor(self._executor, self._free_memory, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring the weights back (all of them, whatever ``tags`` says: the KV buffers are allocated on demand)."""
        if not self.sleep_level:
            return
        path = getattr(self, "_weights_path", self.model_name)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._restore_weights, path)
        self._sleep_level = 0

    def _free_memory(self, level: int) -> None:
        import gc

        self.sessions.clear()
        self.kv.release()
        offload = level == 1 and self.device.type != "cpu"
        # "meta" keeps the module (and its config, which info() reads) but no storage at all
        self.model.to("cpu" if offload else "meta")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _restore_weights(self, path: str) -> None:
        if next(self.model.parameters()).device.type == "meta":
            self._load_weights(path)
        else:  # offloaded to host memory (level 1 on a GPU)
            self.model.to(self.device)

    # -- scheduler (event loop side) ---------------------------------------------------------------------
    def _ensure_scheduler(self) -> None:
        """Start the scheduler task on the running loop (the engine is bound to the loop that uses it)."""
        loop = asyncio.get_running_loop()
        if self._scheduler is None or self._scheduler.done() or self._scheduler.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._scheduler = loop.create_task(self._schedule(), name="tito-embedded")

    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._running or self._waiting or self._aborts or self._updates):
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._updates and (self._updates[0][2] or not self._running):  # keep_running: no drain
                path, version, _, fut, same = self._updates.pop(0)
                try:
                    if same:  # the served weights already (or a relabel: no path)
                        if path is not None:
                            self._weights_path = path
                            self.stats["reloads_skipped"] += 1
                    else:
                        swap_at = time.perf_counter()
                        await loop.run_in_executor(self._executor, self._swap_weights, path)
                        self.stats["last_swap_s"] = time.perf_counter() - swap_at  # no step ran meanwhile
                    self.weight_version = version
                    if not fut.done():
                        fut.set_result(None)
                except Exception as exc:  # the old weights stay; the caller learns why
                    what = "the received weights" if isinstance(path, dict) else repr(path)
                    if not fut.done():
                        fut.set_exception(EngineError(f"update_weights({what}) failed: {exc}"))
                continue
            # requests that arrived during the last step join now, unless a weight update is draining
            admit: list[_Req] = []
            if not self._updates:
                admit, budget, rows = [], self.prefill_tokens_per_step, len(self._running)
                for req in list(self._waiting):
                    n = req.request.sampling.n
                    if rows + n > self.max_batch or (admit and budget < req.prompt_len):
                        break
                    if self._session_busy(req.request.session_id):
                        continue  # its previous turn's KV lands at the end of this step
                    admit.append(req)
                    self._waiting.remove(req)
                    budget -= req.prompt_len
                    rows += n
            aborts, self._aborts = self._aborts, set()
            try:
                finished = await loop.run_in_executor(self._executor, self._step, admit, aborts)
            except Exception as exc:  # a failure of the batched forward: fail what was in it, keep serving
                finished = self._fail_all(f"{type(exc).__name__}: {exc}", admit)
            self._tell_listeners()
            for req in finished:
                self._resolve(req)

    def _tell_listeners(self) -> None:
        """On the loop, after a step: each streamed sequence still in the batch gets its new tokens (a
        finished one's last tokens come with its output)."""
        for seq in self._running:
            listener = seq.req.listener
            if listener is not None:
                done = len(seq.tokens) - seq.req.prompt_len
                if done > seq.streamed:
                    listener(seq.index, seq.tokens[seq.req.prompt_len + seq.streamed:], seq.logprobs[seq.streamed:done],
                             seq.tops[seq.streamed:done] if seq.req.request.sampling.top_logprobs else None)
                    seq.streamed = done

    def _session_busy(self, session_id: str | None) -> bool:
        return session_id is not None and any(
            s.finalizing and s.req.request.session_id == session_id for s in self._running
        )

    def _resolve(self, req: _Req) -> None:
        self._by_id.pop(req.request.request_id, None)
        if not req.future.done():
            req.future.set_result(GenerateOutput(req.request.request_id, req.prompt_len, list(req.results),
                                                 req.prompt_logprobs))

    def _fail_all(self, message: str, admitted: list[_Req]) -> list[_Req]:
        reqs = {id(s.req): s.req for s in self._running}
        reqs.update({id(r): r for r in admitted})
        self._running.clear()
        self.kv.release()
        out = []
        for req in reqs.values():
            for i, res in enumerate(req.results):
                if res is None:
                    req.results[i] = self._result(req, [], [], "error", None, error=message)
            out.append(req)
        return out

    # -- worker thread -----------------------------------------------------------------------------------
    def _load_weights(self, path: str) -> None:
        from ..models import load_causal_lm

        # built on the served model's own config: exactly the model the checkpoint was validated against
        new = load_causal_lm(path, device=str(self.device), like=self.model)
        new.config._attn_implementation = register_attention()
        self.model = new
        self._weights_path = path  # what wake_up reloads after a sleep
        self._wire_weights = False
        self.sessions.clear()
        self._hooked = set()  # the loaded LoRA adapters apply to the new model as they did to the old one
        for adapter in self._lora_slots.adapters.values():
            hook_targets(self.model, adapter, self._lora_slots, self._hooked)

    def _copy_weights(self, staged: dict[str, torch.Tensor]) -> None:
        """Serve the staged tensors: each parameter now points at its staged tensor (prepared in its dtype and
        device by check_weight_update), so the swap costs no copy; a tied name reaches the shared parameter."""
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in staged.items():
                target = state[name]
                if isinstance(target, torch.nn.Parameter) and target.shape == tensor.shape \
                        and target.dtype == tensor.dtype and target.device == tensor.device:
                    target.data = tensor
                else:
                    target.copy_(tensor)
        self.sessions.clear()
        self._wire_weights = True

    def _same_as_served(self, path: str) -> bool:
        """Whether every tensor of the (validated) checkpoint equals the served one, in the served dtype: prime-rl's
        ``step_0`` is the model the engine started with. Stops at the first tensor that differs (one read)."""
        from safetensors import safe_open

        from .checkpoint import _weight_files

        state = self.model.state_dict()
        if any(t.device.type == "meta" for t in state.values()):  # asleep: nothing to compare with
            return False
        files, _ = _weight_files(Path(path), path)
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for key in handle.keys():
                    served = state.get(key)
                    if served is None or not torch.equal(handle.get_tensor(key).to(served.dtype), served.cpu()):
                        return False
        return True

    def _swap_weights(self, source: str | dict[str, torch.Tensor]) -> None:
        """Load ``source`` between two steps: a checkpoint directory, or tensors received over the wire (copied into
        the served parameters, converted to their dtype). Sequences still in the batch (a keep_running update) go
        on under the new weights: their KV now mixes versions, so none of it may reach the session store. A
        finalizing one (its result is out) would only write its last token's KV, under the new weights: it leaves
        the batch now."""
        if isinstance(source, dict):
            self._copy_weights(source)
        else:
            self._load_weights(source)
        for seq in self._running:
            seq.kept_across_update = True
        self._drop_rows(lambda s: s.finalizing)
        if not self._running:
            self.kv.release()

    @torch.inference_mode()
    def _step(self, admit: list[_Req], aborts: set[str]) -> list[_Req]:
        """One scheduler step (see the module docstring); returns the requests whose results are complete."""
        self.stats["steps"] += 1
        touched = {id(s.req): s.req for s in self._running}
        for seq in self._running:
            if seq.req.request.request_id in aborts and not seq.finalizing:
                self._finish(seq, "abort", None)
        n_decode = len(self._running)
        joining: list[tuple[_Req, int, int]] = []  # (request, first row, reused prompt tokens)
        for req in admit:
            touched[id(req)] = req
            try:
                joining.append(self._admit(req))
            except Exception as exc:  # this request alone fails; the batch is untouched
                self._drop_rows(lambda s, req=req: s.req is req)
                for i, res in enumerate(req.results):
                    if res is None:
                        req.results[i] = self._result(req, [], [], "error", None, error=f"{type(exc).__name__}: {exc}")
        if self._running:
            self._forward(n_decode, joining)
        self._retire()
        if not self._running:
            self.kv.release()
        return [r for r in touched.values() if not r.future.done() and all(x is not None for x in r.results)]

    def _admit(self, req: _Req) -> tuple[_Req, int, int]:
        """Give ``req`` its rows (n of them, after the running ones) and, when its prompt extends its
        session's cached tokens, copy that KV into the first row. Returns (req, row, reused tokens); the
        prompt's remaining tokens are prefilled in this step's packed forward."""
        r = req.request
        prompt = r.prompt_ids
        req.admitted = time.perf_counter()
        if req.adapter_slot >= 0:
            req.adapter_key = f"{r.lora}@{self._slot_version[req.adapter_slot]}"
        cached = None
        # a prompt to score is prefilled whole: cached KV has no logits to score its tokens with (vLLM, too,
        # skips its prefix cache for such requests); the session's entry stays for its next turn
        if r.session_id is not None and r.sampling.prompt_logprobs is None:
            entry = self.sessions.take(r.session_id)
            # the prompt must extend the cached tokens; at least one token is prefilled to get logits
            held = len(entry.token_ids) if entry is not None else 0
            if (entry is not None and held <= len(prompt) and prompt[:held] == entry.token_ids
                    and entry.adapter == req.adapter_key):  # KV of another adapter (or version) is not this one's
                cached = entry
        reuse = 0 if cached is None else min(len(cached.token_ids), len(prompt) - 1)
        row = len(self._running)
        self.kv.ensure(row + r.sampling.n, len(prompt))
        self._running.extend(_Seq(req, i, list(prompt), self._generator(r, i)) for i in range(r.sampling.n))
        if cached is not None:
            self.kv.write_row(row, cached.kv[:, :, :, :reuse])
        req.cached = reuse
        return req, row, reuse

    def _forward(self, n_decode: int, joining: list[tuple[_Req, int, int]]) -> None:
        """One packed forward: the next token of each of the first ``n_decode`` rows (a finalizing row
        feeds its last sampled token, to complete its KV), then the uncached prompt tokens of each joining
        request. Logits are computed only where a token is sampled next, and over the whole prompt of a
        request that asked for prompt_logprobs."""
        decoding = self._running[:n_decode]
        ids = [s.tokens[s.fed] for s in decoding]
        segments = []
        for req, row, reuse in joining:
            ids += req.request.prompt_ids[reuse:]
            segments.append((row, reuse, req.prompt_len - reuse))
        plan = self.kv.plan_step([s.fed for s in decoding], segments)
        # logits where a token is sampled next; a prompt to score keeps every one of its positions
        keep, last = list(range(n_decode)), []
        for (req, _, _), (_, _, length, start) in zip(joining, plan.segments):
            if req.request.sampling.prompt_logprobs is not None:
                keep += range(start, start + length)
            else:
                keep.append(start + length - 1)
            last.append(len(keep) - 1)
        slots = [s.req.adapter_slot for s in decoding]
        for req, _, reuse in joining:
            slots += [req.adapter_slot] * (req.prompt_len - reuse)
        self._lora_slots.token_slot = torch.tensor(slots, device=self.device) if max(slots) >= 0 else None
        t0 = time.perf_counter()
        try:
            out = self.model(input_ids=torch.tensor([ids], device=self.device), position_ids=plan.positions[None],
                             **{_cache_arg(self.model): self.kv}, use_cache=True,
                             logits_to_keep=torch.tensor(keep, device=self.device))
        finally:
            self._lora_slots.token_slot = None
        logits = out.logits[0].float()
        t1 = time.perf_counter()
        for s in decoding:
            s.fed += 1
        live = [i for i, s in enumerate(decoding) if not s.finalizing]
        if live:
            self._accept([decoding[i] for i in live], logits[live])
        for j, (req, row, reuse) in enumerate(joining):
            n = req.request.sampling.n
            seqs = self._running[row : row + n]
            for seq in seqs:
                seq.fed = req.prompt_len
            for i in range(1, n):  # the n completions share the prompt's KV
                self.kv.move_row(row, row + i, req.prompt_len)
            req.prefill_s, req.prefill_end = t1 - t0, t1
            self.stats["prefill_tokens"] += req.prompt_len - reuse
            self.stats["cached_tokens"] += reuse
            if req.request.session_id is not None and n > 1:  # every completion extends the prompt: keep it
                self.sessions.put(req.request.session_id,
                                  SessionKV(list(req.request.prompt_ids), self.kv.read_row(row, req.prompt_len),
                                            req.adapter_key))
            if req.request.sampling.prompt_logprobs is not None:  # its whole prompt was prefilled (reuse 0)
                req.prompt_logprobs = prompt_scores(logits[last[j] - req.prompt_len + 1: last[j] + 1],
                                                    req.request.prompt_ids, req.request.sampling.prompt_logprobs)
            self._accept(seqs, logits[last[j]].expand(n, -1))

    def _accept(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        """Sample one token per sequence and finish those that hit a stop id or their token budget."""
        rows = []
        for s in seqs:
            sp = s.req.request.sampling
            masked = ()
            if len(s.tokens) - s.req.prompt_len < sp.min_tokens:  # vLLM's min_tokens: no stop id or EOS yet
                masked = tuple(dict.fromkeys([*self._eos, *(() if sp.ignore_eos else sp.stop_token_ids)]))
            rows.append(SamplerRow(sp.temperature, sp.top_p, sp.top_k, s.generator, sp.top_logprobs, masked))
        tokens, lps, tops = sample(logits, rows)
        self.stats["decode_tokens"] += len(seqs)
        for seq, tok, lp, top in zip(seqs, tokens, lps, tops):
            sp = seq.req.request.sampling
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            slot = seq.req.adapter_slot
            seq.versions.append(self._slot_version[slot] if slot >= 0 else self.weight_version)
            if top is not None:
                seq.tops.append(top)
            if not sp.ignore_eos and tok in sp.stop_token_ids:
                self._finish(seq, "stop", tok)
            elif len(seq.tokens) - seq.req.prompt_len >= sp.max_tokens:
                self._finish(seq, "length", None)

    def _finish(self, seq: _Seq, reason: str, stop_id: int | None) -> None:
        req = seq.req
        req.results[seq.index] = self._result(req, seq.tokens[req.prompt_len :], seq.logprobs, reason, stop_id,
                                              tops=seq.tops, versions=seq.versions)
        seq.finalizing = True

    def _retire(self) -> None:
        """Rows leave the batch: a finalizing sequence whose last token is now in the KV goes to the
        session store (single-completion requests with a session id, whose KV is of one weight version), the rest
        are dropped."""
        for row, seq in enumerate(self._running):
            r = seq.req.request
            if (seq.finalizing and seq.fed == len(seq.tokens) and r.session_id and r.sampling.n == 1
                    and not seq.kept_across_update):
                self.sessions.put(r.session_id, SessionKV(list(seq.tokens), self.kv.read_row(row, seq.fed),
                                                                seq.req.adapter_key))
        self._drop_rows(lambda s: s.finalizing and (s.fed == len(s.tokens) or not self._keeps_session(s)))

    def _keeps_session(self, seq: _Seq) -> bool:
        r = seq.req.request
        return (r.session_id is not None and r.sampling.n == 1 and not seq.kept_across_update
                and seq.req.results[seq.index].finish_reason != "error")

    def _drop_rows(self, pred) -> None:
        """Remove matching rows, moving the last row into each hole so live rows stay ``[0, n)``."""
        i = 0
        while i < len(self._running):
            if pred(self._running[i]):
                last = len(self._running) - 1
                if i != last:
                    self.kv.move_row(last, i, self._running[last].fed)
                    self._running[i] = self._running[last]
                self._running.pop()
            else:
                i += 1

    def _generator(self, r: GenerateRequest, index: int) -> torch.Generator | None:
        if r.sampling.temperature == 0:
            return None
        g = torch.Generator(device=self.device)
        # completion i of a seeded request uses seed + i: reproducible, and the n completions differ
        g.manual_seed((r.sampling.seed + index) if r.sampling.seed is not None else secrets.randbits(63))
        return g

    def _result(self, req: _Req, completion: list[int], logprobs: list[float], reason: str,
                stop_id: int | None, error: str | None = None, tops: list[TokenLogprobs] = (),
                versions: list[int] = ()) -> GenerateResult:
        now = time.perf_counter()
        versions = list(versions)  # one per completion token; several only across a keep_running update
        admitted = req.admitted or now
        return GenerateResult(
            completion_ids=list(completion),
            logprobs=list(logprobs) if req.request.sampling.logprobs else None,
            finish_reason=reason,
            stop_token_id=stop_id,
            cached_prompt_tokens=req.cached,
            weight_version=min(versions) if versions else (
                self._slot_version.get(req.adapter_slot, 0) if req.adapter_slot >= 0 else self.weight_version),
            timings=Timings(queue_s=admitted - req.arrival, prefill_s=req.prefill_s,
                            decode_s=max(0.0, now - req.prefill_end) if req.prefill_end else 0.0),
            error=error,
            top_logprobs=list(tops) if req.request.sampling.top_logprobs else None,
            token_versions=versions if len(set(versions)) > 1 else None,
        )
