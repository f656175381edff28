"""The admin routes, as the RL stacks send them: prime-rl (/pause?mode=keep&clear_cache=false, /update_weights
with no version, /resume, /liveness), SkyRL and TRL (/reset_prefix_cache, /get_world_size, /sleep, /wake_up,
/is_sleeping, /server_info).

Parameters are read from the query string, as vLLM's routes read them, or from a JSON body, as SkyRL's client
sends several of them (``/sleep {"level": 2}``); the query wins when both name one. Unknown body fields are
refused with 400. Each route acts on every live engine of the fleet (rollout/serve/fleet.py). What cannot be
real here answers 501 naming why, never a pretend success: prime-rl's NCCL broadcaster (/init_broadcaster) and
sleep on a backend without it (vLLM's CPU build). vLLM's weight-transfer routes (``/update_weights`` with
``update_info`` among them) are in weight_routes.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from ..engines.checkpoint import CheckpointError
from ..engines.lora import AdapterError, adapter_step
from ..engines.protocol import root_cause
from . import calls, weight_routes
from .calls import json_response
from .fleet import EngineAsleep
from .schemas import BadRequest, Conflict, NotFound
from .state import ServerState

PauseMode = Literal["wait", "abort", "keep"]


class PauseBody(msgspec.Struct, forbid_unknown_fields=True):
    mode: PauseMode | None = None
    clear_cache: bool | None = None
    wait_for_inflight_request: bool | None = None  # SkyRL's older client: True = "wait", False = "abort"


class UpdateWeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    weight_dir: str | None = None
    version: int | None = None  # None: the current version + 1 (prime-rl sends none)
    skip_prefix_cache_reset: bool = False  # prime-rl's; KV of old weights is never reused here anyway
    update_info: dict | list | None = None  # vLLM's weight-transfer update (weight_routes.py)


class LoadLoraBody(msgspec.Struct):  # vLLM's LoadLoRAAdapterRequest (it ignores keys it does not know)
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class UnloadLoraBody(msgspec.Struct):  # vLLM's UnloadLoRAAdapterRequest
    lora_name: str = ""
    lora_int_id: int | None = None


class SleepBody(msgspec.Struct, forbid_unknown_fields=True):
    level: int | None = None
    mode: Literal["wait", "abort"] | None = None
    tags: list[str] | None = None


class WakeUpBody(msgspec.Struct, forbid_unknown_fields=True):
    tags: list[str] | None = None


class ResetPrefixCacheBody(msgspec.Struct, forbid_unknown_fields=True):
    reset_running_requests: bool | None = None
    reset_external: bool | None = None


def _query_bool(request: Request, name: str) -> bool | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    low = value.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise BadRequest(f"{name} must be true or false, got {value!r}", name)


def _query_int(request: Request, name: str) -> int | None:
    value = request.query_params.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {value!r}", name) from None


def _not_here(what: str, why: str) -> Response:
    return calls.error_response(501, f"{what} is not supported by tito serve: {why}", "NotImplementedError")


# ---- pause / resume / weights ---------------------------------------------------------------------


async def pause(state: ServerState, request: Request) -> Response:
    """Stop admitting requests. ``mode``: "wait" (tito's default: return once the running ones finished),
    "abort" (vLLM's default: abort them) or "keep" (leave them running). ``clear_cache=true`` also drops the
    engines' cached KV once they are drained (vLLM's default is true; tito's false: its caches are salted by
    weight version, so no stale KV is ever reused)."""
    body: PauseBody = await calls.read_struct(state, request, PauseBody)
    mode = request.query_params.get("mode") or body.mode
    if mode is None and body.wait_for_inflight_request is not None:
        mode = "wait" if body.wait_for_inflight_request else "abort"
    mode = mode or "wait"
    if mode not in ("wait", "abort", "keep"):
        raise BadRequest(f"pause mode must be 'wait', 'abort' or 'keep', got {mode!r}", "mode")
    clear = _query_bool(request, "clear_cache")
    clear = body.clear_cache if clear is None else clear
    running = list(state.fleet.where)
    await state.fleet.pause(mode)
    if mode == "abort":
        state.metrics.inc("aborts_total", len(running), cause="pause")
    cleared = bool(clear) and mode != "keep" and await state.fleet.reset_prefix_cache()
    return json_response({"status": "paused", "paused": True, "mode": mode, "cache_cleared": cleared})


async def resume(state: ServerState, request: Request) -> Response:
    state.fleet.resume()
    return json_response({"status": "resumed", "paused": False})


async def is_paused(state: ServerState, request: Request) -> Response:
    return json_response({"is_paused": state.fleet.paused})


async def update_weights(state: ServerState, request: Request) -> Response:
    """Load a checkpoint directory on every engine. Without ``version`` (prime-rl) the version increments by
    one; with it (tito's and the older vLLM API) that version is served, and it must be above the current one
    (409). The directory must be under ``server.weights_root`` (403, saying nothing of the path), hold no pickle
    weight files, and pass one engine's checkpoint validation (400 naming the problem and the tensor) before any
    engine pauses: a refused checkpoint leaves every engine serving its weights and version."""
    called = time.perf_counter()
    body: UpdateWeightsBody = await calls.read_struct(state, request, UpdateWeightsBody)
    if body.update_info is not None:  # vLLM's weight-transfer form: tensors over the trainer's group
        if body.weight_dir is not None:
            raise BadRequest("send weight_dir (a checkpoint) or update_info (tensors over the weight-transfer group), "
                             "not both", "update_info")
        return await weight_routes.update_weights_wire(state, request, body.update_info)
    if not body.weight_dir:
        raise BadRequest("weight_dir is required: the checkpoint directory to load", "weight_dir")
    weight_dir = _weight_dir(state, body.weight_dir)
    if isinstance(weight_dir, Response):
        return weight_dir
    problem = await asyncio.to_thread(pickle_problem, weight_dir)
    if problem:
        raise BadRequest(f"weight_dir {body.weight_dir!r}: {problem}", "weight_dir")
    if state.fleet.sleep_level:  # the update would be refused (503) after the check: say so before reading it
        raise EngineAsleep("the engines are asleep: POST /wake_up before /update_weights (waking reloads the "
                           "weights the engines had)")
    try:  # once, on one engine, before any engine pauses: a refused checkpoint changes nothing
        await state.fleet.validate_weights(str(weight_dir))
    except CheckpointError as exc:
        cause = root_cause(exc)
        problem = cause.problem if isinstance(cause, CheckpointError) else str(cause)
        raise BadRequest(f"weight_dir {body.weight_dir!r}: {problem}", "weight_dir") from None
    async with state.weights_lock:  # the version check and the update, with no other update in between
        current = state.fleet.weight_version
        if body.version is not None and body.version <= current:
            raise Conflict(f"version {body.version} is not above the version served now, {current}: versions "
                           "must increase (send none to take the next one)", "version")
        version = await state.fleet.update_weights(str(weight_dir), body.version, validate=False)
    # call -> generating again (validation and load; with requests kept in flight nothing waits for them to end)
    state.metrics.observe("weight_update_seconds", time.perf_counter() - called)
    state.metrics.observe("weight_update_paused_seconds", state.fleet.last_update_paused_s or 0.0)
    return json_response({"status": "ok", "weight_version": version})


FORBIDDEN_WEIGHT_DIR = ("weight_dir is not under the directory this server loads weights from "
                        "(server.weights_root)")
# the pickle weight files transformers' from_pretrained loads (when it finds no model.safetensors);
# a trainer's training_args.bin or optimizer.pt beside the weights are never loaded
PICKLE_WEIGHTS = "pytorch_model*.bin*"


def _weight_dir(state: ServerState, weight_dir: str, param: str = "weight_dir") -> Path | Response:
    """``weight_dir`` resolved (symlinks followed; relative to the root), or a 403 that says nothing about
    the path: neither whether it exists nor what it is, so the route cannot be used to probe the machine."""
    if state.weights_root is None:
        return calls.error_response(403, "weight updates are off: set server.weights_root to the directory "
                                    "holding the checkpoints", "PermissionDeniedError", param)
    try:
        root = Path(state.weights_root).resolve()
        target = (root / weight_dir).resolve()
    except (OSError, RuntimeError):  # unreadable components, a symlink loop
        target = None
    if target is None or (target != root and root not in target.parents):
        return calls.error_response(403, FORBIDDEN_WEIGHT_DIR.replace("weight_dir", param), "PermissionDeniedError",
                                    param)
    return target


def pickle_problem(path: Path) -> str | None:
    """Why ``path`` (under the weights root) must not be loaded before any engine looks at it, or None: it holds
    pickle weight files (transformers falls back to those, and unpickling runs code). The checkpoint itself is
    then checked by an engine (``Fleet.validate_weights``: layout, tensors against the model, finite values)."""
    if path.is_dir():
        pickles = sorted(f.name for f in path.glob(PICKLE_WEIGHTS))
        if pickles:
            return f"holds pickle weight files ({', '.join(pickles[:3])}): only safetensors checkpoints are loaded"
    return None


async def init_broadcaster(state: ServerState, request: Request) -> Response:
    return _not_here(request.url.path, "weights are loaded from checkpoint directories (POST /update_weights "
                     '{"weight_dir": ...}); there is no NCCL broadcast group to join')


async def load_lora_adapter(state: ServerState, request: Request) -> Response:
    """vLLM's ``/v1/load_lora_adapter`` and prime-rl's ``/load_lora_adapter`` (its server's wrapper, which reloads a
    name in place: it loads one name each step). The adapter directory must be under ``server.weights_root`` (403)
    and pass the engines' adapter checks (400 naming the problem: base, rank, shapes, finite values); then every
    engine serves it as ``model: <lora_name>``. Its version: N for a ``step_N`` directory, else the previous + 1
    (0 at first). vLLM's answers: 400 for a missing name or path, a name taken by the base model, or a name loaded
    already without ``load_inplace``; 200 with its text (prime-rl's route: ``{"status": "ok"}``)."""
    body: LoadLoraBody = await calls.read_struct(state, request, LoadLoraBody)
    prime_rl = request.url.path == "/load_lora_adapter"
    if not body.lora_name or not body.lora_path:
        raise BadRequest("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
    if body.lora_name in state.model_names:
        raise BadRequest(f"The lora adapter '{body.lora_name}' conflicts with a served base model.", "lora_name")
    if body.lora_name in state.loras and not (body.load_inplace or prime_rl):
        raise BadRequest(f"The lora adapter '{body.lora_name}' has already been loaded. If you want to load the "
                         "adapter in place, set 'load_inplace' to True.", "lora_name")
    path = _weight_dir(state, body.lora_path, "lora_path")
    if isinstance(path, Response):
        return path
    version = adapter_step(path)
    try:
        version = await state.fleet.load_lora_adapter(body.lora_name, str(path), version)
    except AdapterError as exc:
        raise BadRequest(str(root_cause(exc)), "lora_path") from None
    except Exception as exc:
        cause = root_cause(exc)
        if isinstance(cause, AdapterError):
            raise BadRequest(str(cause), "lora_path") from None
        raise
    state.loras[body.lora_name] = {"path": str(path), "version": version}
    if prime_rl:
        return json_response({"status": "ok"})
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(state: ServerState, request: Request) -> Response:
    """vLLM's ``/v1/unload_lora_adapter``: 404 for a name not loaded; requests already running with it finish."""
    body: UnloadLoraBody = await calls.read_struct(state, request, UnloadLoraBody)
    if not body.lora_name:
        raise BadRequest("'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
    if body.lora_name not in state.loras:
        raise NotFound(f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name")
    del state.loras[body.lora_name]  # refused from now on, before the engines forget it
    await state.fleet.unload_lora_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


# ---- health and sizes ------------------------------------------------------------------------------


async def liveness(state: ServerState, request: Request) -> Response:
    """200 while the server process answers, whatever the engines' state (/health checks those)."""
    return json_response({"status": "alive"})


async def get_world_size(state: ServerState, request: Request) -> Response:
    """vLLM's: the inference workers (tensor x pipeline x data parallel) summed over the engines."""
    return json_response({"world_size": await state.fleet.world_size()})


async def server_info(state: ServerState, request: Request) -> Response:
    """What TRL's VLLMClient.get_server_info reads (``vllm_config``, whose ``weight_transfer_config`` is
    ``{"backend": engine.weight_transfer}``, or null when that is none: TRL then says so instead of failing later),
    with tito's own summary."""
    fleet = state.fleet
    world = await fleet.world_size()
    info = fleet.infos[0]
    summary = {"model": state.model_names[0], "root": state.root, "backend": info.backend,
               "engines": len(fleet.engines), "engines_alive": len(fleet.engines) - len(fleet.dead),
               "world_size": world, "max_model_len": fleet.max_model_len, "vocab_size": fleet.vocab_size,
               "weight_version": fleet.weight_version, "paused": fleet.paused, "sleep_level": fleet.sleep_level}
    transfer = None if fleet.weight_transfer == "none" else {"backend": fleet.weight_transfer}
    vllm_config = {"model_config": {"model": state.model_names[0], "max_model_len": fleet.max_model_len},
                   "parallel_config": {"world_size": world}, "weight_transfer_config": transfer}
    return json_response({"vllm_config": vllm_config, "tito": summary})


# ---- prefix cache, sleep ---------------------------------------------------------------------------


async def reset_prefix_cache(state: ServerState, request: Request) -> Response:
    """Every engine drops its cached KV (embedded: the session KV; vLLM: AsyncLLM.reset_prefix_cache).
    ``{"success": false}`` as vLLM answers when blocks were still held by running requests."""
    body: ResetPrefixCacheBody = await calls.read_struct(state, request, ResetPrefixCacheBody)
    running = _query_bool(request, "reset_running_requests")
    running = bool(body.reset_running_requests if running is None else running)
    external = _query_bool(request, "reset_external")
    if external if external is not None else body.reset_external:
        return _not_here("reset_external", "there is no external (connector-managed) KV cache here")
    success = await state.fleet.reset_prefix_cache(running)
    state.metrics.inc("prefix_cache_resets_total")
    return json_response({"success": success})


async def sleep(state: ServerState, request: Request) -> Response:
    """Free every engine's weights and KV (``level`` 1 or 2, as vLLM's); requests get 503 until /wake_up.
    ``mode``: "abort" (vLLM's default) or "wait" for the running requests."""
    body: SleepBody = await calls.read_struct(state, request, SleepBody)
    level = _query_int(request, "level")
    level = body.level if level is None else level
    level = 1 if level is None else level
    if level not in (1, 2):
        raise BadRequest(f"sleep level must be 1 or 2, got {level}", "level")
    mode = request.query_params.get("mode") or body.mode or "abort"
    if mode not in ("abort", "wait"):
        raise BadRequest(f"sleep mode must be 'abort' or 'wait', got {mode!r} (sleeping frees the KV of "
                         "running requests, so they cannot be kept)", "mode")
    running = list(state.fleet.where)
    await state.fleet.sleep(level, mode)  # Unsupported (a backend without sleep mode): 501 naming it
    if mode == "abort":
        state.metrics.inc("aborts_total", len(running), cause="sleep")
    return json_response({"status": "sleeping", "level": level})


async def wake_up(state: ServerState, request: Request) -> Response:
    """Reload every engine's weights (all of them: ``tags`` are accepted as vLLM's and echoed, and tito
    wakes weights and KV together)."""
    body: WakeUpBody = await calls.read_struct(state, request, WakeUpBody)
    tags = request.query_params.getlist("tags") or body.tags or None
    await state.fleet.wake_up(tags)
    return json_response({"status": "awake", "tags": tags})


async def is_sleeping(state: ServerState, request: Request) -> Response:
    return json_response({"is_sleeping": bool(state.fleet.sleep_level)})


ROUTES = [
    ("/pause", pause, ["POST"]),
    ("/resume", resume, ["POST"]),
    ("/is_paused", is_paused, ["GET"]),
    ("/update_weights", update_weights, ["POST"]),
    ("/init_broadcaster", init_broadcaster, ["POST"]),
    ("/load_lora_adapter", load_lora_adapter, ["POST"]),
    ("/v1/load_lora_adapter", load_lora_adapter, ["POST"]),
    ("/v1/unload_lora_adapter", unload_lora_adapter, ["POST"]),
    ("/liveness", liveness, ["GET"]),
    ("/get_world_size", get_world_size, ["GET"]),
    ("/server_info", server_info, ["GET"]),
    ("/reset_prefix_cache", reset_prefix_cache, ["POST"]),
    ("/sleep", sleep, ["POST"]),
    ("/wake_up", wake_up, ["POST"]),
    ("/is_sleeping", is_sleeping, ["GET"]),
]
