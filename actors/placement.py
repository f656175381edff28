"""RayPlacement: ``tito run`` and ``tito serve`` start their engine and renderer actors on Ray through it.

It implements :class:`rollout.startup.Placement` with :func:`actors.engine.start_engine_actors` and
:func:`actors.renderer.start_renderer_actors`; the ``tito`` command (actors/cli.py) hands it down to
rollout/, which never imports actors/ itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout.engines.factory import EngineSpec
from rollout.startup import RendererSpec


class RayPlacement:
    """Engine and renderer actors on the Ray this process started or joined (rollout.startup.init_ray)."""

    def start_engines(self, specs: Sequence[EngineSpec]) -> list[Any]:
        from .engine import start_engine_actors  # imports Ray: only the commands that start actors pay for it

        return start_engine_actors(specs)

    def start_renderers(self, spec: RendererSpec) -> list[Any]:
        from .renderer import start_renderer_actors

        r = spec.renderer
        return start_renderer_actors(
            r.actors, spec.model_path, num_cpus=r.num_cpus, resources=dict(r.resources), renderer_name=r.name,
            template_kwargs=dict(r.template_kwargs), thinking_retention=r.thinking_retention, out_dir=spec.out_dir,
            fmt=spec.fmt, rows_per_file=spec.rows_per_file, flush_interval_s=spec.flush_interval_s,
            model_name=spec.model_name)
