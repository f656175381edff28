"""The typed handles of rollout/handles.py on Ray: each call is ``await actor.method.remote(...)``.

:func:`actors.renderer.start_renderer_actors` and :func:`actors.engine.start_engine_actors` return these.
``actor`` is the Ray actor handle itself, for what only Ray does with it (start, close, ``ray.kill``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from rollout.engines.protocol import GenerateOutput, GenerateRequest, SchedulerStats
from rollout.turns import Finished, NextPrompt, RolloutMeta, SampledTurn

_encode_request = msgspec.json.Encoder().encode


class RayRenderer:
    """A RendererActor (actors/renderer.py)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def begin(self, rollout_id: str, messages: list[dict], tools: list[dict] | None) -> NextPrompt:
        return await self.actor.begin.remote(rollout_id, messages, tools)

    async def extend(self, rollout_id: str, turn: SampledTurn, new_messages: list[dict]) -> NextPrompt:
        return await self.actor.extend.remote(rollout_id, turn, new_messages)

    async def bridge_next(self, rollout_id: str, new_messages: list[dict], next_turn: int) -> NextPrompt:
        return await self.actor.bridge_next.remote(rollout_id, new_messages, next_turn)

    async def restart(self, rollout_id: str, messages: list[dict], tools: list[dict] | None, turn: int,
                      reason: str, detail: str) -> NextPrompt:
        return await self.actor.restart.remote(rollout_id, messages, tools, turn, reason, detail)

    async def record_turn(self, rollout_id: str, turn: SampledTurn) -> None:
        await self.actor.record_turn.remote(rollout_id, turn)

    async def sample(self, rollout_id: str) -> dict[str, Any]:
        return await self.actor.sample.remote(rollout_id)

    async def finish(self, rollout_id: str, meta: RolloutMeta, last_turn: SampledTurn | None = None) -> int:
        return await self.actor.finish.remote(rollout_id, meta, last_turn)

    async def finish_group(self, items: list[Finished], out_dir: str | None = None) -> int:
        return await self.actor.finish_group.remote(items, out_dir)

    async def close_output(self, out_dir: str) -> dict:
        return await self.actor.close_output.remote(out_dir)

    async def discard(self, rollout_id: str) -> None:
        await self.actor.discard.remote(rollout_id)

    async def flush(self) -> list[dict]:
        return await self.actor.flush.remote()


class RayEngine:
    """An EngineActor (actors/engine.py). Requests go as msgspec JSON bytes, which the actor decodes
    strictly: cheaper through Ray than a pickled Struct."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        return await self.actor.generate.remote(_encode_request(request))

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[Any]:
        refs = self.actor.generate_stream.options(num_returns="streaming").remote(_encode_request(request))
        async for ref in refs:
            yield await ref

    async def abort(self, request_id: str) -> bool:
        return await self.actor.abort.remote(request_id)

    async def update_weights(self, path: str, version: int, *, keep_running: bool = False) -> None:
        await self.actor.update_weights.remote(path, version, keep_running)

    async def validate_weights(self, path: str) -> dict[str, Any]:
        return await self.actor.validate_weights.remote(path)

    async def health(self) -> dict[str, Any]:
        return await self.actor.health.remote()

    async def world_size(self) -> int:
        return int(await self.actor.world_size.remote())

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return bool(await self.actor.reset_prefix_cache.remote(reset_running_requests))

    async def sleep(self, level: int = 1) -> None:
        await self.actor.sleep.remote(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.actor.wake_up.remote(tags)

    async def drop_session(self, session_id: str) -> None:
        await self.actor.drop_session.remote(session_id)

    async def load_lora_adapter(self, name: str, path: str, version: int | None = None) -> int:
        return await self.actor.load_lora_adapter.remote(name, path, version)

    async def unload_lora_adapter(self, name: str) -> None:
        await self.actor.unload_lora_adapter.remote(name)

    async def scheduler_stats(self) -> SchedulerStats | None:
        return await self.actor.scheduler_stats.remote()

    async def weight_transfer(self, op: str, *args: Any) -> Any:
        return await self.actor.weight_transfer.remote(op, *args)

    # -- restarts (rollout/engines/healer.py's Restartable) --------------------------------------------------

    def kill(self) -> None:
        """Kill the actor's process; Ray restarts it (while it has restarts left)."""
        import ray

        ray.kill(self.actor, no_restart=False)

    async def restarted(self) -> Any:
        """The restarted actor's EngineInfo, once its backend is built again."""
        return await self.actor.start.remote()

    async def rejoin(self) -> None:
        await self.actor.rejoin.remote()
