"""``tito serve`` with the vLLM backend, side by side with vLLM's OWN server: one model, the same requests.

Both run here as subprocesses on loopback: vLLM's server (``python -m vllm.entrypoints.openai.api_server``,
``--enable-scale-out`` for /inference/v1/generate) and ``tito serve --set engine.backend=vllm``. Every request
goes to both; the test holds tito to vLLM's response keys and types (``shape``), and, since both sample with vLLM
from the same weights, to the same tokens and logprobs (the same seed for sampled requests). Keys tito adds are
allowed; anything else that differs must be in ``DIFFERENCES`` with its reason, the same list docs/serve.md
gives, and each listed difference must still occur (a fixed one is taken off the list).

vLLM's server is started with ``--logprobs-mode processed_logprobs``, the setting tito's backend uses (logprobs
of the distribution sampled from); vLLM's default, raw logprobs, differs from it only when temperature, top-k or
top-p change the distribution.

Runs in .venv-vllm (``make test-vllm``); elsewhere skipped with the reason (tests/_vllm.py). ~2 min: two vLLM
engines load side by side.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests._support import free_ports
from tests._vllm import MAX_MODEL_LEN, model_dir, needs_vllm

pytestmark = needs_vllm
ROOT = Path(__file__).resolve().parents[1]
NAME = "smollm2-135m"
LOGPROB_ATOL = 1e-3

# Every deliberate difference, the same list docs/serve.md gives: (kind, where) -> why. Kinds: "status" (where =
# the request's name), "filled" (vLLM sends null there and tito a value), "shape" (a missing key or another type).
DIFFERENCES: dict[tuple[str, str], str] = {
    ("status", "generate greedy n=2"): (
        "n > 1 at temperature 0: vLLM refuses it (400); tito returns n identical completions, as its engine "
        "protocol promises (a group sampled greedily for evaluation)"),
    ("status", "generate two different salts"): (
        "vLLM ignores sampling_params.cache_salt (no SamplingParams field) and answers 200; tito takes it as the salt "
        "(prime-rl's policy step) and refuses two different salts with a 400 naming both"),
    ("filled", ".metrics"): "tito reports where the time went (engine_s, queue_s, prefill_s, decode_s, engine_call_s)",
    ("filled", ".prompt_token_ids"): "tito always returns the prompt's ids on /inference/v1/generate",
    ("filled", ".usage.prompt_tokens_details"): "tito always reports cached prompt tokens ({cached_tokens})",
}


def _free_port() -> int:
    return free_ports(1)[0]


def _call(base: str, method: str, path: str, body: Any = None, timeout: float = 300) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            return err.code, json.loads(raw)
        except ValueError:
            return err.code, raw.decode(errors="replace")


class Server:
    """A server subprocess in its own process group (so stopping it stops the engine core it spawned, and
    nothing else), with its output in a log file."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.name, self.base, self.log = name, f"http://127.0.0.1:{port}", log
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                if _call(self.base, "GET", "/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = model_dir()
    logs = tmp_path_factory.mktemp("servers")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "2",
           "NO_COLOR": "1"}
    vport, tport = free_ports(2)
    vllm = Server("vLLM's server", [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", NAME,
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
        "--enable-scale-out", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
        "--host", "127.0.0.1", "--port", str(vport)], vport, logs / "vllm.log", env)
    tito = Server("tito serve", [
        str(Path(sys.executable).with_name("tito")), "serve", "configs/serve.yaml", "--port", str(tport),
        "--set", f"served_model_name={NAME}",
        "--set", f"engine={{backend: vllm, count: 1, options: {{max_model_len: {MAX_MODEL_LEN}, enforce_eager: true}}}}",
        # the tests' checkpoints are written under their tmp_path: /update_weights loads only below the root
        "--set", f"server.weights_root={tmp_path_factory.getbasetemp()}",
    ], tport, logs / "tito.log", env)
    try:
        vllm.wait_ready()
        tito.wait_ready()
        yield {"vllm": vllm.base, "tito": tito.base}
    finally:
        tito.stop()
        vllm.stop()


