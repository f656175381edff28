"""The replay engine: serves recorded completions for exact prompt ids.

Use it in tests (a backend whose outputs are known in advance) and to re-build training samples from recorded
rollouts without a model. A record is a prompt (exact token ids), the completion ids the sampler produced, their
logprobs and the finish reason; records load from JSONL (one :class:`ReplayRecord` object per line) or from memory.

Contract:

* Lookup is by the exact prompt ids. Several records for one prompt are served in order (the i-th request for
  that prompt gets record ``i mod count``; with ``n > 1`` the n completions take consecutive records), so replaying a
  group of ``n`` samples of one prompt gives back the group. ``order="first"`` always starts at the first record.
* A prompt without a record raises :class:`EngineError` naming the prompt length and its :func:`prompt_hash`
  (strict mode, the default). With ``synthetic=True`` such prompts get a deterministic synthetic completion
  instead (see :func:`synthetic_token`): greedy requests depend only on the prompt ids; sampled requests
  (temperature > 0) on the prompt ids and the seed (completion ``j`` of ``n`` uses ``seed + j``), or on a random
  draw when ``seed`` is None. Synthetic completions never end on their own: they run to ``max_tokens`` unless a
  stop id is sampled. This is what lets the generic conformance suite run against the replay engine.
* ``max_tokens`` is honoured: a longer recorded completion is truncated with finish "length". ``stop_token_ids``
  cut a completion at the first stop id (included, finish "stop"), unless ``ignore_eos``. Otherwise the recorded
  finish reason and stop id are returned unchanged.
* Tokens are emitted one at a time, sleeping ``token_delay_s`` per token (0 by default: no pacing, but the loop
  is still yielded to between tokens), so :meth:`ReplayEngine.abort` interrupts a running request (finish "abort"
  with the tokens emitted so far); set a delay to make a request last long enough to abort reliably.
* ``min_tokens``: a synthetic completion draws again (the next hash) where it would sample a stop id or EOS too
  early, as a masked sampler would; a recorded completion that stops before ``min_tokens`` was not sampled under
  that setting, so it is refused with :class:`EngineError`. There is no model to score alternatives or prompts:
  :meth:`ReplayEngine.info` reports ``max_logprobs=0`` and ``scores_prompts=False``, so ``top_logprobs`` and
  ``prompt_logprobs`` are refused by ``validate_request`` with a message naming them.
* Results carry the engine's ``weight_version`` when the request arrived (set by :meth:`update_weights`, which
  accepts any path, reads nothing, and accepts ``keep_running``) and ``cached_prompt_tokens=0``.
  :meth:`ReplayEngine.validate_weights` checks what needs no model (layout, headers, finite values).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import msgspec

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
from rollout.engines.streaming import Listener, StreamDelta, stream_with_listener


class ReplayRecord(msgspec.Struct):
    """One recorded completion of one prompt. Unknown JSON fields are ignored (richer rollout logs load too)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: FinishReason = "stop"
    stop_token_id: int | None = None


def prompt_hash(prompt_ids: Iterable[int]) -> str:
    """A short stable hash of prompt ids (sha256 of their little-endian int64 bytes, first 16 hex digits)."""
    h = hashlib.sha256()
    for t in prompt_ids:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.hexdigest()[:16]


