"""Starting the server: Ray, the engine actors, the renderer actors, then uvicorn.

``build_state(cfg, placement)`` starts (or joins) Ray and the actors with the start-up ``tito run`` uses
(rollout/startup.py) and returns the routes' ``ServerState``; ``serve(cfg, placement)`` runs uvicorn in the
foreground (``tito serve``); ``ServerThread`` runs it in a background thread (tests, benchmarks) and reports the bound port.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .. import startup
from ..config import ServeConfig
from ..engines.factory import build_backend
from ..engines.protocol import close_backend
from ..handles import EngineHandle, LocalEngine, RendererHandle
from .app import ServerState, create_app
from .fleet import Fleet
from .sessions import SessionManager

API_KEY_ENV = "TITO_API_KEY"
ADMIN_API_KEY_ENV = "TITO_ADMIN_API_KEY"


def _secret(value: Any, env: str) -> str | None:
    """A key from the config (a SecretStr), else from the environment variable ``env``; None when neither
    (an empty value is none, as vLLM reads VLLM_API_KEY)."""
    key = value.get_secret_value() if value is not None else os.environ.get(env, "")
    return key or None


def build_state(cfg: ServeConfig,
                placement: startup.Placement) -> tuple[ServerState, list[EngineHandle | RendererHandle]]:
    """Start the actors a serve config describes, through ``placement`` (the engines too, unless
    ``engine_in_process``); returns the state and the actors (for ``placement.stop`` on exit)."""
    import ray

    out_dir = cfg.output.dir
    local_ray = not cfg.ray.address and not ray.is_initialized()
    # before anything loads: a server that cannot start says so in seconds
    engine_cpus, cpu_note = startup.preflight(cfg, Path(out_dir) if out_dir else None,
                                              engines_on_ray=not cfg.engine_in_process)
    if cpu_note:
        print(f"tito serve: note: {cpu_note}", file=sys.stderr, flush=True)
    model_path = str(startup.find_model(cfg.model))
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    # before Ray: a vLLM model is converted here
    specs = startup.engine_specs(cfg.engine, model_path, engine_cpus)
    startup.init_ray(cfg.ray)
    if cfg.ray.address:
        startup.check_cluster_gpus(cfg.engine)
    if not local_ray and not cfg.engine_in_process:
        startup.wait_for_cluster_cpus(cfg, engine_cpus, lambda line: print(f"tito serve: note: {line}",
                                                                           file=sys.stderr, flush=True))
    if cfg.engine_in_process:
        # plain backends on the server's event loop (they bind to the loop that first uses them)
        backends = [asyncio.run(build_backend(s.kind, s.kwargs)) for s in specs for _ in range(s.replicas)]
        engines = [LocalEngine(b) for b in backends]
        infos = [b.info() for b in backends]
    else:
        engines = placement.start_engines(specs)
        infos = placement.engine_infos(engines)
    renderer_actors = placement.start_renderers(startup.RendererSpec(
        model_path, cfg.renderer, model_name=cfg.served_model_name or cfg.model, out_dir=out_dir,
        fmt=cfg.output.format, rows_per_file=cfg.output.rows_per_file))
    placement.renderer_infos(renderer_actors)  # surface a renderer that cannot start, here
    parser = startup.create_parser(cfg.renderer, model_path)
    fleet = Fleet(engines, infos, cfg.engine.overload_factor)
    fleet.weight_transfer, fleet.weight_transfer_timeout_s = cfg.engine.weight_transfer, cfg.engine.weight_transfer_timeout_s
    if not cfg.engine_in_process:  # Ray actors: a lost one is restarted and brought back (in-process: routed around)
        e = cfg.engine
        fleet.enable_healing(log=lambda line: print(f"tito serve: {line}", file=sys.stderr, flush=True),
                             restarts=e.max_restarts, heartbeat_interval_s=e.heartbeat_interval_s,
                             heartbeat_timeout_s=e.heartbeat_timeout_s, restart_timeout_s=e.restart_timeout_s)
    sessions = SessionManager(renderer_actors, idle_timeout_s=cfg.sessions.idle_timeout_s,
                              max_sessions=cfg.sessions.max_sessions, write_samples=bool(out_dir),
                              max_idle_bytes=cfg.sessions.max_idle_bytes)
    names = [cfg.served_model_name or cfg.model, cfg.model, model_path]
    state = ServerState(fleet=fleet, sessions=sessions, parser=parser, model_names=list(dict.fromkeys(names)),
                        root=model_path, default_max_tokens=cfg.default_max_tokens,
                        sweep_interval_s=min(5.0, cfg.sessions.idle_timeout_s / 4),
                        api_key=_secret(cfg.server.api_key, API_KEY_ENV),
                        admin_api_key=_secret(cfg.server.admin_api_key, ADMIN_API_KEY_ENV),
                        weights_root=cfg.server.weights_root, body_timeout_s=cfg.server.body_timeout_s)
    return state, ([] if cfg.engine_in_process else engines) + renderer_actors


def _uvicorn_config(app: Any, host: str, port: int, log_level: str) -> Any:
    import uvicorn

    # backlog: a burst of hundreds of clients connecting at once must not be refused by the kernel;
    # use_colors None: uvicorn colours its log only on a terminal, False: NO_COLOR is set
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", access_log=False,
                          backlog=4096, timeout_keep_alive=30, use_colors=False if os.environ.get("NO_COLOR") else None)


def _shutdown(state: ServerState, actors: list[EngineHandle | RendererHandle], placement: startup.Placement) -> None:
    async def finish_sessions() -> None:
        for sid in list(state.sessions.sessions):
            try:
                await state.sessions.close(sid, "server_shutdown")
            except Exception:  # a renderer that is gone: nothing more to write
                pass

    if state.sessions.write_samples:
        asyncio.run(finish_sessions())
        for r in state.sessions.renderers:
            try:
                placement.close_renderers([r], timeout_s=30)
            except Exception:  # one renderer gone (or its Ray): the others still write theirs
                pass
    placement.stop(actors)
    for engine in state.fleet.engines:
        if isinstance(engine, LocalEngine):  # an in-process backend
            try:
                asyncio.run(close_backend(engine.backend))
            except Exception:
                pass


def _announce_ready(server: Any, host: str, t0: float) -> None:
    """Print the ready line (with the bound port: the config may say 0) once uvicorn listens."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"tito serve: ready in {time.perf_counter() - t0:.1f} s on http://{host}:{port}", flush=True)


