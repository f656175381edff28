"""The typed renderer and engine handles: each implementation has exactly the Protocol's methods, an
in-process engine answers the admin calls its backend lacks, and the boundary Structs cross Ray (pickle)."""

from __future__ import annotations

import asyncio
import inspect
import pickle

import pytest

from actors.handles import RayEngine, RayRenderer
from rollout.engines.healer import Restartable
from rollout.engines.protocol import GenerateRequest, SamplingParams, Unsupported
from rollout.engines.replay import ReplayEngine
from rollout.handles import EngineHandle, LocalEngine, LocalRenderer, RendererHandle
from rollout.renderer_service import RendererService
from rollout.turns import Finished, NextPrompt, RolloutMeta, SampledTurn, Sampling, SegmentBreak


def _methods(cls: type) -> set[str]:
    return {name for name, fn in vars(cls).items() if inspect.isfunction(fn) and not name.startswith("_")}


@pytest.mark.parametrize(("protocols", "impl"), [((RendererHandle,), LocalRenderer), ((RendererHandle,), RayRenderer),
                                                 ((EngineHandle,), LocalEngine),
                                                 ((EngineHandle, Restartable), RayEngine)])
def test_every_handle_has_exactly_its_protocols_methods(protocols, impl):
    assert _methods(impl) == set().union(*map(_methods, protocols)), impl.__name__


def test_the_renderer_service_has_every_method_its_handles_call():
    assert _methods(RendererHandle) <= _methods(RendererService)


class _Minimal:
    """A backend with only the EngineBackend calls: no health, world_size or admin methods."""

    def __init__(self) -> None:
        self.inner = ReplayEngine(synthetic=True, vocab_size=100, max_model_len=64)

    async def generate(self, request):
        return await self.inner.generate(request)

    async def abort(self, request_id):
        return await self.inner.abort(request_id)


def test_a_local_engine_answers_what_its_backend_lacks():
    engine = LocalEngine(_Minimal())
    request = GenerateRequest("r0", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0))

    async def main():
        assert await engine.health() == {"ok": True}
        assert await engine.world_size() == 1
        assert await engine.drop_session("s") is None  # no KV kept per session: nothing to drop
        with pytest.raises(Unsupported, match="the _Minimal engine backend cannot reset prefix cache"):
            await engine.reset_prefix_cache()
        with pytest.raises(Unsupported, match="cannot sleep"):
            await engine.sleep(1)
        streamed = [item async for item in engine.generate_stream(request)]  # no stream: the output as one item
        assert len(streamed) == 1 and streamed[0].results[0].completion_ids

    asyncio.run(main())


def test_the_boundary_structs_pickle_and_next_prompt_joins_ids():
    brk = SegmentBreak(1, "history_edited", "message 2 differs")
    finished = Finished("r#0", RolloutMeta(task_id="t", group_id="g", messages=[{"role": "user", "content": "é"}],
                                           sampling=Sampling(temperature=0.5, seed=3)),
                        SampledTurn(0, [5, 6], [-0.1, -0.2], 2, {"role": "assistant", "content": "x"}))
    assert pickle.loads(pickle.dumps(finished)) == finished
    assert brk.to_dict() == {"turn": 1, "reason": "history_edited", "detail": "message 2 differs", "position": None}
    assert NextPrompt("append", [9]).after([1, 2], [3]) == [1, 2, 3, 9]
    assert NextPrompt("render", [7, 8], brk).after([1, 2], [3]) == [7, 8]
