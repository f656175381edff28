"""`tito serve` refuses bad input with a 400 naming the field and keeps serving (no 500, no session
left behind): duplicate request ids, out-of-range sampling values, deeply nested and oversized bodies,
template kwargs that would override the server's own arguments; and a deleted session's rows are on
disk when the DELETE returns.

The server runs replay engines in-process (no Ray: quick to start) over real HTTP on loopback, with the
Qwen2.5 tokenizer fixture and a real RendererService writing real Arrow shards.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from ._support import http_call, ours, tokenizer_dir

QWEN = "qwen2.5-7b-instruct"
VOCAB = 151665
MAX_LEN = 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from rollout.engines.replay import ReplayEngine
    from rollout.handles import LocalEngine, LocalRenderer
    from rollout.renderer_service import RendererService
    from rollout.serve.app import ServerState
    from rollout.serve.fleet import Fleet
    from rollout.serve.launch import ServerThread
    from rollout.serve.sessions import SessionManager
    from tito_renderers import create_renderer

    out = tmp_path_factory.mktemp("shards")
    engines = [ReplayEngine(synthetic=True, vocab_size=VOCAB, max_model_len=MAX_LEN, token_delay_s=0.002)
               for _ in range(2)]
    service = RendererService(str(tokenizer_dir(QWEN)), out_dir=str(out), rows_per_file=1024)
    state = ServerState(fleet=Fleet([LocalEngine(e) for e in engines], [e.info() for e in engines]),
                        sessions=SessionManager([LocalRenderer(service)], idle_timeout_s=600, max_sessions=100, write_samples=True),
                        parser=create_renderer(ours(QWEN)), model_names=["qwen-test"], root="qwen-test",
                        default_max_tokens=16)
    srv = ServerThread(state).start()
    srv.out_dir = out
    yield srv
    srv.stop()


def call(srv, method: str, path: str, body=None, headers=None, raw: bytes | None = None, timeout=60):
    return http_call(srv.url + path, method, body, headers, raw, timeout)


def still_serving(srv) -> None:
    status, r = call(srv, "POST", "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert status == 200 and len(r["choices"][0]["token_ids"]) == 2, r


def session_ids(srv) -> set[str]:
    status, r = call(srv, "GET", "/v1/sessions")
    assert status == 200
    return {s["id"] for s in r["sessions"]}


USER = [{"role": "user", "content": "hi"}]


def _nested(depth: int) -> bytes:
    return b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}"


@pytest.mark.parametrize("path,body,param,needle", [
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 2, "seed": 2**63}},
     "sampling_params.seed", "seed"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 2, "seed": -(2**63) - 1}},
     "sampling_params.seed", "seed"),
    ("/v1/chat/completions", {"messages": USER, "seed": 2**64 - 1}, "seed", "seed"),
    ("/v1/completions", {"prompt": [1, 2], "seed": 2**63}, "seed", "seed"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 2, "temperature": 1e-300}},
     "sampling_params.temperature", "temperature"),
    ("/v1/chat/completions", {"messages": USER, "temperature": 1e-300}, "temperature", "temperature"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 2, "top_k": -2}},
     "sampling_params.top_k", "top_k"),
    ("/v1/chat/completions", {"messages": USER, "top_k": -5}, "top_k", "top_k"),
    ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 2, "logprobs": -1}},
     "sampling_params.logprobs", "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": -1}, "logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt", "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs.messages", "messages"),
    ("/v1/chat/completions", {"messages": USER, "chat_template_kwargs": {"tools": None}},
     "chat_template_kwargs.tools", "tools"),
])
def test_out_of_range_values_are_400_naming_the_field(server, path, body, param, needle):
    status, r = call(server, "POST", path, body)
    assert status == 400, r
    assert needle in r["error"]["message"] and r["error"]["param"] == param, r
    still_serving(server)


@pytest.mark.parametrize("depth", [65, 10_000, 1_000_000])
def test_deeply_nested_json_is_400_before_decoding(server, depth):
    for path in ("/v1/chat/completions", "/inference/v1/generate", "/v1/completions"):
        status, r = call(server, "POST", path, raw=_nested(depth))
        assert status == 400 and "nested" in r["error"]["message"], r
    # inside strings, brackets are text, not nesting
    status, r = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "[" * 300}],
                                                              "max_tokens": 2})
    assert status == 200, r
    still_serving(server)


def _raw_exchange(srv, head: bytes, chunks=()) -> bytes:
    """Send a request head (and body chunks until the server stops reading), return the reply's head."""
    import socket

    sock = socket.create_connection(("127.0.0.1", srv.port))
    reply = b""
    try:
        sock.sendall(head)
        for chunk in chunks:
            sock.sendall(chunk)
    except OSError:  # the server answered and closed while we were still sending
        pass
    sock.settimeout(10)
    try:
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    except OSError:
        pass
    sock.close()
    return reply


