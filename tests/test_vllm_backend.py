"""VLLMEngine against the vLLM STAND-IN (tests/vllm_standin.py) — not against vLLM.

vLLM cannot run on these machines; the stand-in has vLLM 0.33's method names and output shapes, so these tests
cover the backend's logic up to the vLLM call: what it sends (engine args, sampling params, token prompts, cache
salts, the weight-update sequence) and how it maps what comes back. The real conformance suite runs on a GPU via
scripts/gpu_check.sh (tests/test_vllm_gpu.py).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from rollout.engines.protocol import EngineError, GenerateRequest, SamplingParams
from tests import vllm_standin
from tests.engine_conformance import conformance_tests


@pytest.fixture(scope="module", autouse=True)
def standin():
    vllm_standin.install()
    yield vllm_standin
    vllm_standin.uninstall()


def _make_backend():
    from rollout.engines.vllm_backend import VLLMEngine

    return VLLMEngine("standin/model", max_model_len=512)


TestVLLMStandinConformance = conformance_tests(_make_backend, weights_path="/ckpt/step-1")


def req(prompt=(5, 6, 7, 8), rid="r", **sampling) -> GenerateRequest:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=rid, prompt_ids=list(prompt), sampling=SamplingParams(**sampling))


@pytest.fixture
def arun():
    with asyncio.Runner() as runner:
        yield runner.run


@pytest.fixture
def engine(arun):
    from rollout.engines.vllm_backend import VLLMEngine

    async def make():
        return VLLMEngine("standin/model", max_model_len=512, engine_args={"tensor_parallel_size": 1})

    eng = arun(make())
    yield eng
    eng.close()


def test_module_imports_without_vllm():
    code = (
        "import sys; import rollout.engines.vllm_backend as m; assert 'vllm' not in sys.modules; "
        "from rollout.engines.vllm_backend import VLLMEngine\n"
        "try:\n    VLLMEngine('x')\nexcept ImportError as e:\n    assert 'vllm' in str(e); print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_engine_args_tokens_only_prefix_caching_processed_logprobs(engine):
    args = engine._engine.engine_args
    assert args.skip_tokenizer_init is True and args.enable_prefix_caching is True
    assert args.logprobs_mode == "processed_logprobs" and args.max_logprobs >= 1
    assert args.max_model_len == 512 and args.tensor_parallel_size == 1
    info = engine.info()
    assert (info.backend, info.vocab_size, info.max_model_len, info.eos_token_ids) == ("vllm", 1000, 512, [2])


def test_forced_engine_args_cannot_be_overridden():
    from rollout.engines.vllm_backend import VLLMEngine

    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        VLLMEngine("m", engine_args={"skip_tokenizer_init": False})
    with pytest.raises(TypeError, match="not_a_field"):
        VLLMEngine("m", engine_args={"not_a_field": 1})


def test_request_sent_tokens_only_with_explicit_settings(engine, arun):
    arun(engine.generate(req(rid="a", max_tokens=7, stop_token_ids=(11, 12), n=2, temperature=0.7, top_k=-1, seed=3)))
    (((prompt, sp, rid), _),) = engine._engine.calls_of("generate")
    assert rid == "a"
    assert prompt == {"type": "token", "prompt_token_ids": [5, 6, 7, 8], "cache_salt": "tito-w0"}
    assert (sp.max_tokens, sp.stop_token_ids, sp.n, sp.temperature, sp.top_k, sp.seed) == (7, [11, 12], 2, 0.7, 0, 3)
    assert sp.logprobs == 0 and sp.detokenize is False and sp.ignore_eos is False
    assert sp.output_kind == vllm_standin.RequestOutputKind.FINAL_ONLY


def test_ignore_eos_sends_no_stop_ids_and_no_logprobs_when_off(engine, arun):
    out = arun(engine.generate(req(rid="b", stop_token_ids=(11,), ignore_eos=True, logprobs=False)))
    (((_, sp, _), _),) = engine._engine.calls_of("generate")
    assert sp.stop_token_ids == [] and sp.ignore_eos is True and sp.logprobs is None
    assert out.results[0].logprobs is None and len(out.results[0].completion_ids) == 8


def test_results_map_stop_reason_logprobs_and_cache(engine, arun):
    free = arun(engine.generate(req(rid="free", max_tokens=12, ignore_eos=True))).results[0]
    stop = free.completion_ids[4]
    r = arun(engine.generate(req(rid="stop", max_tokens=12, stop_token_ids=(stop,)))).results[0]
    i = free.completion_ids.index(stop)
    assert r.completion_ids == free.completion_ids[: i + 1] and r.finish_reason == "stop" and r.stop_token_id == stop
    assert r.logprobs == free.logprobs[: i + 1] and all(lp < 0 for lp in r.logprobs)


def test_prefix_cache_salted_by_weight_version(engine, arun):
    prompt = list(range(100, 140))  # 40 tokens: two full 16-token blocks
    first = arun(engine.generate(req(prompt, rid="c1"))).results[0]
    second = arun(engine.generate(req(prompt, rid="c2"))).results[0]
    assert (first.cached_prompt_tokens, second.cached_prompt_tokens) == (0, 32)
    arun(engine.update_weights("/ckpt/step-5", 5))
    third = arun(engine.generate(req(prompt, rid="c3"))).results[0]
    assert third.cached_prompt_tokens == 0 and third.weight_version == 5
    salts = [a[0]["cache_salt"] for a, _ in engine._engine.calls_of("generate")]
    assert salts == ["tito-w0", "tito-w0", "tito-w5"]


def test_update_weights_sequence(engine, arun):
    arun(engine.update_weights("/ckpt/step-2", 2))
    seq = [(m, a, k) for m, a, k in engine._engine.calls if m != "from_engine_args"]
    assert seq == [
        ("pause_generation", (), {"mode": "wait", "clear_cache": True}),
        (
            "collective_rpc",
            ("reload_weights",),
            {"timeout": None, "args": (), "kwargs": {"weights_path": "/ckpt/step-2"}},
        ),
        ("reset_prefix_cache", (), {"reset_running_requests": True}),
        ("resume_generation", (), {}),
    ]
    assert engine.info().weight_version == 2 and engine._engine.weights == "/ckpt/step-2"


def test_update_weights_drains_in_flight_and_holds_new_requests(engine, arun):
    async def main():
        old = asyncio.ensure_future(engine.generate(req(rid="old", max_tokens=60, ignore_eos=True)))
        await asyncio.sleep(0.01)
        update = asyncio.ensure_future(engine.update_weights("/ckpt/step-3", 3))
        await asyncio.sleep(0.005)
        new = asyncio.ensure_future(engine.generate(req(rid="new", max_tokens=4, ignore_eos=True)))
        return await old, await update, await new

    old, _, new = arun(main())
    assert old.results[0].finish_reason == "length" and len(old.results[0].completion_ids) == 60
    assert old.results[0].weight_version == 0 and new.results[0].weight_version == 3
    order = [m if m != "generate" else a[2] for m, a, _ in engine._engine.calls]
    assert order.index("new") > order.index("resume_generation") > order.index("collective_rpc")


def test_update_weights_abort_mode_and_failed_reload_keeps_serving(arun):
    from rollout.engines.vllm_backend import VLLMEngine

    async def main():
        eng = VLLMEngine("standin/model", max_model_len=512, update_pause_mode="abort")
        long = asyncio.ensure_future(eng.generate(req(rid="long", max_tokens=400, ignore_eos=True)))
        await asyncio.sleep(0.02)
        await eng.update_weights("/ckpt/a", 1)
        aborted = await long
        with pytest.raises(FileNotFoundError):
            await eng.update_weights("/ckpt/missing", 2)
        after = await eng.generate(req(rid="after"))
        return eng, aborted, after

    eng, aborted, after = arun(main())
    assert aborted.results[0].finish_reason == "abort" and aborted.results[0].weight_version == 0
    assert eng.info().weight_version == 1 and after.results[0].weight_version == 1  # the failed reload changed nothing
    assert eng._engine.calls[-2][0] == "resume_generation"  # resumed even though the reload failed


def test_engine_errors_become_finish_error_and_validation_engine_error(engine, arun):
    engine._engine.fail_next = vllm_standin.EngineGenerateError("boom")
    out = arun(engine.generate(req(rid="e1", n=2)))
    assert [r.finish_reason for r in out.results] == ["error", "error"]
    assert "EngineGenerateError: boom" in out.results[0].error
    engine._engine.fail_next = vllm_standin.VLLMValidationError("prompt too odd")
    with pytest.raises(EngineError, match="e2.*prompt too odd"):
        arun(engine.generate(req(rid="e2")))
    assert arun(engine.generate(req(rid="e3"))).results[0].finish_reason == "length"


def test_bad_input_refused_before_vllm(engine, arun):
    with pytest.raises(EngineError, match="outside the vocabulary"):
        arun(engine.generate(req([5, 1000], rid="oov")))
    assert engine._engine.calls_of("generate") == []


def test_pause_resume_and_health(engine, arun):
    async def main():
        await engine.pause()  # keep mode: new requests queue until resume
        task = asyncio.ensure_future(engine.generate(req(rid="queued", max_tokens=3)))
        await asyncio.sleep(0.02)
        assert not task.done()
        await engine.resume(weight_version=9)
        return await task

    out = arun(main())
    assert out.results[0].finish_reason == "length" and out.results[0].weight_version == 9  # held until resume
    assert engine.info().weight_version == 9
    assert ("pause_generation", (), {"mode": "keep", "clear_cache": True}) in engine._engine.calls
    assert arun(engine.health())["ok"] is True
    engine._engine.dead = True
    health = arun(engine.health())
    assert health["ok"] is False and "EngineDeadError" in health["error"]


def test_abort_while_held_at_the_gate(engine, arun):
    async def main():
        await engine.pause()
        held = asyncio.ensure_future(engine.generate(req(rid="held", max_tokens=3)))
        await asyncio.sleep(0.01)
        assert await engine.abort("held") is True
        assert await engine.abort("held") is False
        with pytest.raises(EngineError, match="already running"):
            await engine.generate(req(rid="held"))
        await engine.resume()
        return await held

    out = arun(main())
    assert out.results[0].finish_reason == "abort" and out.results[0].completion_ids == []
    assert out.results[0].logprobs == []
    assert [a[2] for a, _ in engine._engine.calls_of("generate")] == []  # it never reached vLLM
