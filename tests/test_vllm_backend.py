"""VLLMEngine against the vLLM STAND-IN (tests/vllm_standin.py) — not against vLLM — for what real vLLM cannot
be made to do here; everything else runs on real vLLM in tests/test_vllm_real.py (``make test-vllm``).

Kept on the stand-in, each because real vLLM cannot show it on demand:
* an engine failure in the middle of a request (``EngineGenerateError``) becomes finish "error" for that request
  while the engine keeps serving, and a dead engine core (``EngineDeadError``) turns health to not ok: a real
  engine core cannot be made to fail one request, or to die, without killing processes the test does not own;
* the module imports, and the constructor refuses clashing engine args, without vLLM (the light suite's .venv
  has no vLLM).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from rollout.engines.protocol import EngineError, GenerateRequest, SamplingParams
from tests import vllm_standin


@pytest.fixture(scope="module", autouse=True)
def standin():
    vllm_standin.install()
    yield vllm_standin
    vllm_standin.uninstall()


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
        return VLLMEngine("standin/model", max_model_len=512)

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


def test_forced_engine_args_cannot_be_overridden():
    from rollout.engines.vllm_backend import VLLMEngine

    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        VLLMEngine("m", engine_args={"skip_tokenizer_init": False})
    with pytest.raises(TypeError, match="not_a_field"):
        VLLMEngine("m", engine_args={"not_a_field": 1})


def test_engine_errors_become_finish_error_and_validation_engine_error(engine, arun):
    engine._engine.fail_next = vllm_standin.EngineGenerateError("boom")
    out = arun(engine.generate(req(rid="e1", n=2)))
    assert [r.finish_reason for r in out.results] == ["error", "error"]
    assert "EngineGenerateError: boom" in out.results[0].error
    engine._engine.fail_next = vllm_standin.VLLMValidationError("prompt too odd")
    with pytest.raises(EngineError, match="e2.*prompt too odd"):
        arun(engine.generate(req(rid="e2")))
    assert arun(engine.generate(req(rid="e3"))).results[0].finish_reason == "length"


def test_dead_engine_core_fails_health(engine, arun):
    assert arun(engine.health())["ok"] is True
    engine._engine.dead = True
    health = arun(engine.health())
    assert health["ok"] is False and "EngineDeadError" in health["error"]
