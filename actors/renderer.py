"""RendererActor: ``rollout.renderer_service.RendererService`` on Ray.

One actor holds a tokenizer and renderer, the running rollouts' segments, its own shard stream and
the shared break log. It is a plain (threaded) actor with ``max_concurrency=1``: a render or bridge
takes well under a millisecond, so calls simply queue, and the service's caches need no locking.
Several actors run side by side for throughput; each rollout stays on the actor that began it.
"""

from __future__ import annotations

from typing import Any

import ray

from rollout.renderer_service import RendererService
from rollout.shards import STREAM

RendererActor = ray.remote(max_concurrency=1, max_restarts=0, enable_task_events=False)(RendererService)


def start_renderer_actors(n: int, model_path: str, *, num_cpus: float = 0.25, **kwargs: Any) -> list[Any]:
    """``n`` renderer actors writing shard streams ``train-r0``, ``train-r1``, ... into one directory
    (``OUT/data/``). Every public method of the service is an actor method, ``flush`` included:
    ``tito serve`` calls ``actor.flush.remote()`` after a session's ``finish`` to write it at once."""
    return [
        RendererActor.options(num_cpus=num_cpus, name=None).remote(model_path, stream=f"{STREAM}-r{i}", **kwargs)
        for i in range(n)
    ]
