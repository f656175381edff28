"""Start-up shared by ``tito run`` and ``tito serve``: checks, Ray, the model, engine specs, the parser.

Both commands do the same steps in the same order; each step is one function here, typed on what their
configs share (:class:`~rollout.config.StartupConfig`):

1. :func:`preflight`, before anything loads: :func:`check_output_dir`, :func:`check_engine_config`,
   :func:`check_vllm_here` and :func:`fit_cpus`;
2. :func:`find_model`, :func:`engine_specs` and :func:`create_parser`;
3. :func:`init_ray` (a local Ray, or join ``ray.address``), then :func:`check_cluster_gpus` and
   :func:`wait_for_cluster_cpus` on a cluster;
4. the actors, through a :class:`Placement`: actors/placement.py puts them on Ray. rollout/ never imports
   actors/; the ``tito`` command (actors/cli.py) hands its placement down.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .engines.factory import DEFAULT_RESOURCES, EngineSpec, backend_class

if TYPE_CHECKING:  # pydantic and the shards' pyarrow load only where a command runs: `tito --version` stays quick
    from tito_renderers import Renderer

    from .config import EngineConfig, RayConfig, RendererConfig, StartupConfig
    from .engines.protocol import EngineInfo
    from .handles import EngineHandle, RendererHandle


@dataclass(frozen=True)
class RendererSpec:
    """What the renderer actors run: ``renderer.actors`` RendererServices on ``model_path``, each writing a
    shard stream into ``out_dir`` (None: nothing written), placed with ``renderer.num_cpus`` and
    ``renderer.resources``."""

    model_path: str
    renderer: RendererConfig
    model_name: str
    out_dir: str | None = None
    fmt: Literal["arrow", "parquet"] = "arrow"
    rows_per_file: int = 1024
    flush_interval_s: float | None = None


class Placement(Protocol):
    """Where ``tito run`` and ``tito serve`` start their actors, and the calls on them that only the placement
    can make: start-up info, the renderers' last flush, stopping (actors/placement.py: on Ray). The rollout
    loop and the routes call the handles themselves (rollout/handles.py)."""

    def start_engines(self, specs: Sequence[EngineSpec]) -> list[EngineHandle]:
        """Each spec's ``replicas`` engines, in order, once every backend is built (else this raises)."""
        ...

    def engine_infos(self, engines: Sequence[EngineHandle]) -> list[EngineInfo]: ...

    def start_renderers(self, spec: RendererSpec) -> list[RendererHandle]:
        """``spec.renderer.actors`` renderer services, in order; one that cannot start raises here."""
        ...

    def renderer_infos(self, renderers: Sequence[RendererHandle]) -> list[dict[str, Any]]: ...

    def close_renderers(self, renderers: Sequence[RendererHandle],
                        timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Flush and close each renderer: what ``RendererService.close`` returns (files, a write error)."""
        ...

    def stop(self, handles: Sequence[EngineHandle | RendererHandle]) -> None:
        """Stop these actors at once; one already gone is no error."""
        ...


# -- preflight: fail in seconds, with the reason, before anything loads ------------------------------------


def preflight(cfg: StartupConfig, out_dir: Path | None, *, engines_on_ray: bool = True) -> tuple[float | None, str | None]:
    """Step 1 of both commands: every check that needs nothing loaded, so a start that cannot work stops in
    seconds with the reason (a ValueError). ``out_dir``: where samples will be written (None: nowhere).
    Returns :func:`fit_cpus`'s answer for the local Ray about to start; ``(None, None)`` joined to a cluster
    (:func:`wait_for_cluster_cpus` checks there, once joined) or where the engines are not Ray actors."""
    import ray

    if out_dir is not None:
        check_output_dir(out_dir)
    check_engine_config(cfg.engine)
    if cfg.ray.address:
        return None, None
    check_vllm_here(cfg.engine)
    if ray.is_initialized() or not engines_on_ray:
        return None, None
    return fit_cpus(cfg, local_ray_cpus(cfg.ray))


def check_engine_config(engine: EngineConfig) -> None:
    """``engine.options`` against the chosen backend, and every section of ``engine.backend_options`` against its
    own backend, chosen or not: a typo there is an error now, not once someone switches the backend."""
    for backend, options in engine.backend_options.items():
        check_engine_options(backend, options, key=f"engine.backend_options.{backend}")
    check_engine_options(engine.backend, engine.options)
    check_weight_transfer(engine)


def check_weight_transfer(engine: EngineConfig) -> None:
    """``engine.weight_transfer`` against the backend, before anything starts: one line saying why it cannot be."""
    choice = engine.weight_transfer
    if choice == "none":
        return
    if engine.backend not in ("embedded", "vllm"):
        raise ValueError(f"engine.weight_transfer: {choice}: the {engine.backend} engine receives no weights over the "
                         "wire (the embedded and vllm engines do)")
    if engine.backend == "embedded" and choice == "nccl":
        raise ValueError("engine.weight_transfer: nccl is vLLM's own NCCL engine and needs engine.backend: vllm on CUDA "
                         "GPUs; the embedded engine receives over gloo (engine.weight_transfer: gloo)")
    if engine.backend == "vllm":
        from .engines.vllm_backend import vllm_platform

        if choice == "nccl" and vllm_platform() == "cpu":
            raise ValueError("engine.weight_transfer: nccl needs CUDA GPUs and this vLLM is its CPU build: NCCL "
                             "moves tensors between GPUs only; use the embedded engine with "
                             "engine.weight_transfer: gloo on CPU")
        if choice == "nccl":  # vLLM's own NCCL engine behind tito's routes: not wired yet (issue 42)
            raise ValueError("engine.weight_transfer: nccl is not yet available on the vllm backend in tito: use "
                             "gloo (received by tito's engine actor, swapped in by vLLM's in-place reload), or send "
                             "checkpoints (/update_weights weight_dir)")


def check_engine_options(backend: str, options: Mapping[str, Any], key: str = "engine.options") -> None:
    """Refuse options the backend's constructor does not take, naming them and the ones it does, before any
    engine starts (an actor would otherwise fail with a TypeError deep in its start-up)."""
    params = inspect.signature(backend_class(backend)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    allowed = sorted(n for n, p in params.items() if p.kind is not p.VAR_POSITIONAL)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{key}: {', '.join(unknown)} not an option of the {backend} backend "
                         f"(its options: {', '.join(allowed)})")


def engine_num_gpus(engine: EngineConfig) -> float | None:
    """GPUs per engine actor: the config's, else none on vLLM's CPU build (None: the kind's default)."""
    if engine.num_gpus is None and engine.backend == "vllm":
        from .engines.vllm_backend import vllm_platform

        if vllm_platform() == "cpu":
            return 0.0  # the engine actor holds one CPU, no GPU
    return engine.num_gpus


def check_vllm_here(engine: EngineConfig) -> None:
    """Before a local Ray starts: vLLM engines that could never start here (not installed, no GPU) are an
    error now, not an engine actor waiting forever for a GPU resource."""
    if engine.backend != "vllm":
        return
    from .engines.vllm_backend import local_vllm_problem

    if problem := local_vllm_problem():
        raise ValueError(problem)


def check_cluster_gpus(engine: EngineConfig) -> None:
    """Once joined to a cluster: vLLM engines need GPUs that the cluster has."""
    if engine.backend != "vllm":
        return
    from .engines.vllm_backend import cluster_gpu_problem

    if problem := cluster_gpu_problem(engine.count, engine_num_gpus(engine)):
        raise ValueError(problem)


def check_output_dir(out_dir: Path) -> None:
    """Refuse, before anything runs, an output directory the run could not create or write: the path of a
    file, a path under a file, a place nobody can write (``/proc``, a read-only mount, an immutable
    directory). A probe file is created and removed where the run's first file or directory will go
    (the directory itself, its ``data/``, or the nearest existing parent); nothing else is written."""
    from .data.shards import DATA_DIR

    where = f"output.dir {out_dir}"
    probe_in = out_dir
    try:
        while not probe_in.exists() and probe_in != probe_in.parent:
            probe_in = probe_in.parent
    except OSError as exc:  # e.g. a parent that cannot be searched
        raise ValueError(f"{where}: cannot look at {probe_in}: {exc.strerror}") from None
    if not probe_in.is_dir():
        what = "is a file" if probe_in == out_dir else f"is under {probe_in}, a file"
        raise ValueError(f"{where}: {what}, not a directory; choose another output.dir (--out)")
    targets = [probe_in] + [out_dir / DATA_DIR] * (out_dir / DATA_DIR).is_dir()
    for directory in targets:
        try:
            before = directory.stat()
            fd, probe = tempfile.mkstemp(prefix=".tito-write-probe-", dir=directory)
            os.close(fd)
            os.unlink(probe)
            # the directory's times as they were: a run refused later (a resume with another config) changed nothing
            os.utime(directory, ns=(before.st_atime_ns, before.st_mtime_ns))
        except OSError as exc:
            raise ValueError(f"{where}: cannot write in {directory}: {exc.strerror}; choose another output.dir "
                             "(--out)") from None


# -- Ray CPUs: the actors must fit, else Ray never places them and the run waits forever ---------------------

# Ray places an actor only where its CPUs are free; quantities below 1 go in steps of 1/10000
_RAY_CPU_STEP = 1e-4
# joining a cluster (--address), how long nodes may take to join before a run that cannot be placed stops
CLUSTER_CPU_WAIT_S = 60.0


def local_ray_cpus(ray_cfg: RayConfig) -> int:
    """The CPUs a local Ray gets: ``ray.num_cpus``, else this machine's."""
    return ray_cfg.num_cpus or os.cpu_count() or 1


def _cpus_needed(cfg: StartupConfig, engine_cpus: float) -> tuple[float, str]:
    """The CPUs every actor holds, and how they add up (for messages)."""
    n, r, r_cpus = cfg.engine.count, cfg.renderer.actors, cfg.renderer.num_cpus
    need = n * engine_cpus + r * r_cpus
    return need, f"{n} engine actor(s) x {engine_cpus:g} + {r} renderer actor(s) x {r_cpus:g} = {need:g} CPUs"


def _config_engine_cpus(engine: EngineConfig) -> float:
    """CPUs per engine actor as the config says: ``engine.num_cpus``, else the backend's default."""
    return engine.num_cpus if engine.num_cpus is not None else DEFAULT_RESOURCES[engine.backend]["num_cpus"]


def fit_cpus(cfg: StartupConfig, available: float) -> tuple[float | None, str | None]:
    """CPUs per engine actor such that every actor can be placed on ``available`` Ray CPUs (a local Ray):
    ``(None, None)`` where the config's already fit. Where ``engine.num_cpus`` is unset, the engines share
    what the renderer actors leave, in equal parts (``(share, a note saying so)``); otherwise, or where no
    share is left, a ValueError with the numbers and what to set. Without this Ray never places the actors
    it has no CPUs for, and the run waits forever at 0 rollouts."""
    per_engine = _config_engine_cpus(cfg.engine)
    need, sums = _cpus_needed(cfg, per_engine)
    if need <= available + _RAY_CPU_STEP / 2:
        return None, None
    left = available - cfg.renderer.actors * cfg.renderer.num_cpus
    share = min(int(left / cfg.engine.count / _RAY_CPU_STEP) * _RAY_CPU_STEP, per_engine)
    if cfg.engine.num_cpus is None and share > 0:
        return share, (f"the actors would need {sums} and the local Ray has {available:g}: each engine actor "
                       f"takes {share:g} CPU (set engine.num_cpus or ray.num_cpus to choose)")
    fix = (f"--set engine.num_cpus={share:g}" if share > 0 else
           f"fewer renderer actors or a smaller renderer.num_cpus (the renderers alone need "
           f"{cfg.renderer.actors * cfg.renderer.num_cpus:g})")
    raise ValueError(f"the actors need {sums} but the local Ray has {available:g} CPUs (ray.num_cpus, default: "
                     f"this machine's): they would wait forever; use {fix}, or raise ray.num_cpus")


def wait_for_cluster_cpus(cfg: StartupConfig, engine_cpus: float | None,
                          note: Callable[[str], None] | None) -> None:
    """Joined to a cluster (or a Ray started before the run): wait up to :data:`CLUSTER_CPU_WAIT_S` for its
    CPUs to hold every actor (nodes may still be joining), then stop with the numbers. A total that suffices
    can still fail to place an actor whose CPUs no single node has free; that is Ray's to report.
    ``engine_cpus``: :func:`fit_cpus`'s share where it gave one, else None (the config's CPUs per engine)."""
    import ray

    need, sums = _cpus_needed(cfg, engine_cpus if engine_cpus is not None else _config_engine_cpus(cfg.engine))
    deadline = time.monotonic() + (CLUSTER_CPU_WAIT_S if cfg.ray.address else 0.0)
    while (have := ray.cluster_resources().get("CPU", 0.0)) < need - _RAY_CPU_STEP / 2:
        if time.monotonic() >= deadline:
            waited = f" after waiting {CLUSTER_CPU_WAIT_S:g} s for nodes" if cfg.ray.address else ""
            raise ValueError(f"the actors need {sums} but the Ray cluster has {have:g} CPUs{waited}: add nodes, "
                             "or lower engine.num_cpus, renderer.num_cpus, engine.count or renderer.actors")
        if note is not None:
            note(f"waiting for the cluster's CPUs: {have:g} of the {need:g} the actors need ({sums})")
            note = None
        time.sleep(1.0)


# -- the model, the engines' specs, the parser and the renderers' spec ----------------------------------------


def find_model(name: str) -> Path:
    """The model's file or directory; an alias that is not here yet is fetched first (the demo's first run)."""
    from .models import ALIASES, ModelNotFound, pull_model, resolve_model

    try:
        return resolve_model(name)
    except ModelNotFound:
        if name not in ALIASES:
            raise
        return pull_model(name)


def engine_specs(engine: EngineConfig, model_path: str, num_cpus: float | None = None) -> list[EngineSpec]:
    """The engine actors' specs; ``num_cpus`` replaces the config's CPUs per engine (see :func:`fit_cpus`).
    Check the options first with :func:`check_engine_config`."""
    options = engine.backend_kwargs
    if engine.backend == "embedded":
        options.setdefault("model", model_path)
    elif engine.backend == "vllm":
        from .models import model_dir

        # vLLM loads a safetensors directory: a GGUF (the default model) is converted once into the cache
        options.setdefault("model", str(model_dir(model_path)))
    if engine.weight_transfer != "none":
        options.update(weight_transfer=engine.weight_transfer, weight_transfer_timeout_s=engine.weight_transfer_timeout_s)
    return [EngineSpec(kind=engine.backend, kwargs=options, max_concurrency=engine.max_concurrency,
                       replicas=engine.count, num_cpus=engine.num_cpus if num_cpus is None else num_cpus,
                       num_gpus=engine_num_gpus(engine), placement=engine.placement,
                       custom_resources=dict(engine.resources), max_restarts=engine.max_restarts)]


def create_parser(renderer: RendererConfig, model_path: str) -> Renderer:
    """The renderer the driver (run) or the routes (serve) parse completions with: the same family, options
    and tokenizer as the renderer actors'."""
    from tito_renderers import create_renderer, load_tokenizer

    return create_renderer(load_tokenizer(model_path), name=renderer.name,
                           thinking_retention=renderer.thinking_retention, **renderer.template_kwargs)


# -- Ray ---------------------------------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()  # signal handlers are set only there


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """While Ray starts its processes: a SIGINT/SIGTERM is noted, and raised again once ``ray.init`` has
    returned, for the handler in place before (``tito run``'s raises RunInterrupted). Cut short half-way,
    ``ray.init`` leaves the processes it already started running without a driver (for minutes); whole,
    Ray's shutdown stops every one of them. Ray's own SIGTERM handler (``sys.exit`` mid-start, exit status
    15) is not installed for the same reason. Only in the main thread."""
    if not in_main_thread():
        yield
        return
    import ray._private.utils as ray_utils  # Ray's hook for its driver SIGTERM handler

    noted: list[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: noted.append(signum)) for s in STOP_SIGNALS}
    ray_sets_handler = getattr(ray_utils, "set_sigterm_handler", None)
    if ray_sets_handler is not None:
        ray_utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        if ray_sets_handler is not None:
            ray_utils.set_sigterm_handler = ray_sets_handler
        for s, h in old.items():
            signal.signal(s, h)
    if noted:
        signal.raise_signal(noted[0])  # the handler runs here, in this thread, before raise_signal returns


def init_ray(ray_cfg: RayConfig, *, defer_signals: bool = False) -> None:
    """Start a local Ray (``ray.num_cpus`` CPUs) or join ``ray.address``; nothing where Ray is up already.
    ``defer_signals`` (``tito run``): see :func:`signals_deferred`."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    with signals_deferred() if defer_signals else contextlib.nullcontext():
        if ray_cfg.address:
            ray.init(address=ray_cfg.address, log_to_driver=False)
        else:
            ray.init(address="local", num_cpus=local_ray_cpus(ray_cfg), include_dashboard=False, log_to_driver=False)
