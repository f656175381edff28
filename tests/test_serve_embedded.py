"""`tito serve` with the real embedded engine (SmolLM2-135M, CPU) on real Ray and loopback HTTP:
a generate round trip, a chat session whose second turn is bridged and reuses the engine's session KV,
a client that hangs up mid-generation (the engine stops), and the interop proof: the PyPI package
``renderers`` (its own ``renderers.client.generate``, unchanged, in a separate virtual environment,
because our top-level package has the same name) drives a full generate round trip against this server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")



from ._support import (  # noqa: E402
    EMBEDDED_ENGINE,
    SMOLLM2,
    cached_venv,
    http_call,
    prime_rl_load,
    reference,
    serving,
    smollm2_gguf,
)

RENDERERS_PYPI = "0.1.12"
# openai 3.x depends on httpx2, while renderers 0.1.12's client imports httpx (undeclared): pin openai 2.x
INTEROP_REQUIREMENTS = [f"renderers[transformers]=={RENDERERS_PYPI}", "openai>=1.108.1,<3"]
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory, "tito-test-serve-embedded",
                 [f"model={smollm2_gguf()}", "served_model_name=smollm2-test", *EMBEDDED_ENGINE]) as srv:
        yield srv


def post(srv, path, body, headers=None, timeout=120):
    return http_call(srv.url + path, "POST", body, headers, timeout=timeout)


def get(srv, path):
    with urllib.request.urlopen(srv.url + path, timeout=30) as r:
        return json.loads(r.read())


def hf_prompt(messages) -> list[int]:
    hf = reference(SMOLLM2)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf(text, add_special_tokens=False)["input_ids"]


def test_generate_round_trip(server):
    prompt = hf_prompt([{"role": "user", "content": "What is the capital of France?"}])
    status, r = post(server, "/inference/v1/generate", {"model": "smollm2-test", "token_ids": prompt, "sampling_params": {
        "max_tokens": 24, "temperature": 0, "stop_token_ids": [EOS], "logprobs": 1}})
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and 0 < len(choice["token_ids"]) <= 24
    assert all(c["logprob"] <= 0 for c in choice["logprobs"]["content"])
    assert "Paris" in reference(SMOLLM2).decode(choice["token_ids"])
    status, again = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": 24, "temperature": 0, "stop_token_ids": [EOS]}})
    assert again["choices"][0]["token_ids"] == choice["token_ids"]  # greedy is deterministic


def test_generate_turns_with_a_session_header_reuse_the_engine_kv(server):
    """verifiers' TrainClient and SkyRL send each rollout's turns to /inference/v1/generate with X-Session-ID
    and no cache_salt: the second turn is served from the first turn's KV; without the header it is not."""
    def turn(prompt, headers):
        status, r = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
            "max_tokens": 8, "temperature": 0}}, headers)
        assert status == 200, r
        return r

    first = hf_prompt([{"role": "user", "content": "Name a fruit."}])
    for headers, reused in (({"X-Session-ID": "train-rollout-1"}, True), (None, False)):
        r1 = turn(first, headers)
        second = [*first, *r1["choices"][0]["token_ids"], *hf_prompt([{"role": "user", "content": "Another."}])]
        r2 = turn(second, headers)
        cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached >= len(first)) if reused else cached == 0, (headers, cached)


def test_chat_session_bridges_and_reuses_the_engine_kv(server):
    sid = "smol-1"
    msgs = [{"role": "user", "content": "Name a colour."}]
    status, r1 = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 16, "temperature": 0,
                                                       "return_token_ids": True}, {"X-Session-ID": sid})
    assert status == 200, r1
    assert r1["prompt_token_ids"] == hf_prompt(msgs)
    msgs2 = [*msgs, r1["choices"][0]["message"], {"role": "user", "content": "Another one."}]
    status, r2 = post(server, "/v1/chat/completions", {"messages": msgs2, "max_tokens": 16, "temperature": 0,
                                                       "return_token_ids": True}, {"X-Session-ID": sid})
    assert status == 200 and r2["session"]["prompt"] == "bridged"
    prefix = r1["prompt_token_ids"] + r1["choices"][0]["token_ids"]
    assert r2["prompt_token_ids"][: len(prefix)] == prefix
    # sticky routing + the session id: the engine served the previous turn's tokens from its session KV
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prefix) - 1
    sample = get(server, f"/v1/sessions/{sid}/sample")
    (seg,) = sample["segments"]
    assert sum(seg["loss_mask"]) == len(r1["choices"][0]["token_ids"]) + len(r2["choices"][0]["token_ids"])


