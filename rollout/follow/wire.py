"""``follow.weights: wire``: the trainer pushes its weights over vLLM's weight-transfer routes instead of writing
checkpoints, and ``tito run --follow`` takes version N from ``/finish_weight_update {weight_version: N}``.

The service listens on ``follow.listen`` (loopback by default) with those routes only (rollout/serve/
weight_routes.py, the same code ``tito serve`` runs) plus ``/health`` and ``/get_world_size``; with
TITO_ADMIN_API_KEY set, every route that changes the weights takes that key. What a trainer does, with
``rollout.engines.gloo_sender.GlooWeightSender(url)``: ``init()`` once, then ``send(model.named_parameters(),
version=k)`` after each step. The engines stage the tensors while they keep sampling; ``finish`` checks them
(every name known, shapes, finite), then the service holds its requests as ``follow.inflight`` says (abort/resume,
drain or keep), swaps the staged weights in on every engine, and admits the batches that version N allows, as
with a checkpoint. A refused or failed update changes nothing: the engines keep the version they served.

No file holds weights that came over the wire: an engine Ray restarts would come back on the base weights, so it
is kept out of routing (named in the log) once a wire update was served, never sampled under the wrong label.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..engines.weight_transfer import DEFAULT_TIMEOUT_S, WeightTransfer, WireUpdates
from ..handles import EngineHandle
from ..serve import weight_routes
from ..serve.app import http_error, wrap_route
from ..serve.calls import json_response, read_struct
from ..serve.guard import Guard
from ..serve.metrics import Metrics, server_metrics
from ..serve.schemas import BadRequest
from ..serve.state import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from .weights import WeightFollower


def bind_listener(listen: str) -> socket.socket:
    """The listening socket of ``follow.listen`` (HOST:PORT), bound before any engine starts: a port in use is one
    line now, not a service that fails once its engines are loaded."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        raise ValueError(f"follow.listen {listen}: cannot listen there ({exc.strerror or exc}): the port is in use "
                         "or the address is not this machine's; choose another (port 0: any free one)") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def listen_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class WireFollower(WeightFollower):
    """The follow service's weights when the trainer pushes them (see the module doc): the wire update is the
    load, ``/finish_weight_update`` its moment. It is also the "fleet" the weight routes act on."""

    def __init__(self, run_dir: Any, engines: Sequence[EngineHandle], holder: Any, *, inflight: str,
                 log: Any, listener: socket.socket, backend: WeightTransfer,
                 timeout_s: float = DEFAULT_TIMEOUT_S, admin_api_key: str | None = None,
                 load_timeout_s: float = 600.0) -> None:
        super().__init__(run_dir, engines, holder, inflight=inflight, poll_interval_s=1.0, log=log,
                         load_timeout_s=load_timeout_s)
        self.listener = listener
        self.listen_url = listen_url(listener)
        self.backend = backend
        self.timeout_s = timeout_s
        self.admin_api_key = admin_api_key
        self.sleep_level = 0  # the weight routes refuse while asleep; a follow service never sleeps
        self.last_update_paused_s: float | None = None
        self.from_wire = False  # a wire update was served: no file holds the weights
        self._wire: WireUpdates | None = None
        self._finishing = 0  # the version being finished (status.json names it)
        self._aborted = 0

    @property
    def weight_version(self) -> int:
        return self.version

    # ---- what the service calls on a WeightFollower -------------------------------------------------------
    async def poll_once(self) -> bool:
        return False  # nothing to poll: versions arrive on the routes

    async def watch(self) -> None:
        """Serve the weight-transfer routes until cancelled (the service's end)."""
        import uvicorn

        class QuietServer(uvicorn.Server):
            def capture_signals(self):  # the service's own SIGINT/SIGTERM handling stays in charge
                return contextlib.nullcontext()

        server = QuietServer(uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False))
        self.log(f"weight-transfer routes on {self.listen_url} (follow.weights: wire): the trainer sends with "
                 "GlooWeightSender or vLLM's weight-transfer API")
        task = asyncio.create_task(server.serve(sockets=[self.listener]))
        try:
            await asyncio.shield(task)
        finally:
            server.should_exit = True
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 5)

    def pending_what(self, n: int, phase: str) -> str:
        return f"weights v{n} from the trainer to be {'checked' if phase == 'validating' else 'swapped in'}"

    async def bring_up(self, index: int) -> int:
        if self.from_wire:  # its fresh incarnation holds the base weights: never sample them under this label
            raise RuntimeError(f"engine {index} restarted, but the engines serve version {self.version}, received "
                               "over the wire, which no file holds: it cannot be brought up to them and stays out")
        return await super().bring_up(index)

    # ---- the fleet the weight routes act on (rollout/serve/weight_routes.py) -----------------------------
    async def wire_updates(self) -> WireUpdates:
        if self._wire is None:
            sizes = list(await asyncio.gather(*(e.world_size() for e in self.engines)))
            self._wire = WireUpdates(self.engines, sizes, self.backend, self.timeout_s)
        return self._wire

    async def world_size(self) -> int:
        return (await self.wire_updates()).world_size

    @contextlib.asynccontextmanager
    async def _held(self):
        self._phase("loading", self._finishing)
        self._aborted = await self.holder.hold_for_update(self.inflight)  # type: ignore[arg-type]
        try:
            yield
        finally:
            self.holder.release()

    async def finish_wire_update(self, version: int) -> None:
        """Check what every engine staged, hold the requests (``follow.inflight``), swap, publish ``version``."""
        wire = await self.wire_updates()
        async with self._loading:
            self._finishing = version
            self._phase("validating", version)
            t0 = time.perf_counter()
            try:
                self.last_update_paused_s = await wire.finish(version, hold=self._held)
            except Exception as exc:
                self._error(f"weights v{version} from the trainer refused: {exc}; the engines stay on version "
                            f"{self.version}")
                raise
            finally:
                self._phase(None)
            await self._publish(version, {"finish_s": round(time.perf_counter() - t0, 3),
                                          "load_s": round(self.last_update_paused_s, 3),
                                          "aborted_requests": self._aborted, "source": "wire"})
            self.log(f"weights v{version} from the trainer swapped in in {self.last_update_paused_s:.3f} s "
                     f"({self._aborted} turns stopped to go on under them)")

    async def _publish(self, version: int, record: dict[str, Any]) -> None:
        self.from_wire = True
        self.engine_versions = [version] * len(self.engines)
        async with self.changed:
            self.version = version
            self.changed.notify_all()
        self.loads.append({"version": version, **record, "at": round(time.time(), 3)})

    async def abort_wire_update(self) -> None:
        await (await self.wire_updates()).abort()

    async def relabel_version(self, version: int) -> None:
        """vLLM's /update_weight_version: the weights served are now ``version`` (later tokens carry it)."""
        async with self._loading:
            await asyncio.gather(*(e.weight_transfer("set_weight_version", version) for e in self.engines))
            await self._publish(version, {"load_s": 0.0, "aborted_requests": 0, "source": "relabel"})

    async def reset_weights(self) -> None:
        async with self._loading:
            await (await self.wire_updates()).reset()
            self.from_wire = True

    # ---- the HTTP side ------------------------------------------------------------------------------------
    def app(self) -> Starlette:
        state = WireState(fleet=self)
        routes = [*weight_routes.ROUTES, ("/update_weights", update_weights, ["POST"]),
                  ("/get_world_size", get_world_size, ["GET"]), ("/health", health, ["GET"])]
        admin = self.admin_api_key if self.admin_api_key is not None else os.environ.get("TITO_ADMIN_API_KEY")
        guard = Middleware(Guard, api_key=None, admin_api_key=admin or None, body_timeout_s=state.body_timeout_s)
        return Starlette(routes=[Route(p, wrap_route(state, p, fn), methods=m) for p, fn, m in routes],
                         exception_handlers={HTTPException: http_error}, middleware=[guard])


