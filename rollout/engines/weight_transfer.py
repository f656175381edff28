"""Weights over the wire, engine side: vLLM's weight-transfer protocol on tito's engines.

A trainer that writes no checkpoints sends its tensors instead, in vLLM's order of calls (vLLM 0.32,
``vllm/entrypoints/rl/online/api_router.py``): ``init_weight_transfer_engine {init_info}`` once (the trainer and
every engine worker join one group), then per update ``start_weight_update``, one or more ``update_weights
{update_info}`` (the trainer broadcasts the announced tensors meanwhile), ``finish_weight_update
{weight_version}``. TRL's ``VLLMClient`` and SkyRL send exactly these.

``gloo`` is the backend here (CPU, tests); vLLM's ``nccl`` needs CUDA GPUs and vLLM's own engine. The gloo group is
the one vLLM's unpacked format implies: the trainer is rank 0 and hosts a ``torch.distributed.TCPStore`` on
``master_address:master_port``; engine worker ``i`` joins with ``ProcessGroupGloo(store, rank_offset + i,
world_size, timeout)`` on that store itself; each tensor of ``update_info {names, dtype_names, shapes}`` is one
``broadcast(tensor, 0)``, in that order. So a trainer needs only plain torch (rollout/engines/gloo_sender.py).

What the engine holds until ``finish`` is a staging copy: the weights it serves do not change while tensors arrive
(requests keep running on them), so a refused or broken update (a name the model lacks, NaN values, a trainer
that died mid-transfer) leaves the served weights and version as they were. ``finish`` checks what arrived and
hands it to the engine, which swaps it in between two steps.

:class:`GlooReceiver` is one engine's end (the embedded engine holds one); :class:`WireUpdates` drives N engines as
one vLLM server with N data-parallel ranks (tito serve's routes and the follow service use it).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal

import msgspec

from .checkpoint import TensorSpec, dtype_name, loadable_dtype
from .protocol import EngineError, Unsupported, root_cause

WeightTransfer = Literal["none", "gloo", "nccl"]
DEFAULT_TIMEOUT_S = 120.0
# the engine operations a handle forwards to its backend (rollout/handles.py, actors/engine.py)
WIRE_OPS = frozenset({"init_weight_transfer", "start_weight_update", "receive_weights", "check_weight_update",
                      "finish_weight_update", "abort_weight_update", "shutdown_weight_transfer", "weight_checksums",
                      "reset_weights", "set_weight_version"})


class TransferRefused(EngineError):
    """A call the engines refuse (HTTP 400): a malformed ``init_info`` / ``update_info``, a name the model lacks,
    a call out of order. Nothing served changed."""


class TransferConflict(EngineError):
    """A call that clashes with one in progress (HTTP 409): a second ``start_weight_update`` while one is active."""


class TransferFailed(RuntimeError):
    """The wire itself failed (HTTP 504 for a timeout, else 502): the trainer never connected, died mid-transfer
    or sent less than it announced. The update in progress is dropped; the served weights stay."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out

    def __reduce__(self):  # keep the fields through pickling (Ray)
        return (type(self), (str(self), self.timed_out))


