"""An abort that overtakes its request still lands (fast, no Ray: real replay backends).

The fleet places a request (it is in ``Fleet.where``) before the engine has received it. On Ray the abort
travels in the actor's control concurrency group and can arrive first; the engine then ignores it, as vLLM
ignores an abort for an id it does not know, and the request ran to its length. Seen once in the e2e suite:
POST /sleep right after a request was placed, and the request finished "length", not "abort".

``LateEngine`` is a stand-in for that in-flight actor call, labelled as such: the replay engine receives
each generate call ``delay_s`` after the fleet made it. It cannot show Ray's own scheduling, only the order
of arrival that Ray allows; test_serve_admin.py shows the same path through real actors.
"""

from __future__ import annotations

import asyncio

from rollout.engines.protocol import GenerateOutput, GenerateRequest, SamplingParams
from rollout.engines.replay import ReplayEngine
from rollout.handles import LocalEngine
from rollout.serve.fleet import Fleet

TOKENS = 200


class LateEngine:
    """A paced replay engine (10 ms a token) whose generate calls arrive ``delay_s`` late."""

    def __init__(self, delay_s: float = 0.2) -> None:
        self.inner = ReplayEngine(synthetic=True, vocab_size=1000, max_model_len=512, token_delay_s=0.01)
        self.delay_s = delay_s
        self.aborts = 0

    def info(self):
        return self.inner.info()

    async def abort(self, request_id: str) -> bool:
        self.aborts += 1
        return await self.inner.abort(request_id)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        await asyncio.sleep(self.delay_s)
        return await self.inner.generate(request)


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=[1, 2, 3],
                           sampling=SamplingParams(max_tokens=TOKENS, ignore_eos=True))


async def _placed(fleet: Fleet, rid: str) -> None:
    while rid not in fleet.where:
        await asyncio.sleep(0.001)


def test_an_abort_sent_before_the_engine_has_the_request_still_aborts_it():
    engine = LateEngine()
    fleet = Fleet([LocalEngine(engine)], [engine.info()])

    async def main():
        running = asyncio.ensure_future(fleet.generate(_request("r1")))
        await _placed(fleet, "r1")
        assert await fleet.abort(["r1"]) == ["r1"]  # sent again until the engine had it
        out, _, _ = await running
        return out

    (result,) = asyncio.run(asyncio.wait_for(main(), 30)).results
    assert result.finish_reason == "abort" and len(result.completion_ids) < TOKENS
    assert engine.aborts >= 2  # the first abort found nothing: the engine had not received the request
    assert fleet.in_flight == 0


def test_an_abort_of_a_request_that_ends_first_returns_without_it():
    engine = LateEngine(delay_s=0.0)
    engine.inner.token_delay_s = 0.0
    fleet = Fleet([LocalEngine(engine)], [engine.info()])

    async def main():
        await fleet.generate(_request("done"))
        assert await fleet.abort(["done", "never-sent"]) == []  # neither is running: nothing is sent

    asyncio.run(asyncio.wait_for(main(), 30))
    assert engine.aborts == 0


def test_a_caller_gone_before_the_engine_has_the_request_aborts_it():
    """A client that hangs up at once (its wait is cancelled) stops the engine's work too: the result the
    fleet collects for it says "abort", not a full generation nobody reads."""
    engine = LateEngine()
    fleet = Fleet([LocalEngine(engine)], [engine.info()])
    collected: list[GenerateOutput] = []
    fleet.on_abandoned = collected.append

    async def main():
        caller = asyncio.ensure_future(fleet.generate(_request("gone")))
        await _placed(fleet, "gone")
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        while not collected:
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(main(), 30))
    (result,) = collected[0].results
    assert result.finish_reason == "abort" and len(result.completion_ids) < TOKENS