def shape(obj: Any) -> Any:
    """The keys and JSON types of a response: a dict's keys, a list's first element, a scalar's type."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(obj[0])] if obj else []
    if isinstance(obj, bool):
        return "bool"
    if isinstance(obj, (int, float)):
        return "number"  # JSON has one number type: 1 and 1.0 are the same to a client
    return type(obj).__name__


def shape_differences(ref: Any, got: Any, path: str = "") -> list[tuple[str, str]]:
    """Where ``got`` lacks a key of ``ref`` or has another type (keys only ``got`` has are allowed)."""
    if isinstance(ref, dict):
        if not isinstance(got, dict):
            return [(path, f"vLLM object, tito {got!r}")]
        out = []
        for k, v in ref.items():
            if k not in got:
                out.append((f"{path}.{k}", "missing"))
            else:
                out += shape_differences(v, got[k], f"{path}.{k}")
        return out
    if isinstance(ref, list):
        if not isinstance(got, list):
            return [(path, f"vLLM list, tito {got!r}")]
        if ref and got:
            return shape_differences(ref[0], got[0], f"{path}[]")
        return []
    return [(path, f"vLLM {ref}, tito {got}")] if ref != got else []


def _prompt() -> list[int]:
    from tito_renderers import create_renderer, load_tokenizer

    renderer = create_renderer(load_tokenizer(model_dir()))
    messages = [{"role": "user", "content": "What is 17 + 25? Answer with the number."}]
    return list(renderer.render(messages, add_generation_prompt=True).token_ids)


def _requests(prompt: list[int], greedy: list[int]) -> list[tuple[str, str, str, Any]]:
    """The requests sent to both servers; ``greedy``: vLLM's greedy completion of ``prompt`` (its third token
    is a stop id the completion reaches)."""
    gen = "/inference/v1/generate"
    sp = {"max_tokens": 24, "temperature": 0.0}
    return [
        ("generate greedy", "POST", gen, {"token_ids": prompt, "sampling_params": sp}),
        ("generate greedy logprobs", "POST", gen,
         {"token_ids": prompt, "sampling_params": {**sp, "logprobs": 1}}),
        ("generate sampled seed", "POST", gen, {"token_ids": prompt, "sampling_params": {
            "max_tokens": 16, "temperature": 1.0, "seed": 7, "logprobs": 1}}),
        ("generate sampled n=2", "POST", gen, {"token_ids": prompt, "sampling_params": {
            "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 2, "logprobs": 1}}),
        ("generate stop id", "POST", gen, {"token_ids": prompt, "sampling_params": {
            **sp, "stop_token_ids": [greedy[2]], "logprobs": 1}}),
        ("generate ignore_eos", "POST", gen, {"token_ids": prompt, "sampling_params": {
            "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}}),
        ("generate greedy n=2", "POST", gen, {"token_ids": prompt, "sampling_params": {**sp, "n": 2}}),
        ("generate n over vLLM's limit", "POST", gen, {"token_ids": prompt, "sampling_params": {
            "max_tokens": 4, "temperature": 1.0, "n": 100_000}}),
        # prime-rl's rollout request (issue 39): its extra_body merged into sampling_params by verifiers; an
        # unknown key; sampling_params.cache_salt against another top-level salt
        ("generate prime-rl sampling_params", "POST", gen, {"model": NAME, "token_ids": prompt, "sampling_params": {
            "top_k": -1, "min_p": 0.0, "return_token_ids": True, "cache_salt": "3", "temperature": 0.0, "top_p": 1.0,
            "max_tokens": 12, "logprobs": 1, "stop_token_ids": [greedy[2]], "skip_special_tokens": False}}),
        ("generate unknown sampling key", "POST", gen, {"token_ids": prompt, "sampling_params": {
            **sp, "tempurature": 0.5, "logprobs": 1}}),
        ("generate two different salts", "POST", gen, {"token_ids": prompt, "cache_salt": "a", "sampling_params": {
            **sp, "cache_salt": "b"}}),
        ("completions greedy", "POST", "/v1/completions", {
            "model": NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True}),
        ("completions sampled seed", "POST", "/v1/completions", {
            "model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": 3, "logprobs": 1,
            "return_token_ids": True}),
        # vLLM's sampling options (issue 19): min_tokens holding back the stop id of "generate stop id", the k
        # most likely tokens per position, prompt scores
        ("generate min_tokens", "POST", gen, {"token_ids": prompt, "sampling_params": {
            **sp, "stop_token_ids": [greedy[2]], "min_tokens": 4, "logprobs": 1}}),
        ("generate logprobs=5", "POST", gen, {"token_ids": prompt, "sampling_params": {**sp, "logprobs": 5}}),
        ("generate logprobs=0", "POST", gen, {"token_ids": prompt, "sampling_params": {**sp, "logprobs": 0}}),
        ("generate sampled logprobs=4", "POST", gen, {"token_ids": prompt, "sampling_params": {
            "max_tokens": 8, "temperature": 0.8, "top_k": 3, "seed": 9, "logprobs": 4, "ignore_eos": True}}),
        ("generate prompt_logprobs", "POST", gen, {"token_ids": prompt, "sampling_params": {
            "max_tokens": 2, "temperature": 0.0, "prompt_logprobs": 3}}),
        ("completions min_tokens", "POST", "/v1/completions", {
            "model": NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "stop_token_ids": [greedy[2]],
            "min_tokens": 4, "logprobs": 0, "return_token_ids": True}),
        ("completions logprobs=5", "POST", "/v1/completions", {
            "model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 5,
            "return_token_ids": True}),
        ("completions logprobs=3 as ids", "POST", "/v1/completions", {
            "model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 3,
            "return_token_ids": True, "return_tokens_as_token_ids": True}),
        ("completions prompt_logprobs", "POST", "/v1/completions", {
            "model": NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 2,
            "return_token_ids": True}),
        ("models", "GET", "/v1/models", None),
        ("tokenize text", "POST", "/tokenize", {"model": NAME, "prompt": "Hello, world! 17 + 25 = 42"}),
        ("tokenize chat", "POST", "/tokenize", {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                "add_generation_prompt": True}),
        ("detokenize", "POST", "/detokenize", {"model": NAME, "tokens": prompt}),
    ]


def _token_results(route: str, body: Any) -> list[tuple[list[int], list[float] | None]]:
    """(token ids, sampled-token logprobs) per choice of a generate or completions response."""
    out = []
    for c in body.get("choices", []):
        if "generate" in route:
            lps = [e["logprob"] for e in c["logprobs"]["content"]] if c.get("logprobs") else None
            out.append((c["token_ids"], lps))
        else:
            lps = c["logprobs"]["token_logprobs"] if c.get("logprobs") else None
            out.append((c.get("token_ids"), lps))
    return out


@pytest.fixture(scope="module")
def side_by_side(servers) -> list[dict]:
    prompt = _prompt()
    _, first = _call(servers["vllm"], "POST", "/inference/v1/generate",
                     {"token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0.0}})
    rows = []
    for route, method, path, body in _requests(prompt, first["choices"][0]["token_ids"]):
        answers = {name: _call(base, method, path, body) for name, base in servers.items()}
        rows.append({"route": route, "path": path, "vllm": answers["vllm"], "tito": answers["tito"]})
    dump = os.environ.get("TITO_SIDE_BY_SIDE_DUMP")
    if dump:
        Path(dump).write_text(json.dumps(rows, indent=1))
    return rows


def _differences(rows: list[dict]) -> dict[tuple[str, str], str]:
    """(kind, where) -> what, over every request (see DIFFERENCES)."""
    found = {}
    for row in rows:
        (vs, vbody), (ts, tbody) = row["vllm"], row["tito"]
        if vs != ts:
            found[("status", row["route"])] = f"vLLM {vs}, tito {ts}"
            continue
        if vs != 200:
            continue
        for where, what in shape_differences(shape(vbody), shape(tbody)):
            kind = "filled" if what.startswith("vLLM NoneType") else "shape"
            found[(kind, where)] = f"{row['route']}: {what}"
    return found


def test_same_keys_types_and_statuses(side_by_side):
    found = _differences(side_by_side)
    unexplained = {k: v for k, v in found.items() if k not in DIFFERENCES}
    assert not unexplained, "tito serve differs from vLLM's server where no reason is listed:\n" + "\n".join(
        f"  {kind} {where}: {what}" for (kind, where), what in sorted(unexplained.items()))
    gone = set(DIFFERENCES) - set(found)
    assert not gone, f"listed differences that no longer occur (take them off DIFFERENCES and docs/serve.md): {gone}"


def test_same_tokens_and_logprobs(side_by_side):
    compared = 0
    for row in side_by_side:
        (vs, vbody), (ts, tbody) = row["vllm"], row["tito"]
        if row["path"] not in ("/inference/v1/generate", "/v1/completions") or vs != 200 or ts != 200:
            continue
        ref, got = _token_results(row["route"], vbody), _token_results(row["route"], tbody)
        assert [ids for ids, _ in got] == [ids for ids, _ in ref], f"{row['route']}: different tokens"
        for (_, a), (_, b) in zip(ref, got):
            if a is not None:
                assert b is not None and max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_ATOL, row["route"]
        finishes = ([c["finish_reason"] for c in vbody["choices"]], [c["finish_reason"] for c in tbody["choices"]])
        assert finishes[0] == finishes[1], f"{row['route']}: finish reasons {finishes}"
        compared += 1
    assert compared >= 7


def _positions(route: str, choice: dict) -> list[list[tuple[Any, float, Any]]]:
    """Per completion token, the listed alternatives as (token, logprob, rank) in the route's order."""
    lp = choice.get("logprobs")
    if not lp:
        return []
    if "content" in lp:
        return [[(e.get("token_id", e.get("token")), e["logprob"], e.get("rank")) for e in c["top_logprobs"]]
                for c in lp["content"]]
    return [[(k, v, None) for k, v in d.items()] for d in lp["top_logprobs"]]


