"""vLLM's weight-transfer routes (vLLM 0.32 ``vllm/entrypoints/rl/online/api_router.py``), with its request and
response bodies, over every engine of the fleet (rollout/engines/weight_transfer.py ``WireUpdates``):

``POST /init_weight_transfer_engine {init_info}``, ``/start_weight_update``, ``/update_weights {update_info}`` (the
checkpoint form, ``{weight_dir}``, stays in admin.py), ``/finish_weight_update {weight_version}``,
``/shutdown_weight_transfer_engine``, ``GET /weight_info``, ``POST /update_weight_version {new_version}``,
``POST /weight_checker {action: checksum|compare|reset, baseline}``; and ``/collective_rpc`` for the three worker
methods SkyRL 0.3 calls through it around a broadcast (start, update_weights_nccl, finish).

Answers: 400 for a malformed body or a call out of order (naming the field or the tensor), 409 for a call that
clashes with one in progress (a second ``start_weight_update``), 501 where ``engine.weight_transfer`` is none,
502/504 when the wire failed (the trainer never connected, died, stopped sending): the engines keep the weights
they served before ``start``, and the version moves only when ``finish`` succeeded.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ..engines.weight_transfer import TransferConflict, TransferFailed, TransferRefused, WireUpdates, parse_version
from . import calls
from .calls import json_response
from .fleet import EngineAsleep
from .schemas import BadRequest, Conflict
from .state import ServerState


class InitBody(msgspec.Struct, forbid_unknown_fields=True):
    init_info: dict[str, Any]


class StartBody(msgspec.Struct):  # vLLM reads no body here: other keys are ignored, as there
    is_checkpoint_format: bool = True  # SkyRL's; False (kernel-format tensors) cannot be received here


class FinishBody(msgspec.Struct, forbid_unknown_fields=True):
    weight_version: str | int | None = None


class VersionBody(msgspec.Struct, forbid_unknown_fields=True):
    new_version: str | int


class CheckerBody(msgspec.Struct, forbid_unknown_fields=True):
    action: Literal["checksum", "reset", "compare"]
    baseline: dict[str, str] | None = None


async def _wire(state: ServerState) -> WireUpdates:
    fleet = state.fleet
    if fleet.sleep_level:
        raise EngineAsleep("the engines are asleep: POST /wake_up before a weight transfer")
    return await fleet.wire_updates()


def _failure(exc: BaseException) -> Response:
    """A TransferFailed answer: 504 when a wait ran out, else 502 (the trainer's side of the wire failed)."""
    status = 504 if getattr(exc, "timed_out", False) else 502
    return calls.error_response(status, str(exc), "GatewayTimeoutError" if status == 504 else "BadGatewayError")


async def _guarded(call) -> Response | None:
    """Run a WireUpdates call; its refusals as the server's errors (BadRequest / Conflict), its failures as 502/504
    (Unsupported, weight transfer off, goes on to the server's 501)."""
    try:
        await call
    except TransferConflict as exc:
        raise Conflict(str(exc), exc.param) from None
    except TransferRefused as exc:
        raise BadRequest(str(exc), exc.param) from None
    except TransferFailed as exc:
        return _failure(exc)
    return None


async def init_weight_transfer_engine(state: ServerState, request: Request) -> Response:
    """Every engine joins the trainer's group (rank ``rank_offset`` + its place); answers once all did."""
    body: InitBody = await calls.read_struct(state, request, InitBody)
    wire = await _wire(state)
    failed = await _guarded(wire.init(body.init_info))
    return failed or json_response({"message": "Weight transfer initialized"})


async def shutdown_weight_transfer_engine(state: ServerState, request: Request) -> Response:
    wire = await _wire(state)
    failed = await _guarded(wire.shutdown())
    return failed or json_response({"message": "Weight transfer shut down"})


async def start_weight_update(state: ServerState, request: Request) -> Response:
    """Begin an update: every engine opens a staging copy. Nothing pauses: requests keep running on the served
    weights until ``finish`` swaps the new ones in between two steps (a trainer may still /pause around it)."""
    body: StartBody = await calls.read_struct(state, request, StartBody)
    if not body.is_checkpoint_format:
        raise BadRequest("is_checkpoint_format: false (kernel-format tensors) cannot be received: send the "
                         "checkpoint (Hugging Face) names and shapes", "is_checkpoint_format")
    wire = await _wire(state)
    failed = await _guarded(wire.start())
    return failed or json_response({"message": "Weight update started"})


async def update_weights_wire(state: ServerState, request: Request, update_info: Any) -> Response:
    """``/update_weights {update_info}``: receive the announced tensors (admin.update_weights sends it here)."""
    wire = await _wire(state)
    t0 = time.perf_counter()
    failed = await _guarded(wire.receive(update_info))
    if failed is None:
        state.metrics.observe("weight_transfer_receive_seconds", time.perf_counter() - t0)
    return failed or json_response({"message": "Weights updated"})


async def finish_weight_update(state: ServerState, request: Request) -> Response:
    """Check what arrived on every engine, then swap it in and publish ``weight_version`` (None: the current + 1;
    it must be above the current, 409). A refused check changes nothing and the version stays."""
    called = time.perf_counter()
    body: FinishBody = await calls.read_struct(state, request, FinishBody)
    await _wire(state)  # asleep: 503 before anything
    try:
        asked = parse_version(body.weight_version)
    except TransferRefused as exc:
        raise BadRequest(str(exc), "weight_version") from None
    fleet = state.fleet
    async with state.weights_lock:
        current = fleet.weight_version
        version = current + 1 if asked is None else asked
        if version <= current:
            await fleet.abort_wire_update()
            raise Conflict(f"weight_version {version} is not above the version served now, {current}: versions must "
                           "increase (send none to take the next one); the update is dropped", "weight_version")
        failed = await _guarded(fleet.finish_wire_update(version))
    if failed is not None:
        return failed
    state.metrics.observe("weight_update_seconds", time.perf_counter() - called)
    state.metrics.observe("weight_update_paused_seconds", fleet.last_update_paused_s or 0.0)
    return json_response({"message": "Weight update finished", "weight_version": str(version)})


async def update_weight_version(state: ServerState, request: Request) -> Response:
    """Relabel the served weights (vLLM's): later tokens carry ``new_version``, which may not go below the current
    one (every sampled token's version only grows)."""
    body: VersionBody = await calls.read_struct(state, request, VersionBody)
    try:
        version = parse_version(body.new_version, "new_version")
    except TransferRefused as exc:
        raise BadRequest(str(exc), "new_version") from None
    async with state.weights_lock:
        current = state.fleet.weight_version
        if version < current:
            raise Conflict(f"new_version {version} is below the version served now, {current}: a sampled token's "
                           "version never goes back", "new_version")
        await state.fleet.relabel_version(version)
    return json_response({"success": True, "new_version": str(body.new_version)})


async def weight_info(state: ServerState, request: Request) -> Response:
    return json_response({"weight_version": str(state.fleet.weight_version)})


async def weight_checker(state: ServerState, request: Request) -> Response:
    """vLLM's: ``checksum`` (sha256 of each parameter as every engine holds it), ``compare`` against a ``baseline``
    of such checksums, ``reset`` (zero every parameter: to prove an update covers them all)."""
    body: CheckerBody = await calls.read_struct(state, request, CheckerBody)
    fleet = state.fleet
    wire = await _wire(state)
    if body.action == "reset":
        async with state.weights_lock:
            await fleet.reset_weights()
        return json_response({"status": "reset"})
    if body.action == "compare" and body.baseline is None:
        raise BadRequest("action='compare' requires a 'baseline' object", "baseline")
    checksums = await wire.checksums()
    if body.action == "checksum":
        return json_response({"checksums": checksums})
    mismatches = sorted(k for k in checksums.keys() | body.baseline.keys() if checksums.get(k) != body.baseline.get(k))
    return json_response({"match": not mismatches, "mismatches": mismatches})


class CollectiveRpcBody(msgspec.Struct):  # vLLM's dev route reads these keys and ignores others
    method: str | None = None
    args: list = msgspec.field(default_factory=list)
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    timeout: float | None = None


# the worker methods SkyRL 0.3 calls through vLLM's /collective_rpc around a broadcast (its worker extension's names;
# its RemoteInferenceClient start_weight_update / update_weights_nccl / finish_weight_update): tito has no vLLM
# worker to run them on, so they are the same steps as the routes above
SKYRL_STEPS = ("skyrl_start_weight_update", "update_weights_nccl", "skyrl_finish_weight_update")


async def collective_rpc(state: ServerState, request: Request) -> Response:
    """vLLM's ``/collective_rpc {method, args, kwargs}`` for the weight-sync methods SkyRL sends (SKYRL_STEPS), answered
    ``{results: [one per inference worker]}`` as vLLM answers; any other method is a 400 naming those."""
    body: CollectiveRpcBody = await calls.read_struct(state, request, CollectiveRpcBody)
    if body.method is None:
        raise BadRequest("Missing 'method' in request body", "method")
    if body.method not in SKYRL_STEPS:
        raise BadRequest(f"collective_rpc method {body.method!r} cannot run here: tito runs no vLLM worker "
                         f"extension; the weight-sync methods it answers are {', '.join(SKYRL_STEPS)}", "method")
    wire = await _wire(state)
    if body.method == "skyrl_start_weight_update":
        if body.kwargs.get("is_checkpoint_format", True) is False:
            raise BadRequest("is_checkpoint_format: false (kernel-format tensors) cannot be received: send the "
                             "checkpoint (Hugging Face) names and shapes", "is_checkpoint_format")
        failed = await _guarded(wire.start())
    elif body.method == "update_weights_nccl":
        if "update_info" not in body.kwargs:
            raise BadRequest("update_weights_nccl needs kwargs.update_info", "kwargs")
        failed = await _guarded(wire.receive(body.kwargs["update_info"]))
    else:
        fleet = state.fleet
        async with state.weights_lock:
            failed = await _guarded(fleet.finish_wire_update(fleet.weight_version + 1))
    return failed or json_response({"results": [None] * wire.world_size})


ROUTES = [
    ("/collective_rpc", collective_rpc, ["POST"]),
    ("/init_weight_transfer_engine", init_weight_transfer_engine, ["POST"]),
    ("/shutdown_weight_transfer_engine", shutdown_weight_transfer_engine, ["POST"]),
    ("/start_weight_update", start_weight_update, ["POST"]),
    ("/finish_weight_update", finish_weight_update, ["POST"]),
    ("/update_weight_version", update_weight_version, ["POST"]),
    ("/weight_info", weight_info, ["GET"]),
    ("/weight_checker", weight_checker, ["POST"]),
]
ADMIN_PATHS = frozenset(path for path, _, _ in ROUTES) - {"/weight_info"}
