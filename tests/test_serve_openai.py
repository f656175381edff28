"""`tito serve` driven by the official `openai` SDK, streaming included, over loopback HTTP (replay engines
sampling synthetic tokens over SmolLM2's vocabulary, in the server process): a streamed answer concatenates to the whole one for the
same seed (chat and completions), with the same finish_reason and usage; stop strings are held back and
cut where vLLM cuts; a streamed session turn is recorded exactly as a whole one; a client that hangs up
mid-stream aborts the engine request; errors come back as the SDK's BadRequestError naming the param;
/tokenize, /detokenize, /version and JSON 404/405. The reference tokenizer is transformers'.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai  # the dev extra installs it: a missing SDK fails here, it is not skipped
import pytest

from ._support import SMOLLM2, ours, reference, reference_ids, smollm2_gguf

MSGS = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server():
    from rollout.engines.replay import ReplayEngine
    from rollout.handles import LocalEngine, LocalRenderer
    from rollout.renderer_service import RendererService
    from rollout.serve.app import ServerState
    from rollout.serve.fleet import Fleet
    from rollout.serve.launch import ServerThread
    from rollout.serve.sessions import SessionManager
    from tito_renderers import create_renderer

    gguf = str(smollm2_gguf())
    # synthetic replay tokens over SmolLM2's vocabulary (any text, quick); the real engine streams through a
    # Ray actor in test_serve_embedded.py::test_openai_sdk_stream_from_the_engine_actor
    engine = ReplayEngine(synthetic=True, vocab_size=ours(SMOLLM2).vocab_size, max_model_len=1024,
                          token_delay_s=0.001)
    state = ServerState(fleet=Fleet([LocalEngine(engine)], [engine.info()]),
                        sessions=SessionManager([LocalRenderer(RendererService(gguf))], idle_timeout_s=600, max_sessions=100),
                        parser=create_renderer(ours(SMOLLM2)), model_names=["smol"], root=gguf)
    srv = ServerThread(state).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_stream(client, **kw):
    chunks = list(client.chat.completions.create(model="smol", messages=MSGS, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    return chunks, text, finish, usage


def test_chat_stream_equals_the_whole_answer(client):
    whole = client.chat.completions.create(model="smol", messages=MSGS, max_tokens=24, temperature=0.8, seed=7)
    chunks, text, finish, usage = _chat_stream(client, max_tokens=24, temperature=0.8, seed=7)
    assert text == whole.choices[0].message.content and len(text) > 10
    assert finish == [whole.choices[0].finish_reason]
    (u,) = usage
    assert (u.prompt_tokens, u.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    assert u.prompt_tokens == len(reference_ids(SMOLLM2, MSGS, add_generation_prompt=True))
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # token by token, not one blob
    assert chunks[0].choices[0].delta.role == "assistant"


def test_completions_stream_equals_the_whole_answer(client):
    prompt = reference(SMOLLM2)("The capital of France is", add_special_tokens=False)["input_ids"]
    kw = dict(model="smol", prompt=prompt, max_tokens=16, temperature=0.7, seed=3,
              extra_body={"return_token_ids": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    choice = whole.choices[0]
    assert text == choice.text and ids == choice.model_extra["token_ids"]
    assert text == reference(SMOLLM2).decode(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == len(ids)


def test_stop_strings_are_held_back_and_cut(client):
    prompt = reference(SMOLLM2)("Once upon a time", add_special_tokens=False)["input_ids"]
    base = client.completions.create(model="smol", prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"return_token_ids": True}).choices[0]
    text = base.text
    mid = next(i for i in range(len(text) // 2, len(text) - 4)
               if "\ufffd" not in text[i:i + 4] and text[i:i + 4].strip())
    stop = text[mid: mid + 4]  # a piece from the middle, likely spanning a token edge
    cut = text.find(stop)
    for include in (False, True):
        kw = dict(model="smol", prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                  extra_body={"include_stop_str_in_output": include, "return_token_ids": True})
        whole = client.completions.create(**kw).choices[0]
        chunks = list(client.completions.create(stream=True, **kw))
        pieces = [c.choices[0].text for c in chunks if c.choices]
        want = text[: cut + len(stop)] if include else text[:cut]
        assert whole.text == "".join(pieces) == want
        assert whole.finish_reason == "stop" and whole.model_extra["stop_reason"] == stop
        # tokens up to the one that completed the stop string: a prefix of the unstopped completion
        ids = whole.model_extra["token_ids"]
        assert ids == base.model_extra["token_ids"][: len(ids)]
        assert stop in reference(SMOLLM2).decode(ids) and stop not in reference(SMOLLM2).decode(ids[:-1])
        # held back: no chunk ever carried text past the cut
        acc = ""
        for p in pieces:
            acc += p
            assert want.startswith(acc)
    # chat: the content ends before the stop string
    whole = client.chat.completions.create(model="smol", messages=MSGS, max_tokens=24, temperature=0)
    content = whole.choices[0].message.content
    start = next(i for i in range(6, len(content) - 3) if "\ufffd" not in content[i:i + 3] and content[i:i + 3].strip())
    stop = content[start:start + 3]
    _, streamed, finish, _ = _chat_stream(client, max_tokens=24, temperature=0, stop=stop)
    assert streamed == content[: content.find(stop)] and finish == ["stop"]


def test_streamed_session_turn_is_recorded_as_a_whole_one(server, client):
    kw = dict(model="smol", messages=MSGS, max_tokens=12, temperature=0.9, seed=11)
    client.chat.completions.create(**kw, extra_headers={"X-Session-ID": "whole"})
    list(client.chat.completions.create(**kw, stream=True, extra_headers={"X-Session-ID": "streamed"}))
    samples = []
    for sid in ("whole", "streamed"):
        with urllib.request.urlopen(f"{server.url}/v1/sessions/{sid}/sample", timeout=30) as r:
            samples.append(json.loads(r.read()))
    a, b = samples
    assert a["segments"] == b["segments"] and a["turns"] == b["turns"] == 1
    assert sum(a["segments"][0]["loss_mask"]) > 0


def test_client_hanging_up_mid_stream_aborts_the_engine(server, client):
    state = server.state
    before = state.metrics.get("aborts_total", cause="client_disconnect")
    stream = client.chat.completions.create(model="smol", messages=MSGS, max_tokens=900, stream=True,
                                            extra_body={"ignore_eos": True, "request_id": "hang-up"})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert "hang-up" in state.fleet.where
    stream.close()
    deadline = time.monotonic() + 10
    while "hang-up" in state.fleet.where and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "hang-up" not in state.fleet.where, "the engine kept generating for a client that hung up"
    assert state.metrics.get("aborts_total", cause="client_disconnect") == before + 1


def test_errors_are_bad_request_errors_naming_the_param(client):
    for kw, param in ((dict(temperature=1e-300), "temperature"), (dict(top_k=-3), "top_k"),
                      (dict(response_format={"type": "json_object"}), "response_format"),
                      (dict(seed=2**63), "seed"), (dict(max_tokens=5000), "max_tokens")):
        body = {k: v for k, v in kw.items() if k != "top_k"}
        extra = {"top_k": kw["top_k"]} if "top_k" in kw else None
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="smol", messages=MSGS, stream=stream, extra_body=extra, **body)
            assert err.value.param == param, (param, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smol", prompt="text", max_tokens=2)
    assert err.value.param == "prompt"


def test_openai_and_vllm_fields_are_accepted(client, server):
    raw = client.chat.completions.with_raw_response.create(
        model="smol", messages=MSGS, max_tokens=4, temperature=0, response_format={"type": "text"},
        reasoning_effort="low", metadata={"k": "v"}, store=False, logit_bias={"5": 1.0}, presence_penalty=0.5,
        extra_body={"min_p": 0.1, "skip_special_tokens": True, "include_stop_str_in_output": False,
                    "add_generation_prompt": True, "continue_final_message": False,
                    "return_tokens_as_token_ids": True, "add_special_tokens": False})
    ignored = set(raw.headers["x-tito-ignored"].split(","))
    assert ignored == {"min_p", "presence_penalty", "logit_bias", "reasoning_effort"}
    assert raw.parse().choices[0].message.content
    # continue_final_message: the prompt ends inside the assistant message, not after its close
    msgs = [*MSGS, {"role": "assistant", "content": "The sea is"}]
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=3, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True,
                                                   "return_token_ids": True})
    closed = reference_ids(SMOLLM2, msgs)
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt == closed[: len(prompt)] and len(prompt) < len(closed)
    assert reference(SMOLLM2).decode(prompt).endswith("The sea is")


def _http(server, method: str, path: str, body=None):
    req = urllib.request.Request(server.url + path, method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_detokenize_version_and_json_404_405(server):
    hf = reference(SMOLLM2)
    status, r = _http(server, "POST", "/tokenize", {"prompt": "Hello world, the sea.", "add_special_tokens": False})
    assert status == 200 and r["tokens"] == hf("Hello world, the sea.", add_special_tokens=False)["input_ids"]
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    status, r = _http(server, "POST", "/tokenize", {"messages": MSGS})
    assert r["tokens"] == reference_ids(SMOLLM2, MSGS, add_generation_prompt=True)
    status, d = _http(server, "POST", "/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and d["prompt"] == hf.decode(r["tokens"])
    status, d = _http(server, "POST", "/detokenize", {"tokens": [10**9]})
    assert status == 400 and d["error"]["param"] == "tokens"
    status, v = _http(server, "GET", "/version")
    assert status == 200 and v["version"]
    status, e = _http(server, "GET", "/v1/nope")
    assert status == 404 and e["error"]["type"] == "NotFoundError" and "/v1/nope" in e["error"]["message"]
    status, e = _http(server, "GET", "/v1/chat/completions")
    assert status == 405 and e["error"]["code"] == 405