def _same_alternatives(where: str, ref: list, got: list) -> None:
    assert len(ref) == len(got), f"{where}: {len(ref)} positions in vLLM's, {len(got)} in tito's"
    for i, (a, b) in enumerate(zip(ref, got)):
        assert [t for t, _, _ in a] == [t for t, _, _ in b], f"{where} position {i}: {a} vs {b}"
        assert [r for _, _, r in a] == [r for _, _, r in b], f"{where} position {i}: ranks {a} vs {b}"
        assert max((abs(x - y) for (_, x, _), (_, y, _) in zip(a, b)), default=0.0) <= LOGPROB_ATOL, (where, i)


def _prompt_scores(row: dict, body: dict) -> list:
    scores = body["prompt_logprobs"] if "generate" in row["route"] else body["choices"][0]["prompt_logprobs"]
    return [None if d is None else [(k, v["logprob"], v["rank"], v["decoded_token"]) for k, v in d.items()]
            for d in scores]


def test_same_top_logprobs_ranks_and_prompt_scores(side_by_side):
    """logprobs=k on generate and completions: the same alternatives in the same order (ids, or token texts),
    the same ranks, logprobs within 1e-3, on greedy and on top-k sampling; prompt_logprobs: the same entries,
    ranks and decoded tokens per prompt token; min_tokens: the same tokens (checked with the others above)."""
    compared = 0
    for row in side_by_side:
        (vs, vbody), (ts, tbody) = row["vllm"], row["tito"]
        if vs != 200 or ts != 200:
            continue
        for c_ref, c_got in zip(vbody.get("choices", []), tbody.get("choices", [])):
            ref, got = _positions(row["route"], c_ref), _positions(row["route"], c_got)
            if any(len(p) > 1 for p in ref):
                _same_alternatives(row["route"], ref, got)
                compared += 1
            if "generate" in row["route"] and c_ref.get("logprobs"):
                assert ([e["rank"] for e in c_ref["logprobs"]["content"]]
                        == [e["rank"] for e in c_got["logprobs"]["content"]]), row["route"]
        if "prompt_logprobs" in row["route"]:
            ref, got = _prompt_scores(row, vbody), _prompt_scores(row, tbody)
            assert len(ref) == len(got) and ref[0] is None and got[0] is None, row["route"]
            for i, (a, b) in enumerate(zip(ref[1:], got[1:]), 1):
                assert [(k, r, d) for k, _, r, d in a] == [(k, r, d) for k, _, r, d in b], (row["route"], i, a, b)
                assert max(abs(x[1] - y[1]) for x, y in zip(a, b)) <= LOGPROB_ATOL, (row["route"], i)
            compared += 1
    assert compared >= 6, compared
    by = {row["route"]: row for row in side_by_side}
    stopped = by["generate stop id"]["tito"][1]["choices"][0]["token_ids"]
    for route in ("generate min_tokens", "completions min_tokens"):
        ids = by[route]["tito"][1]["choices"][0]["token_ids"]
        assert len(stopped) == 3 and len(ids) > 4 and stopped[2] not in ids[:4], (route, stopped, ids)


