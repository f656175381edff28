"""`tito serve` over real Ray and real HTTP on loopback, with replay engines (synthetic, plus recorded
completions) and the Qwen2.5 tokenizer fixture: the vLLM token routes, bad input, aborts (by request and
by a client that hangs up), pause/resume, weight updates, metrics, chat sessions that bridge append-only
and record breaks, and an engine that dies while the server keeps serving.

One server per module (started once; ~8 s). Expected prompts come from transformers' apply_chat_template
(the independent reference), never from our renderer.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from rollout.config import ServeConfig, load_config  # noqa: E402

from ._support import http_call, prime_rl_load, reference, serving, tokenizer_dir  # noqa: E402

QWEN = "qwen2.5-7b-instruct"
VOCAB = 151665
MAX_LEN = 1024
IM_END = 151645
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
FIRST = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 1 + 2?"}]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def hf_prompt(messages, tools=None) -> list[int]:
    hf = reference(QWEN)
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return hf(text, add_special_tokens=False)["input_ids"]


def tool_call_ids() -> list[int]:
    return reference(QWEN)(TOOL_CALL_TEXT, add_special_tokens=False)["input_ids"] + [IM_END]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the tool-call completion is recorded for the prompt transformers renders: the server finds it only
    # when its own first render is token-identical
    records = [{"prompt_ids": hf_prompt(FIRST, TOOLS), "completion_ids": tool_call_ids(),
                "logprobs": [-0.5] * len(tool_call_ids()), "finish_reason": "stop", "stop_token_id": IM_END}]
    options = {"synthetic": True, "vocab_size": VOCAB, "max_model_len": MAX_LEN, "token_delay_s": 0.002,
               "records": records}
    weights = tmp_path_factory.mktemp("checkpoints")
    with serving(tmp_path_factory, "tito-test-serve",
                 [f"model={tokenizer_dir(QWEN)}", "served_model_name=qwen-test", "engine.backend=replay", "engine.count=2",
                  "default_max_tokens=40", "sessions.idle_timeout_s=2", f"server.weights_root={weights}"],
                 engine_options=options) as srv:
        yield srv


def request(srv, method: str, path: str, body=None, headers=None, raw: bytes | None = None, timeout=30):
    return http_call(srv.url + path, method, body, headers, raw, timeout)


def post(srv, path, body, **kw):
    return request(srv, "POST", path, body, **kw)


def metric(srv, name: str, **labels) -> float:
    _, text = request(srv, "GET", "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"tito_{name}{{{want}}}" if labels else f"tito_{name}"
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- vLLM token routes ---------------------------------------------------------------------------


def test_generate_shape_logprobs_usage(server):
    status, r = post(server, "/inference/v1/generate", {
        "model": "qwen-test", "token_ids": [10, 11, 12], "request_id": "shape-1",
        "sampling_params": {"max_tokens": 6, "temperature": 0.0, "logprobs": 1, "skip_special_tokens": False}})
    assert status == 200, r
    assert r["request_id"] == "shape-1" and r["prompt_token_ids"] == [10, 11, 12]
    (choice,) = r["choices"]
    assert choice["index"] == 0 and len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None and choice["weight_versions"] == [{"version": "0", "start": 0, "end": 6}]
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    assert all(c["token"] == f"token_id:{c['token_id']}" and -5 <= c["logprob"] < 0 for c in content)
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9, "cached_tokens": 0,
                          "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": None}
    assert r["metrics"]["engine_s"] > 0 and r["metrics"]["engine_call_s"] >= r["metrics"]["engine_s"]
    # greedy: the same prompt gives the same ids (whichever engine serves it); no logprobs when not asked
    _, again = post(server, "/inference/v1/generate", {"token_ids": [10, 11, 12],
                                                       "sampling_params": {"max_tokens": 6, "temperature": 0.0}})
    assert again["choices"][0]["token_ids"] == choice["token_ids"] and again["choices"][0]["logprobs"] is None


def test_generate_stop_ids_n_and_server_side_default_max_tokens(server):
    _, first = post(server, "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 8,
                                                                                                  "temperature": 0}})
    stop = first["choices"][0]["token_ids"][3]
    _, r = post(server, "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop]}})
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop and choice["token_ids"][-1] == stop
    _, r = post(server, "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 3}})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2] and r["usage"]["completion_tokens"] == 12
    # no max_tokens: the server's default (40 here, vLLM-style, not 16) ...
    _, r = post(server, "/inference/v1/generate", {"token_ids": [7, 8], "sampling_params": {"temperature": 0}})
    assert len(r["choices"][0]["token_ids"]) == 40
    # ... capped by the room left in max_model_len
    _, r = post(server, "/inference/v1/generate", {"token_ids": [7] * (MAX_LEN - 10), "sampling_params": {}})
    assert len(r["choices"][0]["token_ids"]) == 10 and r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "invalid JSON"),
    (b"", 400, "empty request body"),
    ({"sampling_params": {"max_tokens": 4}}, 400, "missing required field `token_ids`"),
    ({"token_ids": [1, "2"], "sampling_params": {"max_tokens": 4}}, 400, "$.token_ids[1]"),
    ({"token_ids": [1, VOCAB + 5], "sampling_params": {"max_tokens": 4}}, 400,
     f"token id {VOCAB + 5} is outside the vocabulary"),
    ({"token_ids": [1, -1], "sampling_params": {"max_tokens": 4}}, 400, "outside the vocabulary"),
    ({"token_ids": [], "sampling_params": {"max_tokens": 4}}, 400, "empty prompt"),
    ({"token_ids": [1] * 1000, "sampling_params": {"max_tokens": 100}}, 400,
     "prompt (1000 tokens) + max_tokens (100) exceeds max_model_len 1024"),
    ({"token_ids": [1] * MAX_LEN, "sampling_params": {}}, 400, "leaves no room"),
    ({"model": "gpt-4", "token_ids": [1], "sampling_params": {"max_tokens": 4}}, 404, "The model `gpt-4` does not exist"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 4, "bad_words": ["a"]}}, 400,
     "sampling_params.bad_words=['a'] is not supported"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 4, "logit_bias": {"5": 1.0}}}, 400, "logit_bias"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": "4"}}, 400, "at `$.sampling_params.max_tokens`"),
    ({"token_ids": [1], "sampling_params": None}, 400, "at `$.sampling_params`"),
    ({"token_ids": [1], "cache_salt": "a", "sampling_params": {"max_tokens": 4, "cache_salt": "b"}}, 400,
     "cache_salt 'a' and sampling_params.cache_salt 'b' differ"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 4, "stop": ["\n"]}}, 400, "stop strings"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 4, "repetition_penalty": 1.2}}, 400, "repetition_penalty"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400, "max_tokens=0 must be >= 1"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 4, "top_p": 0}}, 400, "top_p"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 4, "stop_token_ids": [VOCAB]}}, 400, "stop token id"),
    ({"token_ids": [1], "stream": True}, 400, "stream"),
])
def test_generate_bad_input_is_400_naming_the_problem(server, body, status, needle):
    raw = body if isinstance(body, bytes) else None
    got, r = post(server, "/inference/v1/generate", None if raw is not None else body, raw=raw)
    assert got == status, r
    assert needle in r["error"]["message"], r["error"]["message"]


# prime-rl's rollout request: its extra_body merged into sampling_params by verifiers' TrainClient (see
# docs/serve.md), the salt its policy step
PRIME_RL_SAMPLING = {"top_k": -1, "min_p": 0.0, "return_token_ids": True, "cache_salt": "3", "temperature": 0.0,
                     "top_p": 1.0, "max_tokens": 4, "logprobs": 1, "stop_token_ids": [2], "skip_special_tokens": False}


def test_generate_takes_prime_rl_sampling_params_and_counts_unknown_keys(server):
    status, r = post(server, "/inference/v1/generate", {"token_ids": [7, 8], "sampling_params": PRIME_RL_SAMPLING},
                     headers={"X-Session-ID": "prime-rl-rollout-1"})
    assert status == 200 and len(r["choices"][0]["token_ids"]) >= 1, r
    # the salt in sampling_params equal to the top-level one is one salt
    status, r = post(server, "/inference/v1/generate", {"token_ids": [7, 8], "cache_salt": "3",
                                                        "sampling_params": PRIME_RL_SAMPLING})
    assert status == 200, r
    assert metric(server, "unknown_sampling_params_total", key="return_token_ids") == 0
    # a key neither vLLM nor tito knows is ignored (as vLLM's server does), counted per key; vLLM's internal
    # knobs and fields at values that ask for nothing are no unknown keys
    body = {"token_ids": [7, 8], "sampling_params": {"max_tokens": 2, "tempurature": 0.5, "flat_logprobs": True,
                                                     "bad_words": [], "watermarking": False}}
    for _ in range(2):
        status, r = post(server, "/inference/v1/generate", body)
        assert status == 200, r
    assert metric(server, "unknown_sampling_params_total", key="tempurature") == 2
    assert metric(server, "unknown_sampling_params_total", key="flat_logprobs") == 0


def test_models_health_and_completions(server):
    _, models = request(server, "GET", "/v1/models")
    (card,) = models["data"]
    assert card["id"] == "qwen-test" and card["max_model_len"] == MAX_LEN
    status, health = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and len(health["engines"]) == 2
    status, r = post(server, "/v1/completions", {"model": "qwen-test", "prompt": [3, 4, 5], "max_tokens": 5,
                                                 "temperature": 0, "return_token_ids": True, "logprobs": 1,
                                                 "return_tokens_as_token_ids": True})
    assert status == 200, r
    choice = r["choices"][0]
    assert choice["prompt_token_ids"] == [3, 4, 5] and len(choice["token_ids"]) == 5
    assert choice["text"] == reference(QWEN).decode(choice["token_ids"])
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    status, batch = post(server, "/v1/completions", {"prompt": [[3, 4], [5, 6, 7]], "max_tokens": 2, "n": 2,
                                                     "return_token_ids": True})
    assert status == 200 and [c["prompt_token_ids"] for c in batch["choices"]] == [[3, 4], [3, 4], [5, 6, 7], [5, 6, 7]]
    assert batch["usage"]["prompt_tokens"] == 5 and batch["usage"]["completion_tokens"] == 8
    status, r = post(server, "/v1/completions", {"prompt": "text please", "max_tokens": 2})
    assert status == 400 and "send token ids" in r["error"]["message"]


# ---- aborts, pause, weights ----------------------------------------------------------------------


def _long_body(rid: str) -> dict:
    return {"token_ids": [42, 43], "request_id": rid,
            "sampling_params": {"max_tokens": 900, "ignore_eos": True, "temperature": 0}}


def _engines_idle(srv, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, h = request(srv, "GET", "/health")
        if all(e["backend"]["running"] == 0 for e in h["engines"] if e.get("ok")):
            return True
        time.sleep(0.05)
    return False


def test_abort_requests_returns_abort(server):
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.update(r=post(server, "/inference/v1/generate", _long_body("to-abort"))))
    t.start()
    time.sleep(0.5)
    status, r = post(server, "/inference/v1/abort_requests", {"request_ids": ["to-abort", "unknown-id"]})
    assert status == 200 and r["aborted"] == ["to-abort"]
    t.join(10)
    status, r = out["r"]
    assert status == 200 and r["choices"][0]["finish_reason"] == "abort"
    assert 0 < len(r["choices"][0]["token_ids"]) < 900


def test_client_disconnect_aborts_the_engine_request(server):
    before = metric(server, "aborts_total", cause="client_disconnect")
    body = json.dumps(_long_body("hangs-up")).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    time.sleep(0.5)
    _, h = request(server, "GET", "/health")
    assert sum(e["backend"]["running"] for e in h["engines"]) == 1  # it is running
    assert sum(e["running"] for e in prime_rl_load(request(server, "GET", "/metrics")[1]).values()) == 1
    sock.close()  # 900 tokens x 2 ms: it would run ~1.5 s more
    assert _engines_idle(server, 0.8), "the engine kept generating for a client that hung up"
    assert metric(server, "aborts_total", cause="client_disconnect") == before + 1
    assert metric(server, "finish_total", finish="abort") >= 1
    status, r = post(server, "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
    assert status == 200 and len(r["choices"][0]["token_ids"]) == 3


def test_pause_resume_and_update_weights(server):
    import threading

    status, r = post(server, "/pause?mode=wait", {})
    assert status == 200 and request(server, "GET", "/is_paused")[1] == {"is_paused": True}
    out = {}
    t = threading.Thread(target=lambda: out.update(r=post(server, "/inference/v1/generate", {
        "token_ids": [9], "sampling_params": {"max_tokens": 2}})))
    t.start()
    time.sleep(0.4)
    assert "r" not in out, "a request was served while paused"
    # prime-rl reads the held request as waiting (deferred: it waits for the pause, not for KV room); the replay
    # engines report no scheduler: no KV budget is claimed for them
    load = prime_rl_load(request(server, "GET", "/metrics")[1])
    assert (load["0"]["waiting"], load["0"]["waiting_capacity"], load["0"]["kv_capacity_tokens"]) == (1, 0, None)
    assert sum(e["running"] for e in load.values()) == 0
    post(server, "/resume", {})
    t.join(10)
    assert out["r"][0] == 200
    import torch
    from safetensors.torch import save_file

    root = Path(server.state.weights_root)
    for step in ("step-7", "step-8"):  # the replay engines load nothing: a checkpoint the server accepts
        (root / step).mkdir(exist_ok=True)
        save_file({"w": torch.zeros(2)}, str(root / step / "model.safetensors"))
    status, r = post(server, "/update_weights", {"weight_dir": str(root / "step-7"), "version": 7})
    assert status == 200 and r == {"status": "ok", "weight_version": 7}
    _, r = post(server, "/inference/v1/generate", {"token_ids": [9], "sampling_params": {"max_tokens": 2}})
    assert [s["version"] for s in r["choices"][0]["weight_versions"]] == ["7"]
    assert metric(server, "weight_version") == 7 and request(server, "GET", "/is_paused")[1]["is_paused"] is False
    # prime-rl sends no version: the version increments
    status, r = post(server, "/update_weights", {"weight_dir": "step-8"})  # relative to server.weights_root
    assert status == 200 and r["weight_version"] == 8
    _, r = post(server, "/inference/v1/generate", {"token_ids": [9], "sampling_params": {"max_tokens": 2}})
    assert [s["version"] for s in r["choices"][0]["weight_versions"]] == ["8"]
    status, r = post(server, "/update_weights", {"version": 9})
    assert status == 400 and r["error"]["param"] == "weight_dir"


def test_replay_engines_cannot_sleep_501_and_stay_awake(server):
    status, r = post(server, "/sleep", {"level": 1})
    assert status == 501 and "replay" in r["error"]["message"] and "sleep" in r["error"]["message"], r
    assert request(server, "GET", "/is_sleeping")[1] == {"is_sleeping": False}
    assert post(server, "/inference/v1/generate", {"token_ids": [9], "sampling_params": {"max_tokens": 2}})[0] == 200
    assert post(server, "/reset_prefix_cache", None) == (200, {"success": True})  # nothing is cached by replay
    assert request(server, "GET", "/get_world_size") == (200, {"world_size": 2})


# ---- chat sessions -------------------------------------------------------------------------------


def chat(srv, messages, session=None, **extra):
    headers = {"X-Session-ID": session} if session else {}
    body = {"model": "qwen-test", "messages": messages, "tools": TOOLS, "max_tokens": 40, "return_token_ids": True,
            "logprobs": True, **extra}
    return post(srv, "/v1/chat/completions", body, headers=headers)


def test_session_bridges_append_only_then_breaks_on_edited_history(server):
    sid = "sess-tools"
    status, r1 = chat(server, FIRST, sid)
    assert status == 200, r1
    c1 = r1["choices"][0]
    # the recorded completion was found: the server's render equals transformers' token for token
    assert r1["prompt_token_ids"] == hf_prompt(FIRST, TOOLS)
    assert c1["token_ids"] == tool_call_ids() and c1["finish_reason"] == "tool_calls"
    (call,) = c1["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert c1["tool_call_attempts"] == [{"name": "add", "status": "ok", "error": None, "raw": call_raw(c1)}]
    assert r1["session"] == {"id": sid, "turn": 0, "prompt": "first", "break": None, "ended": False}

    # turn 2: the client echoes the assistant message (as OpenAI clients do) and adds the tool result
    messages = [*FIRST, c1["message"], {"role": "tool", "tool_call_id": call["id"], "content": "3"}]
    status, r2 = chat(server, messages, sid)
    assert status == 200 and r2["session"]["prompt"] == "bridged", r2
    prefix = r1["prompt_token_ids"] + c1["token_ids"]
    assert r2["prompt_token_ids"][: len(prefix)] == prefix  # append-only: the sampled tokens are kept as sampled
    # the appended part is what the template puts after a tool result (transformers' render of the same turn)
    full = hf_prompt(messages, TOOLS)
    assert r2["prompt_token_ids"][len(prefix):] == full[len(full) - (len(r2["prompt_token_ids"]) - len(prefix)):]
    c2 = r2["choices"][0]

    # turn 3: an edited history (the first user message changed) is not silently bridged
    edited = [FIRST[0], {"role": "user", "content": "What is 2 + 2?"}, *messages[2:], c2["message"],
              {"role": "user", "content": "thanks"}]
    status, r3 = chat(server, edited, sid)
    assert status == 200 and r3["session"]["prompt"] == "break"
    assert r3["session"]["break"]["reason"] == "history_edited" and "message 1" in r3["session"]["break"]["detail"]
    assert r3["prompt_token_ids"] == hf_prompt(edited, TOOLS)  # a new segment from a full render

    status, sample = request(server, "GET", f"/v1/sessions/{sid}/sample")
    assert status == 200 and sample["turns"] == 3 and sample["bridged_turns"] == 1
    assert [b["reason"] for b in sample["breaks"]] == ["history_edited"]
    seg0, seg1 = sample["segments"]
    assert seg0["token_ids"] == r2["prompt_token_ids"] + c2["token_ids"]
    trainable = [t for t, m in zip(seg0["token_ids"], seg0["loss_mask"]) if m]
    assert trainable == c1["token_ids"] + c2["token_ids"]  # only what the engine sampled
    assert [lp for lp, m in zip(seg0["logprobs"], seg0["loss_mask"]) if m][: len(c1["token_ids"])] == [-0.5] * len(
        c1["token_ids"])
    # message attribution: turn 1's sampled tokens belong to message 2 (the assistant), the tool result to 3
    first_sampled = len(r1["prompt_token_ids"])
    assert seg0["message_index"][first_sampled] == 2 and 3 in seg0["message_index"][len(prefix):]
    assert seg1["token_ids"] == r3["prompt_token_ids"] + r3["choices"][0]["token_ids"]
    assert sum(seg1["loss_mask"]) == len(r3["choices"][0]["token_ids"])
    assert metric(server, "breaks_total", reason="history_edited") >= 1
    assert metric(server, "session_turns_total", kind="bridged") >= 1

    status, r = request(server, "DELETE", f"/v1/sessions/{sid}")
    assert status == 200 and r["deleted"] is True
    assert request(server, "GET", f"/v1/sessions/{sid}/sample")[0] == 404
    assert request(server, "DELETE", f"/v1/sessions/{sid}")[0] == 404


def call_raw(choice) -> str:
    return TOOL_CALL_TEXT.removeprefix("<tool_call>").removesuffix("</tool_call>")


def test_session_tools_changed_and_renderer_break_reasons(server):
    sid = "sess-plain"
    msgs = [{"role": "user", "content": "Say hi."}]
    _, r1 = chat(server, msgs, sid, tools=None)
    assert r1["choices"][0]["finish_reason"] == "length"  # synthetic: truncated at max_tokens
    # a truncated turn is still bridged: the turn close is synthesized as context
    msgs2 = [*msgs, r1["choices"][0]["message"], {"role": "user", "content": "Again."}]
    _, r2 = chat(server, msgs2, sid, tools=None)
    assert r2["session"]["prompt"] == "bridged"
    prefix = r1["prompt_token_ids"] + r1["choices"][0]["token_ids"]
    assert r2["prompt_token_ids"][: len(prefix) + 1] == prefix + [IM_END]
    # new tools mid-session: a break with its reason, not a silent re-render
    msgs3 = [*msgs2, r2["choices"][0]["message"], {"role": "user", "content": "Use a tool."}]
    _, r3 = chat(server, msgs3, sid)
    assert r3["session"]["break"]["reason"] == "tools_changed"
    # an assistant message among the new ones was not sampled here: the renderer's own Break reason
    msgs4 = [*msgs3, r3["choices"][0]["message"], {"role": "user", "content": "x"},
             {"role": "assistant", "content": "injected"}, {"role": "user", "content": "y"}]
    _, r4 = chat(server, msgs4, sid)
    assert r4["session"]["break"]["reason"] == "assistant_in_new_messages"
    _, sample = request(server, "GET", f"/v1/sessions/{sid}/sample")
    assert [b["reason"] for b in sample["breaks"]] == ["tools_changed", "assistant_in_new_messages"]
    assert len(sample["segments"]) == 3


def test_session_bad_input_and_stateless_chat(server):
    status, r = chat(server, [{"role": "robot", "content": "x"}], "sess-bad")
    assert status == 400 and "role" in r["error"]["message"]
    status, r = chat(server, [{"role": "user", "content": "x"}], "sess-bad", n=2)
    assert status == 400 and "n must be 1" in r["error"]["message"]
    status, r = chat(server, [{"role": "user", "content": "x"}], None,
                     response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}}})
    assert status == 400 and r["error"]["param"] == "response_format"
    status, r = chat(server, [{"role": "user", "content": "x"}], None, tool_choice="required")
    assert status == 400 and "tool_choice" in r["error"]["message"]
    status, r = chat(server, [{"role": "user", "content": "x"}], None, max_tokens=MAX_LEN)
    assert status == 400 and "exceeds max_model_len" in r["error"]["message"]
    # without a session: rendered from scratch every call, n completions
    status, r = chat(server, FIRST, None, n=2, temperature=1.0, seed=1)
    assert status == 200 and len(r["choices"]) == 2 and "session" not in r
    assert r["prompt_token_ids"] == hf_prompt(FIRST, TOOLS)


def listing(srv) -> dict:
    status, r = request(srv, "GET", "/v1/sessions")
    assert status == 200
    return {s["id"]: s for s in r["sessions"]}


def test_sessions_listed_and_ended_by_header_or_route(server):
    a, b = "sess-end-header", "sess-end-delete"
    hello = [{"role": "user", "content": "hello"}]
    status, r = chat(server, hello, a, tools=None)
    assert status == 200 and r["session"]["ended"] is False
    assert chat(server, hello, b, tools=None)[0] == 200
    held = listing(server)
    tokens = len(r["prompt_token_ids"]) + len(r["choices"][0]["token_ids"])
    assert held[a]["turns"] == 1 and held[a]["tokens"] == tokens and held[a]["breaks"] == 0
    # payload bytes: the ids kept for the next bridge (int64) + the sample's id, logprob and mask per token
    assert held[a]["bytes"] == 8 * tokens + (8 + 4 + 1) * tokens and held[a]["idle_s"] >= 0
    assert list(held).index(a) < list(held).index(b)  # least recently used first

    # the last turn says so: the session is ended once that turn is recorded
    second = [*hello, r["choices"][0]["message"], {"role": "user", "content": "bye"}]
    ended = metric(server, "sessions_ended_total", how="header")
    status, r2 = post(server, "/v1/chat/completions", {"model": "qwen-test", "messages": second, "max_tokens": 8},
                      headers={"X-Session-ID": a, "X-Session-End": "true"})
    assert status == 200 and r2["session"]["ended"] is True and r2["session"]["prompt"] == "bridged"
    assert a not in listing(server) and request(server, "GET", f"/v1/sessions/{a}/sample")[0] == 404
    assert metric(server, "sessions_ended_total", how="header") == ended + 1

    # bad header values are refused before any session opens
    for headers, needle in [({"X-Session-ID": "sess-end-bad", "X-Session-End": "soon"}, "true or false"),
                            ({"X-Session-End": "1"}, "X-Session-ID")]:
        status, r = post(server, "/v1/chat/completions", {"model": "qwen-test", "messages": hello, "max_tokens": 4},
                         headers=headers)
        assert status == 400 and needle in r["error"]["message"] and r["error"]["param"] == "X-Session-End"
    assert "sess-end-bad" not in listing(server)
    # a last turn refused with 400 leaves the session: the client may send it again
    status, _ = post(server, "/v1/chat/completions", {"model": "qwen-test", "messages": hello, "max_tokens": 4,
                                                      "temperature": -1}, headers={"X-Session-ID": b, "X-Session-End": "1"})
    assert status == 400 and b in listing(server)

    status, r = request(server, "DELETE", f"/v1/sessions/{b}")
    assert status == 200 and r["deleted"] is True and b not in listing(server)
    assert request(server, "DELETE", f"/v1/sessions/{b}")[0] == 404


def test_streamed_last_turn_ends_its_session_when_the_stream_ends(server):
    sid = "sess-end-stream"
    hello = [{"role": "user", "content": "hello"}]
    assert chat(server, hello, sid, tools=None)[0] == 200
    req = urllib.request.Request(server.url + "/v1/chat/completions", method="POST", data=json.dumps({
        "model": "qwen-test", "messages": hello, "max_tokens": 8, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "X-Session-ID": sid, "X-Session-End": "true"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["session"]["ended"] is True  # the last chunk carries the session, marked as ending
    deadline = time.monotonic() + 5
    while sid in listing(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sid not in listing(server)


def test_idle_sessions_are_evicted_least_recently_used_first_over_the_memory_bound(server):
    sm = server.state.sessions
    # the module's 2 s idle timeout would end a session by age on a loaded machine before the bound does
    saved_timeout, sm.idle_timeout_s = sm.idle_timeout_s, 900.0
    ids = ["sess-mem-0", "sess-mem-1", "sess-mem-2"]
    for sid in ids:
        assert chat(server, [{"role": "user", "content": f"hello {sid}"}], sid, tools=None)[0] == 200
    held = listing(server)
    bound = held[ids[1]]["bytes"] + held[ids[2]]["bytes"]  # room for the two most recent only
    evicted = metric(server, "sessions_ended_total", how="evicted")
    saved = sm.max_idle_bytes
    sm.max_idle_bytes = bound
    try:
        deadline = time.monotonic() + 5
        while ids[0] in listing(server) and time.monotonic() < deadline:
            time.sleep(0.05)  # the sweep (every 0.5 s here) enforces the bound
        held = listing(server)
        assert ids[0] not in held and ids[1] in held and ids[2] in held
        assert sum(s["bytes"] for s in held.values()) <= bound
        assert metric(server, "sessions_ended_total", how="evicted") >= evicted + 1
        assert 0 < metric(server, "sessions_bytes") <= bound
    finally:
        sm.max_idle_bytes = saved
        sm.idle_timeout_s = saved_timeout
        for sid in ids:
            request(server, "DELETE", f"/v1/sessions/{sid}")


def test_session_byte_count_tracks_the_memory_really_held():
    """sessions.max_idle_bytes bounds the payload count; it must follow what Python really allocates for the
    sessions (SessionManager + a real RendererService, in-process), measured with tracemalloc over 10 four-turn
    chats after 10 warm-up ones (so one-time costs such as the template's compilation are excluded)."""
    import asyncio
    import random
    import tracemalloc

    from rollout.handles import LocalRenderer
    from rollout.renderer_service import RendererService
    from rollout.serve.sessions import SessionManager

    sm = SessionManager([LocalRenderer(RendererService(str(tokenizer_dir(QWEN))))], idle_timeout_s=900, max_sessions=100)
    rng = random.Random(0)

    async def chats(first: int, count: int) -> None:
        for k in range(first, first + count):
            s = sm.open(f"mem-{k}")
            msgs = [{"role": "user", "content": "hello " * 50}]
            for _ in range(4):
                await sm.prepare(s, msgs, None)
                completion = [rng.randrange(1000, 150000) for _ in range(200)] + [IM_END]
                answer = {"role": "assistant", "content": "x" * 200}
                await sm.record(s, completion, [-0.5] * len(completion), 0, answer)
                msgs = [*msgs, answer, {"role": "user", "content": "more " * 30}]

    asyncio.run(chats(0, 10))
    tracemalloc.start()
    try:
        before, payload_before = tracemalloc.get_traced_memory()[0], sm.nbytes
        asyncio.run(chats(10, 10))
        traced, payload = tracemalloc.get_traced_memory()[0] - before, sm.nbytes - payload_before
    finally:
        tracemalloc.stop()
    print(f"payload {payload} B, traced {traced} B: {traced / payload:.2f}x")
    assert 1.5 < traced / payload < 6, (traced, payload)


def test_idle_sessions_expire(server):
    sid = "sess-idle"
    assert chat(server, [{"role": "user", "content": "hello"}], sid)[0] == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and request(server, "GET", f"/v1/sessions/{sid}/sample")[0] == 200:
        time.sleep(0.25)
    assert request(server, "GET", f"/v1/sessions/{sid}/sample")[0] == 404
    assert metric(server, "sessions_expired_total") >= 1


def test_metrics_exposition(server):
    _, text = request(server, "GET", "/metrics")
    for needle in ('tito_requests_total{route="/inference/v1/generate",status="200"}',
                   "tito_request_latency_seconds_bucket", "tito_engine_seconds_count", "tito_server_overhead_seconds_sum",
                   "tito_prompt_tokens_total", "tito_completion_tokens_total", "tito_cache_reuse_ratio",
                   'tito_engine_load{engine="1"}', "# TYPE tito_breaks_total counter"):
        assert needle in text, needle
    assert metric(server, "requests_total", route="/inference/v1/generate", status="400") >= 10


# ---- last: an engine dies ------------------------------------------------------------------------


def test_engine_death_is_503_for_its_request_and_the_server_keeps_serving(server):
    state = server.state
    victim = state.fleet.engines[0]
    ray.kill(victim.actor)
    time.sleep(0.5)
    statuses = [post(server, "/inference/v1/generate", {"token_ids": [1, 2, i], "sampling_params": {"max_tokens": 2}})
                for i in range(4)]
    codes = [s for s, _ in statuses]
    assert set(codes) <= {200, 503} and codes.count(200) >= 3, codes
    assert all("died" in r["error"]["message"] for s, r in statuses if s == 503)
    status, health = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "degraded"
    assert post(server, "/inference/v1/generate", {"token_ids": [3], "sampling_params": {"max_tokens": 2}})[0] == 200


def test_http_client_keepalive_many_requests(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for i in range(20):
        conn.request("POST", "/inference/v1/generate", json.dumps({"token_ids": [i + 1], "sampling_params": {
            "max_tokens": 1}}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and len(json.loads(resp.read())["choices"][0]["token_ids"]) == 1
    conn.close()


# ---- routing (no Ray: the same Fleet over plain backends) ---------------------------------------


def test_fleet_sticky_per_key_falls_back_to_least_loaded_and_forgets_keyless():
    import asyncio

    from rollout.engines.protocol import GenerateRequest, SamplingParams
    from rollout.engines.replay import ReplayEngine
    from rollout.handles import LocalEngine
    from rollout.serve.fleet import Fleet

    engines = [ReplayEngine(synthetic=True, vocab_size=100, max_model_len=512, token_delay_s=0.005) for _ in range(2)]
    fleet = Fleet([LocalEngine(e) for e in engines], [e.info() for e in engines], overload_factor=1.5)

    def req(rid, n_tokens=3):
        return GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=n_tokens, temperature=0))

    async def main():
        homes = [(await fleet.generate(req(f"a{t}"), key="salt-A"))[2] for t in range(3)]
        assert len(set(homes)) == 1, homes  # one key, one engine (where its KV is)
        other = [(await fleet.generate(req(f"b{t}"), key="salt-B"))[2] for t in range(3)]
        assert len(set(other)) == 1
        # many concurrent requests of one key: its engine gets overloaded, the rest go to the least loaded
        outs = await asyncio.gather(*(fleet.generate(req(f"c{i}", 40), key="salt-C") for i in range(6)))
        assert {i for _, _, i in outs} == {0, 1} and fleet.router.moves >= 1
        # keyless requests go to the least loaded engine and leave no routing entry behind
        await asyncio.gather(*(fleet.generate(req(f"d{i}")) for i in range(5)))
        assert not any(k.startswith("d") for k in fleet.router.home) and fleet.in_flight == 0
        assert fleet.router.load == [0, 0]

    asyncio.run(main())


# ---- an engine that fails requests (no Ray: plain backends behind the same app) -------------------


class FlakyEngine:
    """A replay engine that fails every request whose prompt starts with token 13 (an engine-side fault,
    not bad input), once with an exception and once with finish_reason "error"."""

    def __init__(self) -> None:
        from rollout.engines.replay import ReplayEngine

        self.inner = ReplayEngine(synthetic=True, vocab_size=VOCAB, max_model_len=MAX_LEN, token_delay_s=0.002)
        self.calls = 0
        self.fail_next = False

    def info(self):
        return self.inner.info()

    async def abort(self, request_id):
        return await self.inner.abort(request_id)

    async def update_weights(self, path, version):
        await self.inner.update_weights(path, version)

    async def generate(self, request):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("engine restarted")
        if request.prompt_ids[0] == 13:
            self.calls += 1
            if self.calls % 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            out = await self.inner.generate(request)
            for r in out.results:
                r.finish_reason, r.error = "error", "worker crashed"
            return out
        return await self.inner.generate(request)


def test_engine_failure_is_500_for_that_request_and_the_server_keeps_serving():
    from rollout.handles import LocalEngine, LocalRenderer
    from rollout.renderer_service import RendererService
    from rollout.serve.app import ServerState
    from rollout.serve.fleet import Fleet
    from rollout.serve.launch import ServerThread
    from rollout.serve.sessions import SessionManager
    from tito_renderers import create_renderer

    from ._support import ours

    engine = FlakyEngine()
    state = ServerState(fleet=Fleet([LocalEngine(engine)], [engine.info()]),
                        sessions=SessionManager([LocalRenderer(RendererService(str(tokenizer_dir(QWEN))))], idle_timeout_s=60,
                                                max_sessions=2),
                        parser=create_renderer(ours(QWEN)), model_names=["flaky"], root="flaky")
    srv = ServerThread(state).start()
    try:
        status, r = post(srv, "/inference/v1/generate", {"token_ids": [13, 1], "sampling_params": {"max_tokens": 3}})
        assert status == 500 and "illegal memory access" in r["error"]["message"]
        status, r = post(srv, "/inference/v1/generate", {"token_ids": [13, 2], "sampling_params": {"max_tokens": 3}})
        assert status == 500 and "worker crashed" in r["error"]["message"]
        status, r = post(srv, "/inference/v1/generate", {"token_ids": [14, 1], "sampling_params": {"max_tokens": 3}})
        assert status == 200 and len(r["choices"][0]["token_ids"]) == 3
        # a session turn that failed is not recorded; the same messages again retry it
        msgs = [{"role": "user", "content": "hi"}]
        engine.fail_next = True
        status, r = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3}, headers={"X-Session-ID": "s"})
        assert status == 500 and "engine restarted" in r["error"]["message"]
        status, r = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "return_token_ids": True},
                         headers={"X-Session-ID": "s"})
        assert status == 200 and r["session"]["prompt"] == "retry"
        _, sample = request(srv, "GET", "/v1/sessions/s/sample")
        (seg,) = sample["segments"]
        assert seg["token_ids"] == r["prompt_token_ids"] + r["choices"][0]["token_ids"] and sum(seg["loss_mask"]) == 3
        assert metric(srv, "engine_errors_total") == 3 and metric(srv, "finish_total", finish="length") >= 2
        # sessions.max_sessions: a third session is refused, an existing one goes on
        assert post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2}, headers={"X-Session-ID": "t"})[0] == 200
        status, r = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2}, headers={"X-Session-ID": "u"})
        assert status == 429 and "max_sessions" in r["error"]["message"]
        # pause(mode=abort): the running request comes back aborted, new ones wait for resume
        import threading

        out = {}
        t = threading.Thread(target=lambda: out.update(r=post(srv, "/inference/v1/generate", {
            "token_ids": [14, 2], "sampling_params": {"max_tokens": 900, "ignore_eos": True}})))
        t.start()
        time.sleep(0.3)
        assert post(srv, "/pause?mode=abort", {})[0] == 200
        t.join(10)
        assert out["r"][0] == 200 and out["r"][1]["choices"][0]["finish_reason"] == "abort"
        assert metric(srv, "aborts_total", cause="pause") == 1 and metric(srv, "paused") == 1
        post(srv, "/resume", {})
        assert post(srv, "/inference/v1/generate", {"token_ids": [14], "sampling_params": {"max_tokens": 2}})[0] == 200
    finally:
        srv.stop()


def test_serve_config_file_and_validation():
    from rollout.config import ConfigError

    from ._support import REPO

    cfg = load_config(REPO / "configs" / "serve.yaml", schema=ServeConfig)
    assert (cfg.server.host, cfg.server.port, cfg.engine.backend) == ("127.0.0.1", 8000, "embedded")
    with pytest.raises(ConfigError, match="engine_in_process supports the replay and embedded"):
        load_config(None, ["engine.backend=vllm", "engine_in_process=true"], schema=ServeConfig)
    with pytest.raises(ConfigError, match="sessions.idle_timeout_s"):
        load_config(None, ["sessions.idle_timeout_s=0"], schema=ServeConfig)