EXIT_ENGINES_LOST = 3  # tito serve's exit status once no engine is alive (Ray lost, or every engine died)


class EngineWatch:
    """Probes the engine actors every ``interval_s`` from a thread and calls ``on_lost(reason)`` once every
    one of them is dead (Ray reports its actor died: the engine, its node or the local Ray is gone).

    Nothing brings engines back inside a running server (its Ray may be gone with them), so ``tito serve``
    then exits with status :data:`EXIT_ENGINES_LOST` for a supervisor to restart it, instead of answering
    503 forever. While at least one engine lives the server keeps serving on it (see Fleet)."""

    def __init__(self, engines: list[EngineHandle], on_lost: Any, interval_s: float = 2.0,
                 probe_timeout_s: float = 10.0, coming_back: Any = None):
        self.engines = engines
        self.on_lost = on_lost
        # an engine the fleet's healer is restarting is not dead while Ray has a live node to restart it on
        self.coming_back = coming_back or (lambda index: False)
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.dead: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tito-engine-watch", daemon=True)

    def start(self) -> EngineWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.probe_timeout_s + self.interval_s)

    def probe(self) -> None:
        """One round: a health call to each engine not known dead; an actor death marks it dead. A slow or
        failing probe is not a death (a busy engine is still there). Runs on this thread's own event loop."""
        from .fleet import is_actor_death

        async def health(i: int) -> None:
            try:
                await asyncio.wait_for(self.engines[i].health(), self.probe_timeout_s)
            except Exception as exc:
                if is_actor_death(exc) and not (self.coming_back(i) and _ray_has_live_node()):
                    self.dead.add(i)

        async def every_live_engine() -> None:
            await asyncio.gather(*(health(i) for i in range(len(self.engines)) if i not in self.dead))

        asyncio.run(every_live_engine())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.probe()
            except Exception:  # Ray itself refusing calls: the next round tells whether the actors died
                continue
            if len(self.dead) == len(self.engines):
                self.on_lost(f"all {len(self.engines)} engines died (their Ray actors, nodes or the local Ray "
                             "are gone)")
                return


def _ray_has_live_node() -> bool:
    try:
        import ray

        return any(node.get("Alive") for node in ray.nodes())
    except Exception:  # noqa: BLE001 - Ray itself is gone
        return False


def serve(cfg: ServeConfig, placement: startup.Placement) -> None:
    """``tito serve``: run until interrupted, then write open sessions (with an output dir) and stop the actors.
    Exits with status :data:`EXIT_ENGINES_LOST` once every engine actor died (see :class:`EngineWatch`)."""
    import uvicorn

    t0 = time.perf_counter()
    state, actors = build_state(cfg, placement)
    server = uvicorn.Server(_uvicorn_config(create_app(state), cfg.server.host, cfg.server.port, cfg.server.log_level))
    threading.Thread(target=_announce_ready, args=(server, cfg.server.host, t0), daemon=True).start()
    lost: list[str] = []

    def engines_lost(reason: str) -> None:
        lost.append(reason)
        print(f"tito serve: {reason}: shutting down (exit status {EXIT_ENGINES_LOST}) so a supervisor can "
              "restart the server", file=sys.stderr, flush=True)
        server.should_exit = True

    ray_engines = [e for e in state.fleet.engines if not isinstance(e, LocalEngine)]
    healer = state.fleet.healer
    coming_back = (lambda i: healer.state[i] == "restarting") if healer is not None else None
    watch = EngineWatch(ray_engines, engines_lost, coming_back=coming_back).start() if ray_engines else None
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal it shut down on; the shutdown was clean
        pass
    finally:
        if watch is not None:
            watch.stop()
        _shutdown(state, actors, placement)
    if lost:
        raise SystemExit(EXIT_ENGINES_LOST)


class ServerThread:
    """uvicorn on ``host:port`` (0 = a free port) in a daemon thread; ``url`` once started; ``stop()`` ends it."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self.state = state
        self.server = uvicorn.Server(_uvicorn_config(create_app(state), host, port, log_level))
        self.thread = threading.Thread(target=self.server.run, name="tito-serve", daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
