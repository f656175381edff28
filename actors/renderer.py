"""RendererActor: ``rollout.renderer_service.RendererService`` on Ray.

One actor holds a tokenizer and renderer, the running rollouts' segments, its own shard stream and
the shared break log. It is a plain (threaded) actor with ``max_concurrency=1``: a render or bridge
takes well under a millisecond, so calls simply queue, and the service's caches need no locking.
Several actors run side by side for throughput; each rollout stays on the actor that began it.

On a cluster the actors write their shards themselves, on whichever node Ray placed them (the
config's ``renderer.num_cpus`` / ``renderer.resources`` choose it): ``OUT`` must be storage that the
driver and those nodes share (NFS, a cluster file system), since the driver reads the shards back for
the manifest. :func:`start_renderer_actors` checks that before the run starts: the driver writes a
probe file into ``OUT`` and every actor must read it back.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Any

import ray

from rollout.data.shards import STREAM
from rollout.handles import RendererHung
from rollout.renderer_service import RendererService

from .handles import RayRenderer

PROBE_PREFIX = ".tito-shared-probe-"


class NotSharedStorage(ValueError):
    """A renderer actor cannot see the driver's output directory: it runs on a node without that storage."""


class PlacedRendererService(RendererService):
    """The service plus two questions only an actor on a cluster needs answered: where it runs, and
    whether it sees the driver's files."""

    def node_id(self) -> str | None:
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def reads_probe(self, path: str, token: str) -> bool:
        with contextlib.suppress(OSError):
            return Path(path).read_text() == token
        return False


RendererActor = ray.remote(max_concurrency=1, max_restarts=0, enable_task_events=False)(PlacedRendererService)


def start_renderer_actors(n: int, model_path: str, *, num_cpus: float = 0.25, resources: dict[str, float] | None = None,
                          start_timeout_s: float | None = None, **kwargs: Any) -> list[RayRenderer]:
    """``n`` renderer actors writing shard streams ``train-r0``, ``train-r1``, ... into one directory
    (``OUT/data/``), as typed handles (actors/handles.py; ``.actor`` is the Ray actor). Every public method
    of the service is an actor method, ``flush`` included: ``tito serve`` calls ``renderer.flush()`` after a
    session's ``finish`` to write it at once.

    ``num_cpus`` and ``resources`` (custom Ray resources, e.g. ``{"storage_node": 1}``) place them. With an
    ``out_dir``, each actor must see a probe file the driver writes there, else :class:`NotSharedStorage`
    (the actors are killed first) rather than shards written where the driver never finds them. That probe
    waits at most ``start_timeout_s`` for the actors to be placed and built: past it, :class:`RendererHung`
    names them (no node has the resources asked for, or the actor is stopped or wedged)."""
    opts: dict[str, Any] = {"num_cpus": num_cpus}
    if resources:
        opts["resources"] = dict(resources)
    actors = [RendererActor.options(**opts).remote(model_path, stream=f"{STREAM}-r{i}", **kwargs) for i in range(n)]
    out_dir = kwargs.get("out_dir")
    if out_dir:
        try:
            check_shared_storage(actors, out_dir, timeout_s=start_timeout_s)
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
    return [RayRenderer(a) for a in actors]


def check_shared_storage(actors: list[Any], out_dir: str, timeout_s: float | None = None) -> None:
    """Raise :class:`NotSharedStorage` naming the node of each actor that cannot read a probe file written
    into ``out_dir`` here (the driver's view of it)."""
    token = secrets.token_hex(16)
    probe = Path(out_dir) / f"{PROBE_PREFIX}{token}"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text(token)
    try:
        try:
            seen = ray.get([a.reads_probe.remote(str(probe), token) for a in actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise RendererHung(
                f"the renderer actor(s) did not start within renderer.start_timeout_s {timeout_s:g} (not placed: "
                "no node has the renderer.num_cpus and renderer.resources free, or stopped or hung while loading the "
                "tokenizer)") from None
        blind = [i for i, ok in enumerate(seen) if not ok]
        if blind:
            nodes = ray.get([actors[i].node_id.remote() for i in blind])
            here = ray.get_runtime_context().get_node_id()
            raise NotSharedStorage(
                f"output dir {out_dir} is not shared with the renderer actor(s) {blind} on node(s) {nodes} (the "
                f"driver runs on node {here}): those actors write the shards, so put the output dir on storage "
                "every node mounts at the same path, or place the renderers on the driver's node "
                "(renderer.resources)")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
