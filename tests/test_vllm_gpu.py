"""The engine conformance suite against the REAL vLLM backend (GPU + vllm installed; run by scripts/gpu_check.sh).

Skipped unless ``TITO_VLLM_MODEL`` names a model (directory or hub id) and the real ``vllm`` imports. This has
NOT been run on the CPU-only development machines (vLLM's wheel is CUDA-only); tests/test_vllm_backend.py covers
the backend there against a stand-in. With ``TITO_REQUIRE_GPU_CHECK=1`` (set by gpu_check.sh) a missing
prerequisite is a failure instead of a skip, so the script cannot pass vacuously.

Environment: ``TITO_VLLM_MODEL`` (required), ``TITO_VLLM_MAX_MODEL_LEN`` (default 4096),
``TITO_VLLM_GPU_MEMORY_UTILIZATION`` (default 0.6), ``TITO_VLLM_WEIGHTS_PATH`` (checkpoint for the weight-update
check; default: the model itself, reloaded).
"""

from __future__ import annotations

import os

import pytest

from rollout.engines.protocol import GenerateRequest, SamplingParams
from tests.engine_conformance import conformance_tests

MODEL = os.environ.get("TITO_VLLM_MODEL", "")


def _unavailable() -> str | None:
    if not MODEL:
        return (
            "real-vLLM conformance NOT run: TITO_VLLM_MODEL is not set (needs a GPU machine with vllm installed; "
            "run scripts/gpu_check.sh MODEL there)"
        )
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot run here"
        return f"real-vLLM conformance NOT run: vllm does not import here ({type(exc).__name__}: {exc})"
    if getattr(vllm, "__standin__", False):
        return "real-vLLM conformance NOT run: the vLLM stand-in is installed in this process; run this module alone"
    return None


REASON = _unavailable()
if REASON and os.environ.get("TITO_REQUIRE_GPU_CHECK") == "1":
    raise RuntimeError(REASON)
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def _make_backend():
    from rollout.engines.vllm_backend import VLLMEngine

    return VLLMEngine(
        MODEL,
        max_model_len=int(os.environ.get("TITO_VLLM_MAX_MODEL_LEN", "4096")),
        gpu_memory_utilization=float(os.environ.get("TITO_VLLM_GPU_MEMORY_UTILIZATION", "0.6")),
        enforce_eager=True,
    )


async def check_prefix_cache_salted(backend) -> None:
    """A repeated 64-token prompt is served from vLLM's prefix cache; after update_weights it is not."""
    info = backend.info()
    prompt = [100 + (i * 37) % (info.vocab_size - 200) for i in range(64)]

    def req(tag: str) -> GenerateRequest:
        return GenerateRequest(
            request_id=f"gpu-cache-{tag}",
            prompt_ids=prompt,
            sampling=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )

    await backend.generate(req("a"))
    again = (await backend.generate(req("b"))).results[0]
    assert again.cached_prompt_tokens > 0, "a repeated prompt got no prefix-cache hit"
    await backend.update_weights(os.environ.get("TITO_VLLM_WEIGHTS_PATH", MODEL), info.weight_version + 1)
    fresh = (await backend.generate(req("c"))).results[0]
    assert fresh.cached_prompt_tokens == 0, "KV cached under the old weights was reused after update_weights"


TestRealVLLMConformance = conformance_tests(
    _make_backend,
    weights_path=os.environ.get("TITO_VLLM_WEIGHTS_PATH", MODEL),
    extra_checks={"prefix_cache_salted": check_prefix_cache_salted},
    timeout_s=600.0,
)