def load_records(path: str | os.PathLike[str]) -> list[ReplayRecord]:
    """Records from a JSONL file; a bad line raises ValueError naming the file and line number."""
    records = []
    decoder = msgspec.json.Decoder(ReplayRecord)
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(decoder.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{lineno}: bad replay record: {exc}") from None
    return records


def dump_records(records: Iterable[ReplayRecord], path: str | os.PathLike[str]) -> None:
    """Write records as JSONL (atomically: a temporary file renamed into place)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    encoder = msgspec.json.Encoder()
    with open(tmp, "wb") as f:
        for r in records:
            f.write(encoder.encode(r) + b"\n")
    os.replace(tmp, path)


def records_from_output(request: GenerateRequest, output: GenerateOutput) -> list[ReplayRecord]:
    """The records that make a replay engine reproduce ``output`` for ``request`` (one per result)."""
    return [
        ReplayRecord(
            prompt_ids=list(request.prompt_ids),
            completion_ids=list(r.completion_ids),
            logprobs=None if r.logprobs is None else list(r.logprobs),
            finish_reason=r.finish_reason,
            stop_token_id=r.stop_token_id,
        )
        for r in output.results
    ]


def synthetic_token(prompt_key: bytes, stream: int, position: int, vocab_size: int) -> tuple[int, float]:
    """The synthetic token and logprob at ``position`` of completion stream ``stream`` for a prompt: a blake2b
    hash of (prompt, stream, position) reduced into the vocabulary; the logprob is in [-5, -0.01]."""
    d = hashlib.blake2b(
        prompt_key + stream.to_bytes(8, "little", signed=True) + position.to_bytes(8, "little"), digest_size=16
    ).digest()
    token = int.from_bytes(d[:8], "little") % vocab_size
    logprob = -0.01 - (int.from_bytes(d[8:12], "little") % 4990) / 1000.0
    return token, float(logprob)


class _Running:
    __slots__ = ("aborted", "listener", "index")

    def __init__(self, listener: Listener | None = None) -> None:
        self.aborted = False
        self.listener = listener  # generate_stream's: told each token as it is produced
        self.index = 0  # the completion being produced


class ReplayEngine:
    """An :class:`~rollout.engines.protocol.EngineBackend` that replays recorded completions (see the module doc)."""

    def __init__(
        self,
        records: Iterable[ReplayRecord] = (),
        *,
        vocab_size: int = 151_936,
        max_model_len: int = 32_768,
        eos_token_ids: Iterable[int] = (),
        model: str = "replay",
        synthetic: bool = False,
        order: str = "cycle",
        token_delay_s: float = 0.0,
        weight_version: int = 0,
    ) -> None:
        if order not in ("cycle", "first"):
            raise ValueError(f"order must be 'cycle' or 'first', got {order!r}")
        self._records: dict[tuple[int, ...], list[ReplayRecord]] = {}
        self._cursor: dict[tuple[int, ...], int] = {}
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self._eos = list(eos_token_ids)
        self._model = model
        self.synthetic = synthetic
        self.order = order
        self.token_delay_s = token_delay_s
        self._version = weight_version
        self._running: dict[str, _Running] = {}
        self._paced = 0  # tokens emitted: the healer's sign of progress
        self.add(records)

    def progress(self) -> int:
        """Tokens emitted so far (grows while requests make headway)."""
        return self._paced

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike[str], **kwargs: object) -> ReplayEngine:
        """An engine serving the records of a JSONL file (see :func:`load_records`); kwargs as the constructor."""
        return cls(load_records(path), **kwargs)  # type: ignore[arg-type]

    def add(self, records: Iterable[ReplayRecord]) -> None:
        """Add records (after those already held for the same prompt). Dicts are converted to ReplayRecord."""
        for r in records:
            if not isinstance(r, ReplayRecord):
                r = msgspec.convert(r, ReplayRecord)
            if r.logprobs is not None and len(r.logprobs) != len(r.completion_ids):
                raise ValueError(
                    f"record for prompt {prompt_hash(r.prompt_ids)}: {len(r.logprobs)} logprobs for "
                    f"{len(r.completion_ids)} completion ids"
                )
            self._records.setdefault(tuple(r.prompt_ids), []).append(r)

    def __len__(self) -> int:
        return sum(len(v) for v in self._records.values())

    def info(self) -> EngineInfo:
        return EngineInfo(
            backend="replay",
            model=self._model,
            vocab_size=self._vocab_size,
            max_model_len=self._max_model_len,
            weight_version=self._version,
            eos_token_ids=list(self._eos),
            max_logprobs=0,  # recorded logprobs only: no distribution to list alternatives from
            scores_prompts=False,
        )

    async def update_weights(self, path: str, version: int, *, keep_running: bool = False) -> None:
        """Accepts any path (nothing is read); requests submitted from now on carry ``version``. There are no
        weights, so nothing waits either way: ``keep_running`` is accepted, and a running request keeps the
        version it started under for all its tokens."""
        self._version = int(version)

    async def validate_weights(self, path: str) -> dict:
        """What can be checked without a model: ``path`` is a directory of safetensors files whose headers read,
        whose ``config.json`` (not required) is JSON, and whose floating tensors are all finite
        (:func:`~rollout.engines.checkpoint.validate_checkpoint` with ``expected=None``). Tensor names and shapes
        are not checked: there is no model to compare them with. So a replay fleet standing in for a real one
        (tests, ``tito serve`` with replay engines) refuses a broken checkpoint as a real one would, while
        :meth:`update_weights` itself still reads nothing. Returns the report; raises CheckpointError."""
        from rollout.engines.checkpoint import validate_checkpoint

        report = await asyncio.to_thread(validate_checkpoint, path, None, require_config=False)
        return report.as_dict()

    async def abort(self, request_id: str) -> bool:
        running = self._running.get(request_id)
        if running is None or running.aborted:
            return False
        running.aborted = True
        return True

    async def health(self) -> dict[str, object]:
        return {"ok": True, "running": len(self._running), "records": len(self)}

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Nothing is cached (cached_prompt_tokens is always 0): the cache is empty, as asked."""
        return True

    def _pick(self, request: GenerateRequest) -> list[ReplayRecord] | None:
        key = tuple(request.prompt_ids)
        recs = self._records.get(key)
        if not recs:
            return None
        start = self._cursor.get(key, 0) if self.order == "cycle" else 0
        n = request.sampling.n
        if self.order == "cycle":
            self._cursor[key] = (start + n) % len(recs)
        return [recs[(start + j) % len(recs)] for j in range(n)]

    def _synthetic_streams(self, request: GenerateRequest) -> list[tuple[bytes, int]]:
        s = request.sampling
        key = b"".join(int(t).to_bytes(8, "little", signed=True) for t in request.prompt_ids)
        if s.temperature == 0:
            return [(key, -1)] * s.n
        base = s.seed if s.seed is not None else random.getrandbits(62)
        # wrapped into int64 (the stream id is hashed as 8 signed bytes): a seed near 2**63 - 1 with n > 1
        return [(key, (base + j + 2**63) % 2**64 - 2**63) for j in range(s.n)]

    def generate_stream(self, request: GenerateRequest) -> AsyncIterator[StreamDelta | GenerateOutput]:
        """Token by token (see rollout/engines/streaming.py), then the output."""
        return stream_with_listener(lambda listener: self.generate(request, listener))

    async def generate(self, request: GenerateRequest, listener: Listener | None = None) -> GenerateOutput:
        validate_request(request, self.info())
        if request.request_id in self._running:
            raise EngineError(f"request {request.request_id}: a request with this id is already running")
        picked = self._pick(request)
        if picked is None and not self.synthetic:
            raise EngineError(
                f"request {request.request_id}: no recorded completion for a prompt of {len(request.prompt_ids)} "
                f"tokens (prompt hash {prompt_hash(request.prompt_ids)})"
            )
        running = self._running[request.request_id] = _Running(listener)
        version = self._version
        t0 = time.perf_counter()
        try:
            if picked is not None:
                results = []
                for running.index, rec in enumerate(picked):
                    results.append(await self._replay(request, rec, running))
            else:
                results = []
                for running.index, (key, stream) in enumerate(self._synthetic_streams(request)):
                    results.append(await self._synthesize(request, key, stream, running))
        finally:
            del self._running[request.request_id]
        elapsed = time.perf_counter() - t0
        for r in results:
            r.weight_version = version
            r.timings = Timings(decode_s=elapsed)
        return GenerateOutput(request_id=request.request_id, prompt_len=len(request.prompt_ids), results=results)

    async def _pace(self) -> None:
        # always yield to the loop, so concurrent requests interleave and abort() can land between tokens
        await asyncio.sleep(self.token_delay_s if self.token_delay_s > 0 else 0)
        self._paced += 1

    async def _replay(self, request: GenerateRequest, rec: ReplayRecord, running: _Running) -> GenerateResult:
        s = request.sampling
        stops = set() if s.ignore_eos else set(s.stop_token_ids)
        ids: list[int] = []
        lps: list[float] = []
        finish: FinishReason = rec.finish_reason
        stop_id = rec.stop_token_id
        for i, t in enumerate(rec.completion_ids):
            if i >= s.max_tokens:
                finish, stop_id = "length", None
                break
            await self._pace()
            if running.aborted:
                finish, stop_id = "abort", None
                break
            ids.append(t)
            lps.append(rec.logprobs[i] if rec.logprobs is not None else math.nan)
            if running.listener is not None:
                running.listener(running.index, [t], lps[-1:])
            if t in stops:
                if len(ids) <= s.min_tokens:  # a stop among the first min_tokens tokens: masked there
                    raise EngineError(f"request {request.request_id}: the recorded completion stops after "
                                      f"{len(ids) - 1} tokens, fewer than min_tokens={s.min_tokens}: it was not "
                                      "sampled with that setting", "min_tokens")
                finish, stop_id = "stop", t
                break
        if rec.logprobs is None or not s.logprobs:
            out_lps = None
        else:
            out_lps = lps
        return GenerateResult(completion_ids=ids, logprobs=out_lps, finish_reason=finish, stop_token_id=stop_id)

    async def _synthesize(self, request: GenerateRequest, key: bytes, stream: int, running: _Running) -> GenerateResult:
        s = request.sampling
        stops = set() if s.ignore_eos else set(s.stop_token_ids)
        held = set(self._eos) | stops  # what min_tokens keeps from being sampled early
        room = self._max_model_len - len(request.prompt_ids)
        ids: list[int] = []
        lps: list[float] = []
        finish: FinishReason = "length"
        stop_id = None
        for i in range(min(s.max_tokens, room)):
            await self._pace()
            if running.aborted:
                finish = "abort"
                break
            t, lp = synthetic_token(key, stream, i, self._vocab_size)
            redraw = 0
            while i < s.min_tokens and t in held:  # masked: the next hash of this position instead
                redraw += 1
                t, lp = synthetic_token(key + redraw.to_bytes(4, "little"), stream, i, self._vocab_size)
            ids.append(t)
            lps.append(lp)
            if running.listener is not None:
                running.listener(running.index, [t], [lp])
            if t in stops:
                finish, stop_id = "stop", t
                break
        return GenerateResult(
            completion_ids=ids, logprobs=lps if s.logprobs else None, finish_reason=finish, stop_token_id=stop_id
        )