def test_oversized_body_is_refused_from_content_length_and_while_reading(server):
    # a declared 50 MB body is refused before a byte of it is sent
    t0 = time.perf_counter()
    reply = _raw_exchange(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {50 * 2**20}\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert time.perf_counter() - t0 < 5
    # a chunked body (no Content-Length) is cut off once it passes the limit while it is read
    chunk = b"a" * 2**20
    reply = _raw_exchange(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                          b"Content-Type: application/json\r\n\r\n",
                          (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" for _ in range(64)))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    still_serving(server)


def test_chat_prompt_too_long_is_refused_before_tokenizing(server):
    # 8 MB of text under the body limit: no token of this vocabulary holds more than max_token_bytes bytes,
    # so it cannot fit in 1024 tokens, and the server says so without tokenizing it
    text = "hello world " * (8 * 2**20 // 12)
    t0 = time.perf_counter()
    status, r = call(server, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
                     headers={"X-Session-ID": "too-long"})
    elapsed = time.perf_counter() - t0
    assert status == 400 and r["error"]["param"] == "messages", r
    assert "bytes of text" in r["error"]["message"] and "max_model_len 1024" in r["error"]["message"]
    assert elapsed < 5, elapsed
    assert "too-long" not in session_ids(server)
    still_serving(server)


def test_invalid_chat_requests_create_no_session(server):
    before = session_ids(server)
    bad = [
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": USER, "max_tokens": MAX_LEN},
        {"messages": USER, "seed": 2**63},
        {"messages": USER, "temperature": -1},
        {"messages": USER, "n": 2},
        {"messages": [{"role": "assistant", "content": "x"}]},
    ]
    for i, body in enumerate(bad):
        status, r = call(server, "POST", "/v1/chat/completions", body, headers={"X-Session-ID": f"invalid-{i}"})
        assert status == 400, (body, r)
    assert session_ids(server) == before
    # the same id then works as a fresh session
    status, r = call(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 3},
                     headers={"X-Session-ID": "invalid-0"})
    assert status == 200 and r["session"]["prompt"] == "first", r
    assert call(server, "DELETE", "/v1/sessions/invalid-0")[0] == 200


def test_duplicate_request_id_is_refused_and_the_first_still_aborts(server):
    out = {}
    body = {"token_ids": [42, 43], "request_id": "dup-1",
            "sampling_params": {"max_tokens": 900, "ignore_eos": True, "temperature": 0}}
    t = threading.Thread(target=lambda: out.update(r=call(server, "POST", "/inference/v1/generate", body)))
    t.start()
    time.sleep(0.3)
    status, r = call(server, "POST", "/inference/v1/generate", {**body, "sampling_params": {"max_tokens": 3}})
    assert status == 409 and "dup-1" in r["error"]["message"] and r["error"]["param"] == "request_id", r
    status, r = call(server, "POST", "/v1/chat/completions", {"messages": USER, "request_id": "dup-1"})
    assert status == 409, r
    status, r = call(server, "POST", "/inference/v1/abort_requests", {"request_ids": ["dup-1"]})
    assert status == 200 and r["aborted"] == ["dup-1"], r
    t.join(10)
    status, r = out["r"]
    assert status == 200 and r["choices"][0]["finish_reason"] == "abort"
    assert 0 < len(r["choices"][0]["token_ids"]) < 900
    # once finished, the id may be used again
    status, r = call(server, "POST", "/inference/v1/generate", {**body, "sampling_params": {"max_tokens": 3}})
    assert status == 200 and len(r["choices"][0]["token_ids"]) == 3


def test_delete_writes_the_sessions_rows_at_once(server):
    import pyarrow as pa

    sid = "flush-me"
    status, r = call(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 4,
                                                              "return_token_ids": True}, headers={"X-Session-ID": sid})
    assert status == 200, r
    status, d = call(server, "DELETE", f"/v1/sessions/{sid}")
    assert status == 200 and d["rows_written"] == 1, d
    rows = []
    for path in sorted(Path(server.out_dir).glob("data/*.arrow")):
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
        rows += [row for row in table.to_pylist() if row["rollout_id"] == sid]
    (row,) = rows
    assert row["task_id"] == sid and row["token_ids"] == r["prompt_token_ids"] + r["choices"][0]["token_ids"]
    assert sum(row["loss_mask"]) == 4


# ---- issue 31: every text bounded, disconnects mid-body, blank session ids, each value its own field -------


def _metrics(srv) -> dict[str, float]:
    _, text = call(srv, "GET", "/metrics")
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines() if not line.startswith("#"))}