def test_chat_logprobs_side_by_side(servers):
    """Chat with logprobs and top_logprobs=5, greedy: the same tokens, texts, bytes and alternatives (the chat
    answer's other keys are not compared here)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "What is 17 + 25? Answer with the number."}],
            "max_tokens": 8, "temperature": 0.0, "logprobs": True, "top_logprobs": 5}
    (vs, ref), (ts, got) = (_call(servers[name], "POST", "/v1/chat/completions", body) for name in ("vllm", "tito"))
    assert vs == ts == 200, (ref, got)
    a, b = ref["choices"][0]["logprobs"], got["choices"][0]["logprobs"]
    assert not shape_differences(shape(a), shape(b)), shape_differences(shape(a), shape(b))
    assert [(e["token"], e["bytes"]) for e in a["content"]] == [(e["token"], e["bytes"]) for e in b["content"]]
    _same_alternatives("chat", _positions("chat", ref["choices"][0]), _positions("chat", got["choices"][0]))
    assert [[e["bytes"] for e in c["top_logprobs"]] for c in a["content"]] == [
        [e["bytes"] for e in c["top_logprobs"]] for c in b["content"]]


def test_vllm_validation_error_reaches_the_client(side_by_side):
    """A request only vLLM's own checks refuse is a 400 on both, and tito's message carries vLLM's."""
    row = next(r for r in side_by_side if r["route"] == "generate n over vLLM's limit")
    (vs, vbody), (ts, tbody) = row["vllm"], row["tito"]
    assert vs == ts == 400, (vs, ts)
    assert "n must be at most" in vbody["error"]["message"]
    assert "n must be at most" in tbody["error"]["message"], tbody


