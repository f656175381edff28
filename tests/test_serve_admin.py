"""The admin routes as prime-rl, SkyRL and TRL send them, against ``tito serve`` with two real embedded
engines (SmolLM2-135M, CPU) as Ray actors, over loopback HTTP.

Request shapes come from the clients' sources: prime-rl's InferenceAdmin (``/pause`` with query params
``mode=keep&clear_cache=false``, ``/update_weights {"weight_dir"}`` with no version, ``/resume``), SkyRL's
RemoteInferenceClient (JSON bodies: ``/sleep {"level": 2}``, ``/wake_up {}``, ``/reset_prefix_cache
{"reset_running_requests": false}``, ``GET /get_world_size`` with a ``{}`` body) and TRL's VLLMClient
(``GET /server_info?config_format=json`` reading ``vllm_config.weight_transfer_config``, ``/get_world_size``).

Sleep is checked by what it frees: each engine actor's resident memory (its process's VmRSS) drops by most of
the fp32 weights (~540 MB) and comes back on wake_up, after which greedy output is token-identical.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from ._support import SMOLLM2, http_call, reference, serving  # noqa: E402

WEIGHT_BYTES = 134_515_008 * 4  # SmolLM2-135M's parameters in fp32


@pytest.fixture(scope="module")
def model_path() -> str:
    from rollout.models import model_dir

    return str(model_dir("smollm2-135m"))  # the GGUF converted to safetensors: loadable by update_weights too


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_path):
    with serving(tmp_path_factory, "tito-test-serve-admin",
                 [f"model={model_path}", f"server.weights_root={model_path}", "served_model_name=smollm2-admin",
                  "engine.backend=embedded", "engine.count=2",
                  "engine.num_cpus=0.5", "engine.options={threads: 1, max_batch: 4, max_model_len: 1024}"]) as srv:
        yield srv


def call(srv, method: str, path: str, body=None, raw: bytes | None = None):
    return http_call(srv.url + path, method, body, None, raw, 300)


def prompt_ids(text: str) -> list[int]:
    hf = reference(SMOLLM2)
    return hf(hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                     add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def generate(srv, prompt: list[int], max_tokens: int = 8, **extra):
    return call(srv, "POST", "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {
        "max_tokens": max_tokens, "temperature": 0}, **extra})


def update_count(srv) -> int:
    """/metrics' count of timed /update_weights calls."""
    text = call(srv, "GET", "/metrics")[1]
    return next((int(float(line.split()[-1])) for line in text.splitlines()
                 if line.startswith("tito_weight_update_seconds_count")), 0)


def engine_rss(srv) -> list[int]:
    """Each engine actor process's resident set, in bytes (the actors run on this machine)."""
    pids = ray.get([e.actor.__ray_call__.remote(lambda self: os.getpid()) for e in srv.state.fleet.engines])
    out = []
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        out.append(kb * 1024)
    return out


# ---- prime-rl ----------------------------------------------------------------------------------------------


def test_prime_rl_weight_update_cycle(server, model_path):
    """pause(keep, no cache clear) -> update_weights without a version -> resume, exactly as prime-rl sends
    it; a request sent while paused waits, then runs under the new version."""
    assert call(server, "GET", "/liveness") == (200, {"status": "alive"})
    start = server.state.fleet.weight_version
    status, r = call(server, "POST", "/pause?mode=keep&clear_cache=false")
    assert status == 200 and r["mode"] == "keep" and r["cache_cleared"] is False
    out = {}
    waiting = threading.Thread(target=lambda: out.update(r=generate(server, prompt_ids("Hi"), 2)))
    waiting.start()
    time.sleep(0.5)
    assert "r" not in out, "a request ran while paused"
    status, r = call(server, "POST", "/update_weights", {"weight_dir": model_path})
    assert status == 200 and r == {"status": "ok", "weight_version": start + 1}
    assert call(server, "GET", "/is_paused")[1] == {"is_paused": True}  # prime-rl resumes itself
    assert call(server, "POST", "/resume")[0] == 200
    waiting.join(120)
    status, r = out["r"]
    assert status == 200 and [s["version"] for s in r["choices"][0]["weight_versions"]] == [str(start + 1)]


