"""Follow mode on REAL vLLM (``make test-vllm``): weights published mid-turn are validated, loaded into vLLM
in place, and the turns they stopped go on under them (abort_resume); every sampled token's logprob equals a
plain fp32 forward pass under the version recorded for it (within 1e-3: vLLM's kernels against transformers').
The same check as the embedded engine's in test_follow.py, on the production engine."""

from __future__ import annotations

import pytest

from tests._vllm import GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, REASON, model_dir, needs_vllm
from tests.test_follow import check_mid_turn_update

pytestmark = needs_vllm
FORWARD_ATOL = 1e-3


@pytest.fixture(scope="module")
def base_state():
    from rollout.models import load_causal_lm

    model = load_causal_lm(model_dir())
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_weights_published_mid_turn_on_vllm(tmp_path, base_state):
    from rollout.engines.vllm_backend import VLLMEngine

    assert REASON is None
    model, base = base_state
    # longer turns and a settling time: vLLM reports no token count while a request runs (about 15 tokens/s here)
    check_mid_turn_update(tmp_path, model_dir(), model, base, atol=FORWARD_ATOL, tokens=96, settle_s=1.5,
                          make_engine=lambda: VLLMEngine(
        model_dir(), max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=GPU_MEMORY_UTILIZATION, enforce_eager=True))