def test_models_tokenize_detokenize_values(side_by_side):
    by = {row["route"]: row for row in side_by_side}
    for route in ("tokenize text", "tokenize chat"):
        assert by[route]["tito"][1]["tokens"] == by[route]["vllm"][1]["tokens"], route
    assert by["detokenize"]["tito"][1]["prompt"] == by["detokenize"]["vllm"][1]["prompt"]
    ref, got = by["models"]["vllm"][1]["data"][0], by["models"]["tito"][1]["data"][0]
    assert (got["id"], got["max_model_len"]) == (ref["id"], ref["max_model_len"])


def test_abort_requests_side_by_side(servers):
    """A long request aborted through /inference/v1/abort_requests, by the name vLLM's server gives it, ends with
    finish "abort" on both (vLLM answers the abort with an empty 200, tito with the ids it aborted)."""
    results = {}
    for name, base in servers.items():
        rid = f"side-abort-{name}"
        body = {"request_id": rid, "token_ids": _prompt(),
                "sampling_params": {"max_tokens": MAX_MODEL_LEN - 64, "temperature": 0.0, "ignore_eos": True}}
        answer: dict[str, Any] = {}

        def send(base=base, body=body, answer=answer) -> None:
            answer["r"] = _call(base, "POST", "/inference/v1/generate", body)

        t = threading.Thread(target=send)
        t.start()
        time.sleep(2.0)
        # vLLM's server names the request "generate-tokens-<request_id>" and aborts only by that name; tito
        # takes either spelling
        aborted = _call(base, "POST", "/inference/v1/abort_requests", {"request_ids": [f"generate-tokens-{rid}"]})
        t.join(120)
        results[name] = (aborted, answer["r"])
    for name, ((astatus, _), (status, body)) in results.items():
        assert astatus == 200 and status == 200, (name, astatus, status, body)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < MAX_MODEL_LEN - 64, name