def test_update_weights_keeps_the_running_requests_and_stamps_their_tokens(server, model_path):
    """prime-rl's cycle with a request already decoding: /update_weights returns while it runs (nothing drains:
    the call costs the load, not the longest turn), the request goes on under the new version, its
    weight_versions split into [old, new) spans covering every token, and, the checkpoint being the served
    weights, its greedy tokens are those of a run without the update. /metrics times the call."""
    prompt = prompt_ids("Count from one to one hundred in words.")
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 160, "temperature": 0, "ignore_eos": True}}
    status, plain = call(server, "POST", "/inference/v1/generate", body)
    assert status == 200
    start, updates_before = server.state.fleet.weight_version, update_count(server)
    out = {}
    running = threading.Thread(target=lambda: out.update(r=call(server, "POST", "/inference/v1/generate", body)))
    running.start()
    deadline = time.monotonic() + 60
    while not server.state.fleet.where and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)  # some tokens decoded under the old version
    assert call(server, "POST", "/pause?mode=keep&clear_cache=false")[0] == 200
    status, r = call(server, "POST", "/update_weights", {"weight_dir": model_path})
    assert (status, r) == (200, {"status": "ok", "weight_version": start + 1})
    assert running.is_alive(), "the update waited for the running request (drained) instead of keeping it"
    assert call(server, "POST", "/resume")[0] == 200
    running.join(300)
    status, kept = out["r"]
    assert status == 200
    choice = kept["choices"][0]
    spans = [(s["version"], s["start"], s["end"]) for s in choice["weight_versions"]]
    assert len(spans) == 2 and spans[0][:2] == (str(start), 0) and spans[1][0] == str(start + 1), spans
    assert 0 < spans[0][2] == spans[1][1] < spans[1][2] == 160, spans
    assert choice["token_ids"] == plain["choices"][0]["token_ids"]
    assert update_count(server) == updates_before + 1


def test_what_cannot_be_real_here_is_501_naming_why(server):
    for path, body, needle in [
        ("/init_broadcaster", {"host": "127.0.0.1", "port": 29500, "rank_offset": 0, "inference_world_size": 2,
                               "timeout": 60}, "NCCL"),
        # engine.weight_transfer is none here: nothing listens, and the answer names the setting
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1"}}, "engine.weight_transfer"),
        ("/update_weights", {"update_info": {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}},
         "engine.weight_transfer"),
        ("/start_weight_update", {}, "engine.weight_transfer"),
        ("/reset_prefix_cache?reset_external=true", None, "external"),
    ]:
        status, r = call(server, "POST", path, body)
        assert status == 501 and needle in r["error"]["message"], (path, r)


@pytest.mark.parametrize("method,path,body,param", [
    ("POST", "/update_weights", {}, "weight_dir"),
    ("POST", "/update_weights", {"weight_dir": "/x", "step": 3}, None),
    ("POST", "/pause?mode=later", None, "mode"),
    ("POST", "/pause?clear_cache=maybe", None, "clear_cache"),
    ("POST", "/sleep?level=3", None, "level"),
    ("POST", "/sleep?mode=keep", None, "mode"),
    ("POST", "/sleep?level=two", None, "level"),
])
def test_bad_admin_input_is_400_naming_it(server, method, path, body, param):
    status, r = call(server, method, path, body)
    assert status == 400, r
    assert r["error"]["param"] == param or (param is None and "step" in r["error"]["message"])
    assert call(server, "GET", "/is_sleeping")[1] == {"is_sleeping": False}


# ---- SkyRL / TRL -------------------------------------------------------------------------------------------


def test_world_size_and_server_info_as_trl_and_skyrl_read_them(server):
    assert call(server, "GET", "/get_world_size") == (200, {"world_size": 2})  # two one-process engines
    assert call(server, "GET", "/get_world_size", raw=b"{}") == (200, {"world_size": 2})  # SkyRL's GET body
    status, r = call(server, "GET", "/server_info?config_format=json")
    assert status == 200 and r["vllm_config"]["weight_transfer_config"] is None  # TRL: "no weight-transfer engine"
    assert r["tito"]["world_size"] == 2 and r["tito"]["backend"] == "embedded"
    assert r["tito"]["max_model_len"] == 1024 and r["tito"]["model"] == "smollm2-admin"


