"""`tito serve` facing clients it cannot trust, over real HTTP on loopback: API keys (as vLLM's --api-key,
with the openai SDK), weight updates confined to ``server.weights_root`` (safetensors only, versions that
only increase), session ids every route can address, request bodies that stop arriving (408), and
/tokenize of large texts (capped; tokenized off the event loop, so /health answers meanwhile).

The servers run replay engines in-process (no Ray: quick to start) with the Qwen2.5 tokenizer fixture.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from ._support import http_call, ours, sigint_default, tokenizer_dir

QWEN = "qwen2.5-7b-instruct"
VOCAB = 151665
USER_KEY = "user-key-5b7f0c"
ADMIN_KEY = "admin-key-91d2e4"
BIG_LEN = 1 << 22  # a max_model_len under which a multi-megabyte text may be tokenized
FORBIDDEN = "weight_dir is not under the directory this server loads weights from (server.weights_root)"


def start(max_len: int, **state_kwargs):
    from rollout.engines.replay import ReplayEngine
    from rollout.handles import LocalEngine, LocalRenderer
    from rollout.renderer_service import RendererService
    from rollout.serve.app import ServerState
    from rollout.serve.fleet import Fleet
    from rollout.serve.launch import ServerThread
    from rollout.serve.sessions import SessionManager
    from tito_renderers import create_renderer

    engine = ReplayEngine(synthetic=True, vocab_size=VOCAB, max_model_len=max_len, token_delay_s=0.001)
    state = ServerState(fleet=Fleet([LocalEngine(engine)], [engine.info()]),
                        sessions=SessionManager([LocalRenderer(RendererService(str(tokenizer_dir(QWEN))))], idle_timeout_s=600,
                                                max_sessions=100),
                        parser=create_renderer(ours(QWEN)), model_names=["qwen-test"], root="qwen-test",
                        default_max_tokens=4, **state_kwargs)
    return ServerThread(state).start()


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(weights_root):
    """Keys, a weights root, a 1 s body deadline, and a max_model_len large enough for megabyte texts."""
    srv = start(BIG_LEN, api_key=USER_KEY, admin_api_key=ADMIN_KEY, weights_root=str(weights_root),
                body_timeout_s=1.0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server():
    """No keys, no weights root, max_model_len 1024: the defaults."""
    srv = start(1024)
    yield srv
    srv.stop()


def call(srv, method: str, path: str, body=None, key: str | None = USER_KEY, headers=None, timeout=60):
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    return http_call(srv.url + path, method, body, {**auth, **(headers or {})}, None, timeout)


# ---- item 14: API keys -------------------------------------------------------------------------------------


def test_routes_need_the_api_key_but_health_and_liveness(server):
    for key in (None, "wrong", USER_KEY[:-1]):
        status, r = call(server, "GET", "/v1/models", key=key)
        assert status == 401 and r["error"]["type"] == "AuthenticationError", r
        assert "server.api_key" in r["error"]["message"] and USER_KEY not in json.dumps(r)
    assert call(server, "POST", "/tokenize", {"prompt": "hi"}, key=None)[0] == 401  # refused before its body
    assert call(server, "GET", "/v1/sessions", key=None)[0] == 401  # no reading every session's samples
    assert call(server, "GET", "/health", key=None)[0] == 200
    assert call(server, "GET", "/liveness", key=None) == (200, {"status": "alive"})
    assert call(server, "GET", "/v1/models")[0] == 200
    # the scheme is case-insensitive, as in vLLM; a key sent any other way is not a key
    assert call(server, "GET", "/v1/models", key=None, headers={"Authorization": f"bearer {USER_KEY}"})[0] == 200
    assert call(server, "GET", "/v1/models", key=None, headers={"Authorization": USER_KEY})[0] == 401
    req = http.client.HTTPConnection(server.host, server.port, timeout=30)
    req.request("GET", "/v1/models")
    resp = req.getresponse()
    assert resp.status == 401 and resp.getheader("WWW-Authenticate") == "Bearer"
    req.close()


def test_admin_routes_take_the_admin_key_alone(server):
    for path in ("/pause", "/resume", "/update_weights", "/sleep", "/wake_up", "/reset_prefix_cache",
                 # the weight-transfer calls that change what is served (rollout/serve/weight_routes.py)
                 "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
                 "/shutdown_weight_transfer_engine", "/update_weight_version", "/weight_checker", "/collective_rpc"):
        status, r = call(server, "POST", path, {})
        assert status == 401 and "server.admin_api_key" in r["error"]["message"], (path, r)
    assert call(server, "POST", "/pause?mode=wait", key=ADMIN_KEY)[0] == 200
    assert call(server, "POST", "/resume", key=ADMIN_KEY)[0] == 200
    assert call(server, "GET", "/v1/models", key=ADMIN_KEY)[0] == 200  # the admin key opens the other routes too
    assert call(server, "GET", "/is_paused")[1] == {"is_paused": False}  # a read-only admin route: the user key
    assert call(server, "GET", "/weight_info")[0] == 200


def test_openai_sdk_api_key(server):
    import openai

    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=USER_KEY, max_retries=0)
    assert [m.id for m in ok.models.list()] == ["qwen-test"]
    out = ok.chat.completions.create(model="qwen-test", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert out.usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.models.list()
    assert exc.value.status_code == 401


def test_the_key_is_never_shown(server, monkeypatch):
    from rollout.config import ServeConfig, load_config
    from rollout.serve.launch import API_KEY_ENV, _secret

    _, text = call(server, "GET", "/server_info")
    _, metrics = call(server, "GET", "/metrics")
    assert USER_KEY not in json.dumps(text) and ADMIN_KEY not in json.dumps(text) and USER_KEY not in metrics
    assert USER_KEY not in repr(server.state)
    cfg = load_config(None, [f"server.api_key={USER_KEY}"], schema=ServeConfig)
    assert USER_KEY not in repr(cfg) and USER_KEY not in cfg.model_dump_json()
    assert _secret(cfg.server.api_key, API_KEY_ENV) == USER_KEY
    # the environment variable, when the config has none; the config wins over it, as vLLM's --api-key
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _secret(None, API_KEY_ENV) == "from-env"
    assert _secret(cfg.server.api_key, API_KEY_ENV) == USER_KEY
    monkeypatch.setenv(API_KEY_ENV, "")
    assert _secret(None, API_KEY_ENV) is None


# ---- item 11: weight updates ----------------------------------------------------------------------------------


def checkpoint(directory: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(2)}, str(directory / "model.safetensors"))
    return directory


def admin(srv, path: str, body=None):
    return call(srv, "POST", path, body, key=ADMIN_KEY)


def test_update_weights_outside_the_root_is_403_saying_nothing(server, weights_root, tmp_path):
    outside = checkpoint(tmp_path / "elsewhere")
    (weights_root / "link").symlink_to(outside)  # resolved before the check: a link out is outside
    for path in ["/etc/shadow", "/etc/passwd", "/etc", "/nonexistent/dir", str(outside), "../../etc",
                 str(weights_root / ".." / "x"), "link", str(weights_root / "link")]:
        status, r = admin(server, "/update_weights", {"weight_dir": path})
        assert (status, r["error"]["message"], r["error"]["param"]) == (403, FORBIDDEN, "weight_dir"), (path, r)
    assert server.state.fleet.weight_version == 0


def test_update_weights_loads_safetensors_only(server, weights_root):
    empty = weights_root / "empty"
    empty.mkdir()
    pickled = checkpoint(weights_root / "pickled")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle
    broken = weights_root / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not a header")
    (weights_root / "file").write_text("x")
    for name, needle in [("empty", "no *.safetensors"), ("pickled", "pytorch_model.bin"),
                         ("broken", "cannot read the safetensors header"), ("file", "not a directory")]:
        status, r = admin(server, "/update_weights", {"weight_dir": str(weights_root / name)})
        assert status == 400 and needle in r["error"]["message"] and r["error"]["param"] == "weight_dir", (name, r)
    assert server.state.fleet.weight_version == 0


def test_weight_versions_only_increase(server, weights_root):
    step = str(checkpoint(weights_root / "step"))
    base = server.state.fleet.weight_version
    assert admin(server, "/update_weights", {"weight_dir": step, "version": base + 7}) == (
        200, {"status": "ok", "weight_version": base + 7})
    for version in (base + 3, -5, base + 7):
        status, r = admin(server, "/update_weights", {"weight_dir": step, "version": version})
        assert status == 409 and r["error"]["param"] == "version", (version, r)
        assert f"the version served now, {base + 7}" in r["error"]["message"]
    # no version (prime-rl): the next one; relative to the root
    assert admin(server, "/update_weights", {"weight_dir": "step"}) == (200, {"status": "ok",
                                                                            "weight_version": base + 8})
    assert server.state.fleet.weight_version == base + 8


def test_without_a_weights_root_every_update_is_403(open_server, tmp_path):
    status, r = call(open_server, "POST", "/update_weights", {"weight_dir": str(checkpoint(tmp_path / "c"))})
    assert status == 403 and "set server.weights_root" in r["error"]["message"], r


# ---- item 10: session ids -----------------------------------------------------------------------------------


def chat(srv, session_id: str | bytes):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.putrequest("POST", "/v1/chat/completions")
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                        ("Authorization", f"Bearer {USER_KEY}"), ("X-Session-ID", session_id)]:
        conn.putheader(name, value)
    conn.endheaders(body)
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_session_ids_are_refused_unless_every_route_can_address_them(server):
    before = {s["id"] for s in call(server, "GET", "/v1/sessions")[1]["sessions"]}
    for sid in ["a/b", "x" * 257, "x" * 10_000, "é中文".encode(), "a b", "..", "a?b", "a%2Fb"]:
        status, r = chat(server, sid)
        assert status == 400 and r["error"]["param"] == "X-Session-ID", (sid, r)
        assert "1 to 256 ASCII letters, digits and . _ : -" in r["error"]["message"]
    assert {s["id"] for s in call(server, "GET", "/v1/sessions")[1]["sessions"]} == before  # none was opened
    for sid in ["run-7:trace.0_x", "x" * 256, "A.b"]:
        status, r = chat(server, sid)
        assert status == 200 and r["session"]["id"] == sid, r
        status, r = call(server, "GET", f"/v1/sessions/{sid}/sample")
        assert status == 200 and r["session_id"] == sid
        assert call(server, "DELETE", f"/v1/sessions/{sid}")[1]["deleted"] is True
    status, r = call(server, "GET", f"/v1/sessions/{'y' * 300}/sample")
    assert status == 400 and r["error"]["param"] == "session_id"


# ---- item 12: slow bodies --------------------------------------------------------------------------------------


def raw_request(srv, head: bytes, parts: list[bytes], gap_s: float) -> tuple[bytes, float]:
    """Send ``head`` then ``parts`` ``gap_s`` apart; return what the server answered and when (s after the head)."""
    sock = socket.create_connection((srv.host, srv.port), timeout=20)
    try:
        t0 = time.monotonic()
        sock.sendall(head)
        for part in parts:
            time.sleep(gap_s)
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed
                break
        data = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            data += chunk
        return data, time.monotonic() - t0
    finally:
        sock.close()


def test_a_body_that_stops_arriving_is_408(server):
    head = (f"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {USER_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    data, elapsed = raw_request(server, head + b'{"prompt":', [], 0)  # 10 of 100 bytes, then silence
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    assert b"server.body_timeout_s" in data and b"connection: close" in data.lower()
    assert 0.9 < elapsed < 10, elapsed  # the deadline is 1 s; the socket closed (recv returned b"")
    # a trickle (a byte every 0.3 s) is held to the same deadline for the whole body
    data, elapsed = raw_request(server, head, [b" "] * 20, 0.3)
    assert data.startswith(b"HTTP/1.1 408 ") and elapsed < 5, (data[:100], elapsed)
    assert call(server, "GET", "/v1/models")[0] == 200  # and the server goes on


# ---- item 9: /tokenize, /detokenize ------------------------------------------------------------------------------


def test_tokenize_over_the_cap_is_refused_before_tokenizing(open_server):
    text = "word " * 400_000  # 2 MB: more than max_model_len 1024 tokens could hold
    t0 = time.monotonic()
    status, r = call(open_server, "POST", "/tokenize", {"prompt": text})
    assert status == 400 and r["error"]["param"] == "prompt" and "max_model_len 1024" in r["error"]["message"], r
    assert time.monotonic() - t0 < 10
    status, r = call(open_server, "POST", "/detokenize", {"tokens": [1] * 1025})
    assert status == 400 and r["error"]["param"] == "tokens" and "max_model_len 1024" in r["error"]["message"]
    assert call(open_server, "POST", "/detokenize", {"tokens": [9707, 1879]}) == (200, {"prompt": "Hello world"})
    status, r = call(open_server, "POST", "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and r["tokens"] == [9707, 1879]


def test_health_answers_while_a_large_text_is_tokenized(server):
    """/health is asked again and again while a 2.7 MB text is tokenized. Tokenizing on the event loop (and
    holding the GIL: this client runs in the server's process) would leave a gap of seconds between two
    answers; off the loop, in a call that releases the GIL, answers keep coming."""
    text = "The quick brown fox jumps over the lazy dog. " * 60_000
    out: dict = {}

    def tokenize() -> None:
        out["r"] = call(server, "POST", "/tokenize", {"prompt": text}, timeout=300)
        out["done"] = time.monotonic()

    worker = threading.Thread(target=tokenize)
    answers = [time.monotonic()]
    worker.start()
    while worker.is_alive():
        assert call(server, "GET", "/health", key=None)[0] == 200
        answers.append(time.monotonic())
        time.sleep(0.02)
    worker.join()
    status, r = out["r"]
    assert status == 200 and r["count"] > 500_000, r if status != 200 else r["count"]
    took = out["done"] - answers[0]
    gaps = [b - a for a, b in zip(answers, [*answers[1:], out["done"]])]
    print(f"/tokenize took {took:.2f} s; /health answered {len(answers) - 1} times meanwhile, "
          f"longest gap {max(gaps):.3f} s")
    assert max(gaps) < took / 3, (max(gaps), took)


# ---- `tito serve` itself: the key from the environment, never in its output ------------------------------------


def test_tito_serve_takes_the_key_from_the_environment_and_never_prints_it(tmp_path):
    import signal
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "NO_COLOR": "1",
           "TITO_API_KEY": USER_KEY}
    cmd = [str(Path(sys.executable).with_name("tito")), "serve", "--port", str(port),
           "--set", f"model={tokenizer_dir(QWEN)}", "--set", "engine_in_process=true", "--set", "ray.num_cpus=1",
           "--set", "server.log_level=debug", "--set", f"server.admin_api_key={ADMIN_KEY}",
           "--set", "engine={backend: replay, options: {synthetic: true, vocab_size: 151665, max_model_len: 1024}}"]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[1], preexec_fn=sigint_default)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while b"ready in" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert http_call(url + "/v1/models")[0] == 401
        status, r = http_call(url + "/v1/models", headers={"Authorization": f"Bearer {USER_KEY}"})
        assert status == 200, r
        assert http_call(url + "/pause", "POST", headers={"Authorization": f"Bearer {USER_KEY}"})[0] == 401
        status, r = http_call(url + "/server_info", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        assert status == 200 and USER_KEY not in json.dumps(r) and ADMIN_KEY not in json.dumps(r)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    out = log.read_text()
    assert "ready in" in out and USER_KEY not in out and ADMIN_KEY not in out, out[-3000:]