@dataclass
class WireState:
    """What the weight routes read of a server's state (rollout/serve/state.py ServerState), for follow mode."""

    fleet: WireFollower
    metrics: Metrics = field(default_factory=server_metrics)
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S


class WireUpdateBody(msgspec.Struct, forbid_unknown_fields=True):
    update_info: Any = None
    weight_dir: str | None = None


async def update_weights(state: WireState, request: Request) -> Response:
    """``/update_weights {update_info}`` only: a checkpoint (``weight_dir``) goes through broadcasts/ with
    follow.weights: files."""
    body: WireUpdateBody = await read_struct(state, request, WireUpdateBody)
    if body.weight_dir is not None or body.update_info is None:
        raise BadRequest("follow.weights: wire takes update_info (tensors over the weight-transfer group); to load "
                         "checkpoints, run with follow.weights: files and publish them to RUN_DIR/broadcasts/",
                         "update_info" if body.weight_dir is None else "weight_dir")
    return await weight_routes.update_weights_wire(state, request, body.update_info)


async def get_world_size(state: WireState, request: Request) -> Response:
    return json_response({"world_size": await state.fleet.world_size()})


async def health(state: WireState, request: Request) -> Response:
    follower = state.fleet
    alive = len(follower.holder.router.alive())
    return json_response({"status": "ok" if alive else "unavailable", "weight_version": follower.version,
                          "engines_alive": alive, "engines_configured": len(follower.engines)},
                         200 if alive else 503)