def test_client_hanging_up_stops_the_engine(server):
    body = json.dumps({"token_ids": [1, 9690, 198], "request_id": "smol-hangup",
                       "sampling_params": {"max_tokens": 1500, "ignore_eos": True}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 20
    while get(server, "/health")["engines"][0]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # mid-generation (1500 tokens take far longer on this CPU)
    sock.close()
    deadline = time.monotonic() + 10
    while get(server, "/health")["engines"][0]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert get(server, "/health")["engines"][0]["in_flight"] == 0, "the engine kept generating after the hang-up"
    state = server.state
    assert state.metrics.get("aborts_total", cause="client_disconnect") == 1
    assert state.metrics.get("finish_total", finish="abort") == 1  # the engine returned the request as aborted
    status, r = post(server, "/inference/v1/generate", {"token_ids": [1, 9690], "sampling_params": {"max_tokens": 2}})
    assert status == 200 and len(r["choices"][0]["token_ids"]) == 2


def test_vllm_metrics_show_the_embedded_engines_rows_queue_and_kv(server):
    """prime-rl's reading of /metrics (tests/_support.py ``prime_rl_load``) while 10 long requests meet the 8 rows
    of the engine (EMBEDDED_ENGINE: max_batch 8, max_model_len 2048): 8 run, 2 wait for room, KV is held, and the
    KV budget is 8 x 2048 tokens."""
    import threading

    rids = [f"smol-load-{i}" for i in range(10)]
    threads = [threading.Thread(target=post, args=(server, "/inference/v1/generate", {
        "token_ids": [1, 9690, 198], "request_id": rid, "sampling_params": {"max_tokens": 1500, "ignore_eos": True}}))
        for rid in rids]
    for t in threads:
        t.start()
    try:
        deadline, load = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
                load = prime_rl_load(r.read().decode())["0"]
            if load["running"] == 8 and load["waiting"] == 2 and load["kv_usage"] > 0:
                break
            time.sleep(0.1)
        assert load["running"] == 8 and load["waiting"] == 2 and load["waiting_capacity"] == 2, load
        assert load["kv_capacity_tokens"] == 8 * 2048 and 0 < load["kv_usage"] < 0.5, load
        assert load["preemptions"] == 0
    finally:
        post(server, "/inference/v1/abort_requests", {"request_ids": rids})
        for t in threads:
            t.join(60)
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        after = prime_rl_load(r.read().decode())["0"]
    assert (after["running"], after["waiting"], after["kv_usage"]) == (0, 0, 0.0), after


def test_openai_sdk_stream_from_the_engine_actor(server):
    """The real engine, token by token through the engine actor's Ray streaming generator: the streamed
    chat answer is the whole one for the same seed."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Name three colours."}]
    kw = dict(model="smollm2-test", messages=msgs, max_tokens=12, temperature=0.8, seed=5)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content and len(pieces) > 2
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sampling_values_the_engine_cannot_take_are_400(server):
    # before the checks these reached the engine: torch refused the seed (Overflow when unpacking long long),
    # and logits / 1e-300 gave NaN probabilities; both came back as 500
    msgs = [{"role": "user", "content": "hi"}]
    for extra, param in (({"seed": 2**64 - 1, "n": 2}, "seed"), ({"temperature": 1e-300}, "temperature")):
        status, r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, **extra})
        assert status == 400 and r["error"]["param"] == param, r
    status, r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "seed": 2**63 - 1, "n": 2})
    assert status == 200 and len(r["choices"]) == 2


# ---- interop: the PyPI `renderers` client, unchanged --------------------------------------------


def _interop_python() -> Path:
    """A venv with renderers==0.1.12 from PyPI, cached under $TITO_CACHE/venvs keyed by the version."""
    return cached_venv(f"renderers-{RENDERERS_PYPI}", INTEROP_REQUIREMENTS) / "bin" / "python"


CLIENT_SCRIPT = """
import asyncio, json, sys
from openai import AsyncOpenAI
from renderers import DefaultRendererConfig, create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate

async def main(url, tokenizer_dir):
    renderer = create_renderer(load_tokenizer(tokenizer_dir), DefaultRendererConfig())
    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    out = await generate(client=client, renderer=renderer, model="smollm2-test",
                         messages=[{"role": "user", "content": "What is the capital of France?"}],
                         sampling_params={"max_tokens": 24, "temperature": 0.0})
    keep = ("request_id", "usage", "prompt_ids", "completion_ids", "completion_logprobs", "content", "finish_reason")
    print(json.dumps({k: out[k] for k in keep}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.slow
def test_pypi_renderers_client_round_trip(server, tmp_path):
    python = _interop_python()
    tokenizer_dir = tmp_path / "tokenizer"
    reference(SMOLLM2).save_pretrained(str(tokenizer_dir))  # the GGUF's tokenizer as a directory it can load
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HF_HUB_OFFLINE"] = "1"
    # -I: isolated, so neither the working directory nor PYTHONPATH can put our `renderers` first
    done = subprocess.run([str(python), "-I", str(script), server.url, str(tokenizer_dir)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert out["prompt_ids"] == hf_prompt(messages)
    assert 0 < len(out["completion_ids"]) <= 24 and len(out["completion_logprobs"]) == len(out["completion_ids"])
    assert out["finish_reason"] in ("stop", "length") and "Paris" in out["content"]
    assert out["usage"]["prompt_tokens"] == len(out["prompt_ids"])
    # the same greedy request straight to the route gives the same tokens and logprobs
    _, direct = post(server, "/inference/v1/generate", {"token_ids": out["prompt_ids"], "sampling_params": {
        "max_tokens": 24, "temperature": 0, "stop_token_ids": [EOS], "logprobs": 1}})
    assert direct["choices"][0]["token_ids"] == out["completion_ids"]
    assert [c["logprob"] for c in direct["choices"][0]["logprobs"]["content"]] == pytest.approx(
        out["completion_logprobs"], abs=1e-4)
