"""Fleet when an engine dies (fast, no Ray cluster: real replay backends, one of which dies the way a Ray actor
does, raising ``ray.exceptions.ActorDiedError``): the request it held is sent again to a live engine, a
stream too while it has yielded nothing, a stream cut mid-way fails with EngineUnavailable, the dead engine
gets no more requests, /health's probe marks it dead, and with no engine left the request is a 503.
The same on a real multi-node cluster is in test_scale_out.py."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions

from rollout.engines.protocol import GenerateOutput, GenerateRequest, SamplingParams
from rollout.engines.replay import ReplayEngine
from rollout.engines.streaming import StreamDelta
from rollout.handles import LocalEngine
from rollout.serve.fleet import EngineUnavailable, Fleet

VOCAB = 1000


class DyingEngine:
    """A replay engine whose actor "dies" (every call raises ActorDiedError) once ``dead`` is set; its stream
    can also die after ``die_after`` deltas."""

    def __init__(self, die_after: int | None = None) -> None:
        self.inner = ReplayEngine(synthetic=True, vocab_size=VOCAB, max_model_len=256)
        self.dead = False
        self.die_after = die_after
        self.calls = 0

    def info(self):
        return self.inner.info()

    async def abort(self, request_id: str) -> bool:
        return await self.inner.abort(request_id)

    def _check(self) -> None:
        self.calls += 1
        if self.dead:
            raise ray.exceptions.ActorDiedError()

    async def health(self) -> dict:
        self._check()
        return await self.inner.health()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self._check()
        return await self.inner.generate(request)

    async def generate_stream(self, request: GenerateRequest):
        self._check()
        deltas = 0
        async for item in self.inner.generate_stream(request):
            if self.die_after is not None and isinstance(item, StreamDelta) and deltas == self.die_after:
                raise ray.exceptions.ActorDiedError()
            deltas += isinstance(item, StreamDelta)
            yield item


def _fleet(*engines: DyingEngine) -> Fleet:
    return Fleet([LocalEngine(e) for e in engines], [e.info() for e in engines])


def _request(rid: str, max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=max_tokens))


def test_a_dead_engines_request_runs_on_a_live_one():
    first, second = DyingEngine(), DyingEngine()
    fleet = _fleet(first, second)

    async def main():
        first.dead = True  # idle engines: the least loaded is engine 0, the dead one
        out, _, index = await fleet.generate(_request("r1"))
        assert index == 1 and len(out.results[0].completion_ids) == 4
        calls = first.calls
        for i in range(3):  # dropped from routing: never asked again
            assert (await fleet.generate(_request(f"r{i + 2}")))[2] == 1
        assert first.calls == calls and fleet.dead == {0} and fleet.reroutes == 1 and fleet.alive == 1
        assert fleet.in_flight == 0 and fleet.router.load[1] == 0

    asyncio.run(main())


def test_a_stream_is_resent_before_its_first_token_and_fails_after():
    async def collect(fleet: Fleet, rid: str) -> tuple[list, tuple]:
        items = [item async for item in fleet.generate_stream(_request(rid, 6))]
        return items[:-1], items[-1]

    async def main():
        first, second = DyingEngine(), DyingEngine()
        fleet = _fleet(first, second)
        first.dead = True
        deltas, (out, _, index) = await collect(fleet, "s1")
        assert index == 1 and sum(len(d.token_ids) for d in deltas) == 6 == len(out.results[0].completion_ids)

        # an engine that dies after two deltas: the client holds tokens of that attempt, so no re-send
        cut, spare = DyingEngine(die_after=2), DyingEngine()
        fleet = _fleet(cut, spare)
        with pytest.raises(EngineUnavailable, match="died mid-stream"):
            await collect(fleet, "s2")
        assert fleet.dead == {0} and spare.calls == 0 and fleet.in_flight == 0

    asyncio.run(main())


def test_health_marks_a_dead_engine_and_no_engine_left_is_unavailable():
    first, second = DyingEngine(), DyingEngine()
    fleet = _fleet(first, second)

    async def main():
        second.dead = True
        reports = await fleet.health()
        assert [r["ok"] for r in reports] == [True, False] and fleet.dead == {1}
        first.dead = True
        with pytest.raises(EngineUnavailable, match="no engine is alive"):
            await fleet.generate(_request("last"))
        with pytest.raises(EngineUnavailable, match="no engine is alive"):
            await fleet.generate(_request("after"))
        assert fleet.in_flight == 0

    asyncio.run(main())