def test_update_weights_route_loads_a_training_step(servers, tmp_path):
    """POST /update_weights with a training step's checkpoint (prime-rl's call): later samples carry the new
    version and their logprobs are a forward pass of the NEW weights; the repeated prompt is not served from
    KV cached under the old weights; a bad checkpoint is a 400 and changes nothing."""
    from tests.test_vllm_real import _forward_logprobs, _trained_checkpoint

    base, model = servers["tito"], model_dir()
    ckpt = _trained_checkpoint(model, tmp_path / "step-1")
    prompt = _prompt() * 7  # over two of vLLM's 128-token CPU cache blocks
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 1.0, "seed": 5,
                                                     "ignore_eos": True, "logprobs": 1}}
    _call(base, "POST", "/inference/v1/generate", body)
    status, before = _call(base, "POST", "/inference/v1/generate", body)
    assert status == 200 and before["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    status, answer = _call(base, "POST", "/update_weights", {"weight_dir": str(ckpt), "version": 1})
    assert status == 200 and answer == {"status": "ok", "weight_version": 1}, answer
    status, after = _call(base, "POST", "/inference/v1/generate", body)
    assert status == 200
    choice = after["choices"][0]
    assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": 12}]
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "old-weight KV served after the update"
    ids, lps = choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]
    new = _forward_logprobs(str(ckpt), prompt, ids)
    old = _forward_logprobs(model, prompt, ids)
    assert max(abs(a - b) for a, b in zip(lps, new)) <= LOGPROB_ATOL
    assert max(abs(a - b) for a, b in zip(lps, old)) > 10 * LOGPROB_ATOL
    status, err = _call(base, "POST", "/update_weights", {"weight_dir": str(tmp_path / "missing"), "version": 2})
    assert status == 400 and "not a directory" in err["error"]["message"], err
    status, again = _call(base, "POST", "/inference/v1/generate", body)
    assert status == 200 and again["choices"][0]["weight_versions"][0]["version"] == "1"
    assert before["choices"][0]["weight_versions"][0]["version"] == "0"


def _metrics_text(base: str) -> str:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def test_vllm_metric_families_side_by_side(servers):
    """While one long request runs, prime-rl's reading of /metrics (tests/_support.py ``prime_rl_load``) finds the
    same load on both servers: 1 running, none waiting, KV in use, the same KV budget; and every ``vllm:`` family
    tito writes is one vLLM's server writes, with the same type and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests._support import prime_rl_load

    seen: dict[str, tuple[dict, dict]] = {}
    for name, base in servers.items():
        rid = f"side-metrics-{name}"
        body = {"request_id": rid, "token_ids": _prompt(),
                "sampling_params": {"max_tokens": MAX_MODEL_LEN - 64, "temperature": 0.0, "ignore_eos": True}}
        t = threading.Thread(target=_call, args=(base, "POST", "/inference/v1/generate", body))
        t.start()
        deadline, load = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            text = _metrics_text(base)
            load = prime_rl_load(text)
            if load.get("0", {}).get("running") == 1 and load["0"]["kv_usage"] > 0:
                break
            time.sleep(0.2)
        families = {f.name: (f.type, {k for s in f.samples for k in s.labels}) for f in
                    text_string_to_metric_families(text) if f.name.startswith("vllm:")}
        _call(base, "POST", "/inference/v1/abort_requests", {"request_ids": [f"generate-tokens-{rid}"]})
        t.join(120)
        seen[name] = (load.get("0", {}), families)
    (ref, ref_families), (got, got_families) = seen["vllm"], seen["tito"]
    assert ref["running"] == got["running"] == 1 and ref["waiting"] == got["waiting"] == 0, seen
    assert got["kv_usage"] > 0 and ref["kv_usage"] > 0
    assert got["kv_capacity_tokens"] == ref["kv_capacity_tokens"] and got["kv_capacity_tokens"] > 0
    assert got["preemptions"] == ref["preemptions"] == 0
    assert got["waiting_capacity"] == ref["waiting_capacity"] == 0
    for family, (kind, labels) in got_families.items():
        assert family in ref_families, f"vLLM's server has no {family}"
        ref_kind, ref_labels = ref_families[family]
        assert kind == ref_kind, family
        # vLLM's cache_config_info carries every CacheConfig field; tito's the ones that size the KV
        assert labels <= ref_labels or family == "vllm:cache_config_info", (family, labels, ref_labels)
    assert {"engine", "block_size", "num_gpu_blocks"} <= got_families["vllm:cache_config_info"][1]
