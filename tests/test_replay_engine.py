"""ReplayEngine: recorded completions served by exact prompt ids, plus the conformance suite in synthetic mode."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout.engines.protocol import EngineBackend, EngineError, GenerateRequest, SamplingParams
from rollout.engines.replay import (
    ReplayEngine,
    ReplayRecord,
    dump_records,
    load_records,
    prompt_hash,
    records_from_output,
)
from tests.engine_conformance import conformance_tests


def _synthetic() -> ReplayEngine:
    return ReplayEngine(vocab_size=1000, max_model_len=512, eos_token_ids=[2], synthetic=True, token_delay_s=0.001)


TestReplayConformance = conformance_tests(_synthetic, weights_path="/any/path/the/replay/engine/ignores")

PROMPT = [5, 6, 7]
REC = ReplayRecord(
    prompt_ids=PROMPT,
    completion_ids=[10, 11, 12, 2],
    logprobs=[-0.1, -0.2, -0.3, -0.4],
    finish_reason="stop",
    stop_token_id=2,
)


def req(prompt=PROMPT, rid="r", **sampling) -> GenerateRequest:
    sampling.setdefault("max_tokens", 16)
    return GenerateRequest(request_id=rid, prompt_ids=list(prompt), sampling=SamplingParams(**sampling))


def run(coro):
    return asyncio.run(coro)


def test_is_an_engine_backend():
    assert isinstance(ReplayEngine(), EngineBackend)


def test_replays_recorded_completion_exactly():
    eng = ReplayEngine([REC], vocab_size=100)
    out = run(eng.generate(req(stop_token_ids=(2,))))
    (r,) = out.results
    assert (r.completion_ids, r.logprobs, r.finish_reason, r.stop_token_id) == (
        [10, 11, 12, 2],
        [-0.1, -0.2, -0.3, -0.4],
        "stop",
        2,
    )
    assert out.prompt_len == 3 and r.cached_prompt_tokens == 0 and r.weight_version == 0


def test_missing_prompt_names_length_and_hash():
    eng = ReplayEngine([REC], vocab_size=100)
    with pytest.raises(EngineError) as exc:
        run(eng.generate(req(prompt=[1, 2, 3, 4], rid="missing")))
    msg = str(exc.value)
    assert "missing" in msg and "4 tokens" in msg and prompt_hash([1, 2, 3, 4]) in msg
    assert prompt_hash([1, 2, 3, 4]) != prompt_hash([1, 2, 3]) and len(prompt_hash([1])) == 16


def test_max_tokens_truncates_with_length():
    eng = ReplayEngine([REC], vocab_size=100)
    (r,) = run(eng.generate(req(max_tokens=2))).results
    assert r.completion_ids == [10, 11] and r.logprobs == [-0.1, -0.2]
    assert r.finish_reason == "length" and r.stop_token_id is None


def test_stop_ids_cut_at_first_occurrence_unless_ignore_eos():
    eng = ReplayEngine([REC], vocab_size=100, order="first")
    (r,) = run(eng.generate(req(stop_token_ids=(12, 11)))).results
    assert r.completion_ids == [10, 11] and r.finish_reason == "stop" and r.stop_token_id == 11
    (r,) = run(eng.generate(req(stop_token_ids=(11,), ignore_eos=True))).results
    assert r.completion_ids == [10, 11, 12, 2] and r.finish_reason == "stop" and r.stop_token_id == 2


def test_records_for_one_prompt_served_in_order_and_n():
    recs = [ReplayRecord(prompt_ids=PROMPT, completion_ids=[i], finish_reason="length") for i in range(3)]
    eng = ReplayEngine(recs, vocab_size=100)
    got = [run(eng.generate(req(rid=f"r{i}"))).results[0].completion_ids for i in range(4)]
    assert got == [[0], [1], [2], [0]]
    out = run(eng.generate(req(n=3)))
    assert [r.completion_ids for r in out.results] == [[1], [2], [0]]
    first = ReplayEngine(recs, vocab_size=100, order="first")
    assert [run(first.generate(req())).results[0].completion_ids for _ in range(2)] == [[0], [0]]


def test_jsonl_roundtrip_and_unknown_fields(tmp_path):
    path = tmp_path / "recs.jsonl"
    dump_records([REC], path)
    line = json.loads(path.read_text().splitlines()[0])
    line["reward"] = 1.0  # richer logs load too
    path.write_text(json.dumps(line) + "\n\n")
    assert load_records(path) == [REC]
    eng = ReplayEngine.from_jsonl(path, vocab_size=100)
    assert run(eng.generate(req())).results[0].completion_ids == REC.completion_ids
    path.write_text('{"prompt_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"recs.jsonl:1"):
        load_records(path)


def test_records_from_output_reproduce_a_run():
    synth = ReplayEngine(vocab_size=100, synthetic=True)
    request = req(temperature=1.0, seed=3, n=2, max_tokens=5)
    out = run(synth.generate(request))
    replay = ReplayEngine(records_from_output(request, out), vocab_size=100)
    assert [r.completion_ids for r in run(replay.generate(request)).results] == [r.completion_ids for r in out.results]


def test_strict_is_default_and_record_validation():
    assert ReplayEngine().synthetic is False
    with pytest.raises(ValueError, match="2 logprobs for 1"):
        ReplayEngine([ReplayRecord(prompt_ids=[1], completion_ids=[2], logprobs=[-1.0, -2.0])])
    with pytest.raises(ValueError, match="order"):
        ReplayEngine(order="random")


def test_abort_with_pacing_returns_partial_and_weight_version():
    async def main():
        eng = ReplayEngine(
            [ReplayRecord(prompt_ids=PROMPT, completion_ids=list(range(50, 90)), finish_reason="length")],
            vocab_size=100,
            token_delay_s=0.01,
        )
        await eng.update_weights("/nowhere", 7)
        task = asyncio.ensure_future(eng.generate(req(rid="long", max_tokens=40)))
        await asyncio.sleep(0.05)
        assert await eng.abort("long") is True
        out = await task
        assert await eng.abort("long") is False
        return out

    (r,) = run(main()).results
    assert r.finish_reason == "abort" and 0 < len(r.completion_ids) < 40 and r.weight_version == 7
    assert r.completion_ids == list(range(50, 50 + len(r.completion_ids)))


def test_duplicate_running_request_id_refused():
    async def main():
        eng = ReplayEngine(vocab_size=100, synthetic=True, token_delay_s=0.005)
        task = asyncio.ensure_future(eng.generate(req(rid="dup", max_tokens=20)))
        await asyncio.sleep(0.01)
        with pytest.raises(EngineError, match="already running"):
            await eng.generate(req(rid="dup"))
        return await task

    assert len(run(main()).results[0].completion_ids) == 20


class _Flawed(ReplayEngine):
    """A replay engine with one deliberate protocol violation: the suite must catch each."""

    def __init__(self, flaw: str) -> None:
        super().__init__(vocab_size=1000, max_model_len=256, synthetic=True, token_delay_s=0.0005)
        self.flaw = flaw
        self.conformance_weights_path = "/x"

    async def generate(self, request):
        import msgspec

        from rollout.engines.protocol import GenerateOutput

        if self.flaw == "ignores_stop_ids":
            sampling = msgspec.structs.replace(request.sampling, stop_token_ids=())
            request = msgspec.structs.replace(request, sampling=sampling)
        if self.flaw == "accepts_empty_prompt" and not request.prompt_ids:
            return GenerateOutput(request.request_id, 0, [])
        out = await super().generate(request)
        for r in out.results:
            if self.flaw == "positive_logprobs":
                r.logprobs = [0.5] * len(r.completion_ids)
            if self.flaw == "stale_weight_version":
                r.weight_version = 0
            if self.flaw == "overshoots_max_tokens" and r.finish_reason == "length":
                r.completion_ids = r.completion_ids + [1]
        return out

    async def abort(self, request_id):
        return False if self.flaw == "cannot_abort" else await super().abort(request_id)


@pytest.mark.parametrize(
    "flaw, check",
    [
        ("ignores_stop_ids", "stop_tokens"),
        ("accepts_empty_prompt", "bad_input"),
        ("positive_logprobs", "logprobs"),
        ("stale_weight_version", "weight_version"),
        ("cannot_abort", "abort"),
        ("overshoots_max_tokens", "max_tokens"),
    ],
)
def test_conformance_suite_catches_flawed_backends(flaw, check):
    from tests.engine_conformance import CONFORMANCE_CHECKS

    with pytest.raises(AssertionError):
        run(CONFORMANCE_CHECKS[check](_Flawed(flaw)))
    run(CONFORMANCE_CHECKS[check](_Flawed("none")))  # the same check passes without the flaw