class GlooInitInfo(msgspec.Struct, forbid_unknown_fields=True):
    """``init_info`` for gloo: vLLM's NCCL init info without the NCCL-only fields."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False  # vLLM's NCCL option; gloo sends each tensor as it is


class UpdateInfo(msgspec.Struct, forbid_unknown_fields=True):
    """``update_info``: the tensors the trainer is about to broadcast, in order (vLLM's unpacked format).
    ``packed`` is what TRL's older client adds; only False can be received here."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = False


def _convert(data: Any, type_: type, what: str) -> Any:
    if not isinstance(data, Mapping):
        raise TransferRefused(f"{what} must be a JSON object, got {type(data).__name__}", what)
    try:
        return msgspec.convert(dict(data), type=type_)
    except msgspec.ValidationError as exc:
        raise TransferRefused(f"invalid {what}: {exc}", what) from None


def parse_init_info(data: Any) -> GlooInitInfo:
    info = _convert(data, GlooInitInfo, "init_info")
    if info.packed:
        raise TransferRefused("init_info.packed: the gloo backend receives each tensor as it is (vLLM's unpacked "
                              "format); send packed: false", "init_info")
    if not 0 < info.master_port < 65536:
        raise TransferRefused(f"init_info.master_port must be in 1..65535, got {info.master_port}", "init_info")
    if info.rank_offset < 1 or info.world_size <= info.rank_offset:
        raise TransferRefused(f"init_info: rank_offset ({info.rank_offset}) must be >= 1 (the trainer is rank 0) "
                              f"and below world_size ({info.world_size})", "init_info")
    return info


def torch_dtype(name: str) -> Any:
    """The torch dtype vLLM's ``dtype_names`` name ("bfloat16", "float32"; "torch.float32" too); None if none."""
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def parse_update_info(data: Any) -> UpdateInfo:
    """``update_info`` checked for what makes the broadcast itself impossible to follow: lists of different
    lengths, a dtype torch does not know, a negative dimension."""
    info = _convert(data, UpdateInfo, "update_info")
    n = len(info.names)
    if len(info.dtype_names) != n or len(info.shapes) != n:
        raise TransferRefused(f"update_info: names ({n}), dtype_names ({len(info.dtype_names)}) and shapes "
                              f"({len(info.shapes)}) must have the same length", "update_info")
    if info.packed:
        raise TransferRefused("update_info.packed: the gloo backend receives each tensor as it is; send packed: "
                              "false", "update_info")
    for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes):
        if torch_dtype(dtype) is None:
            raise TransferRefused(f"update_info: {name} has dtype_name {dtype!r}, which is not a torch dtype "
                                  "(vLLM's names: bfloat16, float16, float32 ...)", "update_info")
        if any(d < 0 for d in shape):
            raise TransferRefused(f"update_info: {name} has shape {shape}, with a negative dimension", "update_info")
    return info


def metadata_problem(name: str, dtype: Any, shape: Sequence[int], expected: Mapping[str, TensorSpec]) -> str | None:
    """Why tensor ``name`` cannot be loaded into the model ``expected`` describes (checkpoint.py's rules), or None."""
    spec = expected.get(name)
    if spec is None:
        return f"{name} is not a tensor of the served model (a tensor of another architecture?)"
    if tuple(shape) != spec.shape:
        return f"{name} has shape {list(shape)}, the model's is {list(spec.shape)}"
    try:
        got = dtype_name(dtype)
    except ValueError:  # a torch dtype safetensors has no name for (complex, unsigned wide ints)
        got = str(dtype).removeprefix("torch.")
    if not loadable_dtype(got, spec.dtype):
        return f"{name} has dtype {got}, which cannot be loaded into the model's {spec.dtype}"
    return None


def nonfinite_problem(staged: Mapping[str, Any]) -> str | None:
    """The first staged tensor holding NaN or inf values, named, or None."""
    from .checkpoint import _nonfinite

    for name, tensor in staged.items():
        if tensor.is_floating_point():
            nan, inf = _nonfinite(tensor)
            if nan or inf:
                return f"{name} holds {nan} NaN and {inf} inf values (of {tensor.numel()}) (a diverged training step?)"
    return None


