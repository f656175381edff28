"""RayPlacement: ``tito run`` and ``tito serve`` start and stop their engine and renderer actors on Ray through it.

It implements :class:`rollout.startup.Placement` with :func:`actors.engine.start_engine_actors` and
:func:`actors.renderer.start_renderer_actors`; the ``tito`` command (actors/cli.py) hands it down to
rollout/, which never imports actors/ itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from rollout.engines.factory import EngineSpec
from rollout.engines.protocol import EngineInfo
from rollout.handles import EngineHandle, RendererHandle
from rollout.startup import RendererSpec

from .handles import RayEngine, RayRenderer


def _actor(handle: EngineHandle | RendererHandle) -> Any:
    """The Ray actor behind a handle this placement started."""
    if not isinstance(handle, (RayEngine, RayRenderer)):
        raise TypeError(f"{type(handle).__name__} is not a Ray actor's handle: RayPlacement did not start it")
    return handle.actor


class RayPlacement:
    """Engine and renderer actors on the Ray this process started or joined (rollout.startup.init_ray).
    Ray is imported on the first call: the commands that start no actor do not pay for it."""

    def start_engines(self, specs: Sequence[EngineSpec]) -> list[EngineHandle]:
        from .engine import start_engine_actors

        return list(start_engine_actors(specs))

    def engine_infos(self, engines: Sequence[EngineHandle]) -> list[EngineInfo]:
        import ray

        return ray.get([_actor(e).start.remote() for e in engines])

    def start_renderers(self, spec: RendererSpec) -> list[RendererHandle]:
        from .renderer import start_renderer_actors

        r = spec.renderer
        return list(start_renderer_actors(
            r.actors, spec.model_path, num_cpus=r.num_cpus, resources=dict(r.resources), renderer_name=r.name,
            template_kwargs=dict(r.template_kwargs), thinking_retention=r.thinking_retention, out_dir=spec.out_dir,
            fmt=spec.fmt, rows_per_file=spec.rows_per_file, flush_interval_s=spec.flush_interval_s,
            model_name=spec.model_name, start_timeout_s=r.start_timeout_s))

    def renderer_infos(self, renderers: Sequence[RendererHandle]) -> list[dict[str, Any]]:
        import ray

        return ray.get([_actor(r).info.remote() for r in renderers])

    def close_renderers(self, renderers: Sequence[RendererHandle],
                        timeout_s: float | None = None) -> list[dict[str, Any]]:
        import ray

        return ray.get([_actor(r).close.remote() for r in renderers], timeout=timeout_s)

    def stop(self, handles: Sequence[EngineHandle | RendererHandle]) -> None:
        import ray

        for handle in handles:
            with contextlib.suppress(Exception):  # already dead, or its Ray is gone: nothing left to stop
                ray.kill(_actor(handle))
