"""LoRA on the vLLM backend, side by side with vLLM's own server (both ``--enable-lora``), each a subprocess on
loopback: adapters written by peft, loaded with vLLM's ``/v1/load_lora_adapter`` body on both and with prime-rl's
``/load_lora_adapter {lora_name, lora_path}`` (src/prime_rl/utils/client.py at 559b447) on tito, sampled with
``model: <lora_name>``; every sampled token's logprob checked against peft's forward pass (<= 1e-3), and tito's
tokens against vLLM's own server's for the same greedy request.

Runs in .venv-vllm (``make test-vllm``); elsewhere skipped with the reason (tests/_vllm.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests._support import free_ports, http_call, logprobs_of, write_adapter
from tests._vllm import MAX_MODEL_LEN, model_dir, needs_vllm
from tests.test_vllm_serve import Server

pytestmark = needs_vllm
NAME = "smollm2-135m"
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-weights")


@pytest.fixture(scope="module")
def refs(root):
    pytest.importorskip("peft")
    from rollout.models import load_causal_lm

    return {step: write_adapter(load_causal_lm(model_dir()), root / "broadcasts" / step, seed=seed)
            for step, seed in (("step_1", 1), ("step_2", 2))}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, root, refs):
    model = model_dir()
    logs = tmp_path_factory.mktemp("lora-servers")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "1",
           "NO_COLOR": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    vport, tport = free_ports(2)
    vllm = Server("vLLM's server", [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", NAME,
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs", "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
        "--host", "127.0.0.1", "--port", str(vport)], vport, logs / "vllm.log", env)
    tito = Server("tito serve", [
        str(Path(sys.executable).with_name("tito")), "serve", "configs/serve.yaml", "--port", str(tport),
        "--set", f"served_model_name={NAME}", "--set", f"server.weights_root={root}",
        "--set", f"engine={{backend: vllm, count: 1, options: {{max_model_len: {MAX_MODEL_LEN}, enforce_eager: true, "
        f"engine_args: {{enable_lora: true, max_lora_rank: 16, max_loras: 2}}}}}}",
    ], tport, logs / "tito.log", env)
    try:
        vllm.wait_ready()
        tito.wait_ready()
        yield {"vllm": vllm.base, "tito": tito.base}
    finally:
        tito.stop()
        vllm.stop()


def _call(base: str, method: str, path: str, body=None):
    """(status, JSON or text): vLLM's adapter routes answer 200 with plain text."""
    return http_call(base + path, method, body, None, None, 300)


def generate(base: str, model: str, temperature: float = 0.0, seed: int = 0) -> tuple[list[int], list[float], list]:
    status, r = _call(base, "POST", "/inference/v1/generate", {"model": model, "token_ids": PROMPT, "sampling_params": {
        "max_tokens": 8, "temperature": temperature, "seed": seed, "logprobs": 1, "ignore_eos": True}})
    assert status == 200, r
    c = r["choices"][0]
    return c["token_ids"], [d["logprob"] for d in c["logprobs"]["content"]], c.get("weight_versions") or []


def test_vllm_lora_routes_side_by_side_and_logprobs_match_peft(servers, root, refs):
    step1 = str(root / "broadcasts" / "step_1")
    for name, base in servers.items():
        status, text = _call(base, "POST", "/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": step1})
        assert status == 200, (name, text)
    greedy = {name: generate(base, "policy") for name, base in servers.items()}
    assert greedy["tito"][0] == greedy["vllm"][0]  # the same tokens as vLLM's own server
    for name in servers:
        ids, lps, _ = greedy[name]
        assert max(abs(a - b) for a, b in zip(lps, logprobs_of(refs["step_1"], PROMPT, ids))) <= 1e-3, name
    ids, lps, versions = generate(servers["tito"], "policy", temperature=1.0, seed=3)
    assert max(abs(a - b) for a, b in zip(lps, logprobs_of(refs["step_1"], PROMPT, ids))) <= 1e-3
    assert [v["version"] for v in versions] == ["1"]
    cards = {}
    for name, base in servers.items():
        _, models = _call(base, "GET", "/v1/models")
        cards[name] = {c["id"]: c for c in models["data"]}["policy"]
    assert cards["tito"]["parent"] == cards["vllm"]["parent"] == NAME
    assert set(cards["vllm"]) <= set(cards["tito"])
    # a second load of the name without load_inplace: vLLM's 400 on both
    for name, base in servers.items():
        status, r = _call(base, "POST", "/v1/load_lora_adapter", {"lora_name": "policy", "lora_path": step1})
        assert status == 400 and "already been loaded" in r["error"]["message"], (name, r)


def test_prime_rl_reloads_the_name_each_step(servers, root, refs):
    tito = servers["tito"]
    status, r = _call(tito, "POST", "/load_lora_adapter", {"lora_name": "policy",
                                                           "lora_path": str(root / "broadcasts" / "step_2")})
    assert (status, r) == (200, {"status": "ok"})
    ids, lps, versions = generate(tito, "policy", temperature=1.0, seed=4)
    assert max(abs(a - b) for a, b in zip(lps, logprobs_of(refs["step_2"], PROMPT, ids))) <= 1e-3
    assert [v["version"] for v in versions] == ["2"]
    status, _ = _call(tito, "POST", "/v1/unload_lora_adapter", {"lora_name": "policy"})
    assert status == 200
    status, r = _call(tito, "POST", "/inference/v1/generate", {"model": "policy", "token_ids": PROMPT,
                                                               "sampling_params": {"max_tokens": 2}})
    assert status == 404, r