def tensor_checksums(model: Any, dp_index: int = 0) -> dict[str, str]:
    """vLLM's ``compute_weight_checksums`` for a one-worker engine that is data-parallel rank ``dp_index``: the
    sha256 of each parameter's bytes as the engine holds them, keyed ``dp<i>:pp0:pcp0:tp0:<name>``."""
    import torch

    prefix = f"dp{dp_index}:pp0:pcp0:tp0:"
    return {prefix + name: hashlib.sha256(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, p in model.named_parameters()}


class GlooReceiver:
    """One engine's end of the group: joins it, stages announced tensors, hands them over at finish.

    Every method blocks (call it on a thread); one update at a time. ``expected`` is what the served model loads
    (checkpoint.py's :func:`expected_from_model`), ``timeout_s`` bounds every wait on the trainer."""

    def __init__(self, expected: Mapping[str, TensorSpec], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.expected = expected
        self.timeout_s = timeout_s
        self._group = None
        self._store = None
        self.staged: dict[str, Any] | None = None  # None: no update active
        self._checked = False  # check() passed on what is staged (finish then takes it without a second scan)

    def join(self, info: GlooInitInfo) -> None:
        """Join the trainer's group as rank ``info.rank_offset`` (the caller set it for this engine). Raises
        TransferFailed when the trainer's store does not answer within the timeout."""
        import torch.distributed as dist

        self.shutdown()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        where = f"{info.master_address}:{info.master_port}"
        try:
            store = dist.TCPStore(info.master_address, info.master_port, info.world_size, False, timeout=timeout)
            group = dist.ProcessGroupGloo(store, info.rank_offset, info.world_size, timeout)
        except Exception as exc:  # noqa: BLE001 - torch raises several types for a missing or dead peer
            raise TransferFailed(f"init_weight_transfer_engine: could not join the trainer's gloo group at {where} as "
                                 f"rank {info.rank_offset} of {info.world_size} within {self.timeout_s:g} s "
                                 f"({type(exc).__name__}: {_first_line(exc)}); is the trainer hosting its TCPStore "
                                 "there?", _timed_out(exc)) from None
        self._store, self._group = store, group

    def start(self) -> None:
        if self._group is None:
            raise TransferRefused("start_weight_update before init_weight_transfer_engine: join the trainer's group "
                                  "first")
        if self.staged is not None:
            raise TransferConflict("start_weight_update while a weight update is already active: finish it (POST "
                                   "/finish_weight_update) first")
        self.staged, self._checked = {}, False

    def receive(self, info: UpdateInfo) -> dict[str, Any]:
        """Receive the tensors ``info`` announces into the staging copy. A tensor the model cannot take is still
        received (so the trainer's broadcast completes and the group stays in step), then the update is dropped
        and TransferRefused names it. Returns {tensors, bytes, seconds}."""
        import torch

        if self.staged is None:
            raise TransferRefused("update_weights before start_weight_update: POST /start_weight_update first")
        t0, size, problem = time.perf_counter(), 0, None
        for name, dtype_str, shape in zip(info.names, info.dtype_names, info.shapes):
            dtype = torch_dtype(dtype_str)
            tensor = torch.empty(shape, dtype=dtype)
            try:
                self._group.broadcast(tensor, 0).wait()
            except Exception as exc:  # noqa: BLE001 - the peer is gone, or too slow
                self.staged = None
                raise TransferFailed(f"update_weights: receiving {name} failed ({type(exc).__name__}: "
                                     f"{_first_line(exc)}); the trainer died or stopped sending? The update is dropped "
                                     "and the weights served before it stay", _timed_out(exc)) from None
            size += tensor.numel() * tensor.element_size()
            problem = problem or metadata_problem(name, dtype, shape, self.expected)
            if problem is None:
                self.staged[name] = tensor
                self._checked = False
        if problem is not None:
            self.staged = None
            raise TransferRefused(f"update_weights: {problem}; the update is dropped and the weights served before "
                                  "it stay (start again)", "update_info")
        return {"tensors": len(info.names), "bytes": size, "seconds": time.perf_counter() - t0}

    def check(self) -> None:
        """What finish checks before anything changes: an update is active and its values are finite."""
        if self.staged is None:
            raise TransferRefused("finish_weight_update without a matching start_weight_update")
        problem = nonfinite_problem(self.staged)
        if problem is not None:
            self.staged = None
            raise TransferRefused(f"finish_weight_update: {problem}; the update is dropped and the weights served "
                                  "before it stay", "update_info")
        self._checked = True

    def take(self) -> dict[str, Any]:
        """The checked staging copy (checked now unless :meth:`check` passed since the last tensor arrived); the
        update ends."""
        if not self._checked:
            self.check()
        staged, self.staged = self.staged, None
        return staged

    def abort(self) -> None:
        self.staged = None

    def shutdown(self) -> None:
        self.staged = None
        group, self._group, self._store = self._group, None, None
        if group is not None:
            shutdown = getattr(group, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:  # noqa: BLE001 - a group whose peer is gone may not shut down cleanly
                    pass


BACKGROUND_NICE = 10  # how much lower than the engine's own threads staging runs (Linux: per thread)


async def in_background(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a thread of its own at a lower CPU priority than the engine's step thread, awaited: the
    tensors a trainer sends are received and checked while the engine decodes, and on a machine with few cores
    that work must not slow its steps (measured on 2 cores: a step beside an unniced receive took 1.5x its
    usual time). A thread of its own: a lowered priority cannot be raised again by an unprivileged process, so
    it must not go back to a shared pool."""
    import os
    import threading

    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def run() -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed: same priority
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            loop.call_soon_threadsafe(_settle, done, exc, None)
        else:
            loop.call_soon_threadsafe(_settle, done, None, result)

    threading.Thread(target=run, name="tito-weight-staging", daemon=True).start()
    return await done


def _settle(done: asyncio.Future, exc: BaseException | None, result: Any) -> None:
    if not done.done():
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)


def _timed_out(exc: BaseException) -> bool:
    """Whether a torch.distributed failure was a wait running out (its type or message says so)."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "timed out" in text or "timeout" in text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def parse_version(value: Any, what: str = "weight_version") -> int | None:
    """vLLM sends versions as strings; tito stamps integers: "7" and 7 are 7, None is None, anything else refused."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TransferRefused(f"{what} must be an integer (or a string of one), got {value!r}", what)
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise TransferRefused(f"{what} must be an integer (or a string of one): tito stamps every sampled token with an "
                          f"integer version; got {value!r}", what)


class WireUpdates:
    """N engines as one vLLM server with N data-parallel ranks, for the weight-transfer calls.

    ``engines`` are handles with ``weight_transfer(op, *args)`` and ``world_size()``; ``sizes`` each one's worker
    count (its ranks in the group). Each call fans out to every engine and answers once all did; a failure on one
    drops the update on all, so the engines stay alike. ``version`` is the version served (the caller publishes
    it); ``apply`` swaps the staged weights in on every engine with that version."""

    def __init__(self, engines: Sequence[Any], sizes: Sequence[int], backend: WeightTransfer,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.engines = list(engines)
        self.sizes = list(sizes)
        self.backend = backend
        self.timeout_s = timeout_s
        self.joined = False
        self.active = False  # between a start and its finish (or the failure that ended it)
        self.busy: str | None = None  # the call being served (a receive can take long)

    @property
    def world_size(self) -> int:
        return sum(self.sizes)

    def _check_on(self) -> None:
        if self.backend == "none":
            raise Unsupported("weight transfer is off: start with engine.weight_transfer: gloo (CPU) or nccl "
                                  "(vLLM on GPUs)")

    async def _all(self, op: str, per_engine: Sequence[tuple] | None = None, timeout_s: float | None = None) -> list:
        args = per_engine or [()] * len(self.engines)
        calls = [e.weight_transfer(op, *a) for e, a in zip(self.engines, args)]
        done = await asyncio.gather(*(asyncio.wait_for(c, timeout_s) if timeout_s else c for c in calls),
                                    return_exceptions=True)
        failed = [d for d in done if isinstance(d, BaseException)]
        if failed:
            raise _cause(failed[0], op, timeout_s)
        return done

    async def init(self, init_info: Any) -> None:
        self._check_on()
        if self.busy:
            raise TransferConflict(f"init_weight_transfer_engine while {self.busy} is in progress")
        info = parse_init_info(init_info)
        if info.world_size != info.rank_offset + self.world_size:
            raise TransferRefused(f"init_info.world_size is {info.world_size}, but rank_offset {info.rank_offset} + "
                                  f"the server's {self.world_size} inference worker(s) is "
                                  f"{info.rank_offset + self.world_size} (GET /get_world_size)", "init_info")
        offsets, at = [], info.rank_offset
        for size in self.sizes:
            offsets.append((msgspec.structs.asdict(msgspec.structs.replace(info, rank_offset=at)),))
            at += size
        self.busy = "init_weight_transfer_engine"
        self.joined = self.active = False
        try:
            await self._all("init_weight_transfer", offsets, self.timeout_s + 30)
        except BaseException:
            await self._quietly("shutdown_weight_transfer")
            raise
        finally:
            self.busy = None
        self.joined = True

    async def start(self) -> None:
        self._check_on()
        if self.active:
            raise TransferConflict("start_weight_update while a weight update is already active: finish it (POST "
                                   "/finish_weight_update) first")
        if not self.joined:
            raise TransferRefused("start_weight_update before init_weight_transfer_engine: the trainer and the "
                                  "engines have no group yet")
        await self._all("start_weight_update")
        self.active = True

    async def receive(self, update_info: Any) -> dict:
        self._check_on()
        if not self.active:
            raise TransferRefused("update_weights before start_weight_update: POST /start_weight_update first")
        if self.busy:
            raise TransferConflict(f"update_weights while {self.busy} is in progress: send one update_weights at a "
                                   "time")
        try:
            infos = self._per_engine(update_info)
        except TransferRefused:  # as vLLM's worker: a refused update_weights ends the update
            await self.abort()
            raise
        self.busy = "update_weights"
        try:
            # no bound on the whole call (a large model takes long): each tensor's wait is bounded by the gloo timeout
            reports = await self._all("receive_weights", [(i,) for i in infos])
        except BaseException:
            await self.abort()
            raise
        finally:
            self.busy = None
        return reports[0]

    def _per_engine(self, update_info: Any) -> list[dict]:
        if isinstance(update_info, list):  # vLLM: one entry per global worker rank
            if len(update_info) != self.world_size:
                raise TransferRefused(f"update_info is a list of {len(update_info)} entries; the server has "
                                      f"{self.world_size} inference worker(s)", "update_info")
            infos, at = [], 0
            for size in self.sizes:
                infos.append(msgspec.structs.asdict(parse_update_info(update_info[at])))
                at += size
            return infos
        return [msgspec.structs.asdict(parse_update_info(update_info))] * len(self.engines)

    async def finish(self, version: int, hold: Callable[[], AbstractAsyncContextManager] | None = None) -> float:
        """Check every engine's staging, then swap it in everywhere under ``version``; returns the seconds the
        swap took (the pause). On a refused check nothing is swapped anywhere. ``hold``: a context the swap runs
        in, entered only once the check passed (follow mode stops its requests there, as for a checkpoint)."""
        self._check_on()
        if not self.active:
            raise TransferRefused("finish_weight_update without a matching start_weight_update")
        if self.busy:
            raise TransferConflict(f"finish_weight_update while {self.busy} is in progress")
        self.busy = "finish_weight_update"
        try:
            try:
                await self._all("check_weight_update")
            except BaseException:
                await self.abort()
                raise
            t0 = time.perf_counter()
            async with hold() if hold is not None else contextlib.nullcontext():
                await self._all("finish_weight_update", [(version,)] * len(self.engines))
            return time.perf_counter() - t0
        finally:
            self.active = False
            self.busy = None

    async def shutdown(self) -> None:
        self._check_on()
        self.active = self.joined = False
        await self._all("shutdown_weight_transfer")

    async def checksums(self) -> dict[str, str]:
        """Every engine's parameters' sha256 as vLLM keys a worker's: ``dp<i>:pp0:pcp0:tp0:<name>``, engine ``i``
        being data-parallel rank ``i``."""
        out: dict[str, str] = {}
        for sums in await self._all("weight_checksums", [(i,) for i in range(len(self.engines))]):
            out.update(sums)
        return out

    async def reset(self) -> None:
        await self._all("reset_weights")

    async def abort(self) -> None:
        """Drop the update in progress on every engine (what they staged); the served weights stay."""
        self.active = False
        await self._quietly("abort_weight_update")

    async def _quietly(self, op: str) -> None:
        await asyncio.gather(*(e.weight_transfer(op) for e in self.engines), return_exceptions=True)


def _cause(exc: BaseException, op: str, timeout_s: float | None) -> BaseException:
    """The engine's own exception (through Ray: its ``cause``), or TransferFailed for a call that timed out."""
    if isinstance(exc, asyncio.TimeoutError):
        return TransferFailed(f"{op}: an engine did not answer within {timeout_s:g} s (engine.weight_transfer_"
                              "timeout_s); the update is dropped and the weights served before it stay", True)
    return root_cause(exc)