def test_reset_prefix_cache_drops_session_kv(server):
    """A request keyed by cache_salt whose prompt extends the previous one's prompt + completion reuses the KV
    that one left; after /reset_prefix_cache (SkyRL's JSON body) the next such request prefills in full."""
    extra = prompt_ids("And one more?")[1:]
    prompt = prompt_ids("Name three colours.")
    first = generate(server, prompt, 4, cache_salt="salt-reset")[1]["choices"][0]["token_ids"]
    second_prompt = prompt + first + extra
    second = generate(server, second_prompt, 4, cache_salt="salt-reset")[1]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(prompt), second["usage"]
    status, r = call(server, "POST", "/reset_prefix_cache", {"reset_running_requests": False})
    assert (status, r) == (200, {"success": True})
    third = generate(server, second_prompt + second["choices"][0]["token_ids"] + extra, 4, cache_salt="salt-reset")[1]
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, third["usage"]


def on_both_engines(srv, prompt: list[int]) -> list[list[int]]:
    """Two greedy requests at once: the least-loaded router puts one on each engine (so both engines' weights
    are resident: they are mapped from the safetensors file and read in by the first forward pass)."""
    out: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: out.update({i: generate(srv, prompt, 8)})) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(out[i][0] == 200 for i in range(2)), out
    return [out[i][1]["choices"][0]["token_ids"] for i in range(2)]


def test_sleep_frees_weights_and_kv_and_wake_up_restores_them(server):
    prompt = prompt_ids("What is the capital of France?")
    before = on_both_engines(server, prompt)
    awake = engine_rss(server)
    status, r = call(server, "POST", "/sleep", {"level": 2})  # SkyRL sends the level in a JSON body
    assert (status, r) == (200, {"status": "sleeping", "level": 2})
    asleep = engine_rss(server)
    freed = [a - s for a, s in zip(awake, asleep)]
    print(f"engine RSS awake {[a >> 20 for a in awake]} MiB, asleep {[s >> 20 for s in asleep]} MiB")
    assert all(f > 0.7 * WEIGHT_BYTES for f in freed), f"freed {[f >> 20 for f in freed]} MiB per engine"
    assert call(server, "GET", "/is_sleeping")[1] == {"is_sleeping": True}
    status, r = generate(server, prompt, 8)
    assert status == 503 and "wake_up" in r["error"]["message"]
    status, r = call(server, "POST", "/update_weights", {"weight_dir": server.state.weights_root})
    assert status == 503 and "wake_up" in r["error"]["message"]
    assert call(server, "GET", "/liveness")[0] == 200  # the process is alive while its engines sleep
    status, r = call(server, "POST", "/wake_up", {})
    assert (status, r) == (200, {"status": "awake", "tags": None})
    assert call(server, "GET", "/is_sleeping")[1] == {"is_sleeping": False}
    assert on_both_engines(server, prompt) == before  # the same weights came back, on both engines
    woken = engine_rss(server)
    print(f"engine RSS woken {[w >> 20 for w in woken]} MiB")
    assert all(w - s > 0.7 * WEIGHT_BYTES for w, s in zip(woken, asleep))


def test_sleep_aborts_running_requests_by_default(server):
    out = {}
    running = threading.Thread(target=lambda: out.update(r=call(server, "POST", "/inference/v1/generate", {
        "token_ids": prompt_ids("Count to one hundred."), "sampling_params": {
            "max_tokens": 400, "temperature": 0, "ignore_eos": True}})))
    running.start()
    deadline = time.monotonic() + 60
    while not server.state.fleet.where and time.monotonic() < deadline:
        time.sleep(0.05)
    status, _ = call(server, "POST", "/sleep?level=1")  # vLLM's query form; mode defaults to abort
    running.join(120)
    try:
        assert status == 200
        status, r = out["r"]
        assert status == 200 and r["choices"][0]["finish_reason"] == "abort"
        assert len(r["choices"][0]["token_ids"]) < 400
    finally:
        assert call(server, "POST", "/wake_up")[0] == 200