BOUND_BYTES = 300_000  # over 256 bytes (Qwen2.5's longest token) x 1023 tokens: the bytes bound refuses it
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("where", ["assistant content", "reasoning_content", "tool call arguments", "tool definition"])
def test_every_text_of_a_chat_request_counts_in_the_bytes_bound(server, where):
    # texts the old bound skipped: each alone cannot fit 1024 tokens, so the request is refused before it is
    # tokenized, even where the template would drop the text (Qwen2.5 renders no reasoning_content)
    big = "x" * BOUND_BYTES
    assistant, tools = {"role": "assistant", "content": "ok"}, None
    if where == "assistant content":
        assistant["content"] = big
    elif where == "reasoning_content":
        assistant["reasoning_content"] = big
    elif where == "tool call arguments":
        assistant["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": big}}}]
    else:
        tools = [{**TOOL, "function": {**TOOL["function"], "description": big}}]
    messages = [*USER, assistant, *([{"role": "tool", "content": "1", "tool_call_id": "c1"}]
                                    if "tool_calls" in assistant else []), {"role": "user", "content": "go"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        status, r = call(server, "POST", path, {"messages": messages, "tools": tools})
        assert status == 400, (path, r)
        assert "bytes of text" in r["error"]["message"] and "max_model_len 1024" in r["error"]["message"], r
        assert r["error"]["param"] == ("tools" if where == "tool definition" else "messages"), r
    still_serving(server)


def test_health_answers_within_a_second_while_four_huge_assistant_messages_are_refused(server):
    # four 24 MB assistant messages at once (under the 32 MB body limit): each is refused by the bytes bound
    # before it is tokenized, and the event loop keeps answering /health
    raw = json.dumps({"messages": [*USER, {"role": "assistant", "content": "hello world " * (2 * 2**20)},
                                   {"role": "user", "content": "go"}]}).encode()
    assert len(raw) > 24 * 2**20
    probes: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            status, _ = call(server, "GET", "/health", timeout=30)
            probes.append(time.perf_counter() - t0)
            assert status == 200
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    while not probes:
        time.sleep(0.01)
    answers: list = []
    senders = [threading.Thread(target=lambda: answers.append(call(server, "POST", "/v1/chat/completions", raw=raw)))
               for _ in range(4)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(120)
    stop.set()
    prober.join(30)
    assert len(probes) >= 3 and max(probes) < 1.0, probes
    assert len(answers) == 4
    for status, r in answers:
        assert status == 400 and r["error"]["param"] == "messages" and "bytes of text" in r["error"]["message"], r


def test_a_client_that_hangs_up_mid_body_is_a_disconnect_not_a_500(server):
    import socket

    route = "/inference/v1/generate"
    before = _metrics(server)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n".encode() + b'{"token_ids": [1, 2, 3')
        time.sleep(0.2)  # the server is reading the body when the client goes
    key = f'tito_requests_total{{route="{route}",status="%s"}}'
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = _metrics(server)
        counted = {k: v - before.get(k, 0.0) for k, v in after.items()
                   if k.startswith(f'tito_requests_total{{route="{route}"') and v != before.get(k, 0.0)}
        if counted:
            break
        time.sleep(0.05)
    assert counted == {key % 499: 1.0}, counted
    assert after.get("tito_engine_errors_total", 0.0) == before.get("tito_engine_errors_total", 0.0)
    disconnects = 'tito_client_disconnects_total{stage="body"}'
    assert after.get(disconnects, 0.0) == before.get(disconnects, 0.0) + 1
    still_serving(server)


@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_session_id_header_is_400_naming_it(server, value):
    before = session_ids(server)
    for path, body in (("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}),
                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 2})):
        for headers in ({"X-Session-ID": value}, {"X-Session-ID": value, "X-Session-End": "true"}):
            status, r = call(server, "POST", path, body, headers=headers)
            assert status == 400 and r["error"]["param"] == "X-Session-ID", (path, headers, r)
            assert "X-Session-ID" in r["error"]["message"], r
    assert session_ids(server) == before
    still_serving(server)


def test_each_invalid_sampling_value_names_its_own_field(server):
    """Every out-of-range sampling value is a 400 whose param (and message) names that field, on the three
    generating routes: never a neighbour's name (max_tokens -1 blamed min_tokens)."""
    cases = {"max_tokens": [-1, 0], "min_tokens": [-1, MAX_LEN + 5], "temperature": [-1, 1e-300],
             "top_p": [0, -0.5, 1.5], "top_k": [-2], "n": [0, -1], "seed": [2**64], "stop_token_ids": [[-1]],
             "prompt_logprobs": [-1, 21]}
    wrong = []
    for name, values in cases.items():
        for v in values:
            for path in ("/inference/v1/generate", "/v1/completions", "/v1/chat/completions"):
                if path == "/inference/v1/generate":
                    body, param = {"token_ids": [1, 2], "sampling_params": {name: v}}, f"sampling_params.{name}"
                elif path == "/v1/completions":
                    body, param = {"prompt": [1, 2], name: v}, name
                else:
                    body, param = {"messages": USER, name: v}, name
                wrong.append((path, name, v, *call(server, "POST", path, body)))
                status, r = wrong[-1][3:]
                if status == 400 and r["error"]["param"] == param and name in r["error"]["message"]:
                    wrong.pop()
    for path, body, param in (
            ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"logprobs": 21}}, "sampling_params.logprobs"),
            ("/v1/completions", {"prompt": [1], "logprobs": -1}, "logprobs"),
            ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": -1}, "max_completion_tokens"),
            ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
            ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 2, "min_tokens": 3}, "min_tokens"),
            # a prompt that leaves no room, no max_tokens sent: the prompt's fault
            ("/inference/v1/generate", {"token_ids": [1] * MAX_LEN}, "token_ids"),
            ("/v1/completions", {"prompt": [1] * MAX_LEN}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 2000}]}, "messages")):
        status, r = call(server, "POST", path, body)
        if not (status == 400 and r["error"]["param"] == param and param.rsplit(".")[-1] in r["error"]["message"]):
            wrong.append((path, body, status, r))
    assert not wrong, "\n".join(map(str, wrong))
    still_serving(server)