def test_pause_with_skyrl_json_body_waits_for_running_requests(server):
    status, r = call(server, "POST", "/pause", {"wait_for_inflight_request": True})
    try:
        assert status == 200 and r["mode"] == "wait" and r["cache_cleared"] is False
        assert server.state.fleet.in_flight == 0
    finally:
        assert call(server, "POST", "/resume")[1] == {"status": "resumed", "paused": False}


def test_pause_with_clear_cache_drops_the_cached_kv(server):
    extra = prompt_ids("Why?")[1:]
    prompt = prompt_ids("Name a fruit.")
    first = generate(server, prompt, 4, cache_salt="salt-pause")[1]["choices"][0]["token_ids"]
    status, r = call(server, "POST", "/pause?mode=wait&clear_cache=true")
    assert call(server, "POST", "/resume")[0] == 200
    assert status == 200 and r["cache_cleared"] is True
    after = generate(server, prompt + first + extra, 4, cache_salt="salt-pause")[1]
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, after["usage"]


def test_wake_up_reloads_the_last_updated_weights_not_the_base_model(model_path, tmp_path):
    """The embedded backend directly: after update_weights(another checkpoint), sleep + wake_up must bring back
    that checkpoint (the sampled tokens' logprobs equal those before the sleep), not the model the engine was
    built with (whose logprobs differ). The other checkpoint is the model with its final norm scaled by 1.25,
    saved as a trainer saves one (a training step takes a minute on a busy 2-core box)."""
    import asyncio

    import torch

    from rollout.engines.embedded import EmbeddedEngine
    from rollout.engines.protocol import GenerateRequest, SamplingParams
    from rollout.models import load_causal_lm
    from scripts.train_step_demo import save_checkpoint

    other = load_causal_lm(model_path)
    with torch.no_grad():
        other.model.norm.weight.mul_(1.25)
    trained = str(save_checkpoint(other, tmp_path / "step-1"))
    del other
    prompt = prompt_ids("What is the capital of France?")

    async def run() -> list[list[float]]:
        engine = EmbeddedEngine(model_path, threads=1, max_batch=2, max_model_len=256, fetch=False)
        n = 0

        async def logprobs() -> list[float]:
            nonlocal n
            n += 1
            out = await engine.generate(GenerateRequest(f"wake-{n}", prompt, SamplingParams(max_tokens=4,
                                                                                            temperature=0)))
            return out.results[0].logprobs

        try:
            base = await logprobs()
            await engine.update_weights(trained, 1)
            updated = await logprobs()
            await engine.sleep(2)
            await engine.wake_up()
            return [base, updated, await logprobs()]
        finally:
            await engine.close()

    base, updated, woken = asyncio.run(run())
    assert max(abs(a - b) for a, b in zip(base, updated)) > 1e-3  # the training step changed the model
    assert woken == updated


def engines_holding(srv, session_id: str) -> int:
    """How many engines keep session KV for ``session_id`` (read inside each engine actor)."""
    return sum(ray.get([e.actor.__ray_call__.remote(lambda self, sid=session_id: sid in self._backend.sessions)
                        for e in srv.state.fleet.engines]))


def test_ending_a_session_frees_its_kv_on_the_engine(server):
    hello = [{"role": "user", "content": "Say hello."}]
    for sid, how in [("kv-delete", "delete"), ("kv-header", "header")]:
        status, r = http_call(server.url + "/v1/chat/completions", "POST", {"messages": hello, "max_tokens": 4},
                              {"X-Session-ID": sid}, timeout=120)
        assert status == 200, r
        deadline = time.monotonic() + 10  # the last token's KV reaches the store one engine step after the answer
        while engines_holding(server, sid) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engines_holding(server, sid) == 1
        if how == "delete":
            assert call(server, "DELETE", f"/v1/sessions/{sid}")[0] == 200
        else:
            messages = [*hello, r["choices"][0]["message"], {"role": "user", "content": "Bye."}]
            status, r = http_call(server.url + "/v1/chat/completions", "POST", {"messages": messages, "max_tokens": 4},
                                  {"X-Session-ID": sid, "X-Session-End": "true"}, timeout=120)
            # the ended turn's own KV reaches the store a step after its answer: it must be dropped too
            assert status == 200 and r["session"]["ended"] is True
        assert engines_holding(server, sid) == 0, how
