"""The tito command line, run as a real subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

from ._support import REPO, interrupt, sigint_default, smollm2_gguf, tokenizer_dir


def tito(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actors.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_render_prints_ids_and_attribution(tmp_path):
    msgs = tmp_path / "m.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]))
    out = tito("render", str(tokenizer_dir("qwen2.5-7b-instruct")), "--messages", str(msgs), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["renderer"] == "qwen2.5"
    assert len(data["token_ids"]) == len(data["message_indices"]) == len(data["sampled_mask"])
    table = tito("render", str(tokenizer_dir("qwen2.5-7b-instruct")), "--messages", str(msgs), "--generation-prompt")
    assert table.returncode == 0
    assert "'Hello'" in table.stdout and "<|im_end|>" in table.stdout


def test_render_the_default_model_alias():
    smollm2_gguf()  # skip (or fail under CI) when the package is absent
    out = tito("render", "smollm2-135m", "--messages", "configs/sample_conversation.json", "--generation-prompt")
    assert out.returncode == 0, out.stderr
    assert "renderer smollm2" in out.stdout


def test_template_explains_the_choice(tmp_path):
    out = tito("template", str(tokenizer_dir("qwen3-0.6b")))
    assert out.returncode == 0
    assert "87a2728cb8dc9fe4" in out.stdout and "verified for qwen3" in out.stdout
    changed = tmp_path / "changed.jinja"  # Qwen3's template with a knowledge-cutoff line: no hand-coded claim
    template = json.loads((tokenizer_dir("qwen3-0.6b") / "tokenizer_config.json").read_text())["chat_template"]
    changed.write_text("Knowledge cutoff: 2024-06\n" + template)
    unknown = tito("template", str(tokenizer_dir("qwen3-0.6b")), "--chat-template", str(changed))
    assert unknown.returncode == 0, unknown.stderr
    assert "renderer   generic" in unknown.stdout and "no hand-coded renderer is verified" in unknown.stdout
    forced = tito("template", str(tokenizer_dir("qwen3-0.6b")), "--chat-template", str(changed), "--renderer", "qwen3")
    assert forced.returncode == 0 and "forced" in forced.stdout


def test_bad_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"role": "wizard", "content": "x"}]')
    out = tito("render", str(tokenizer_dir("qwen3-0.6b")), "--messages", str(bad))
    assert out.returncode == 2 and "unknown role 'wizard'" in out.stderr and "Traceback" not in out.stderr
    bad.write_text("[{")
    out = tito("render", str(tokenizer_dir("qwen3-0.6b")), "--messages", str(bad))
    assert out.returncode == 2 and "not valid JSON" in out.stderr
    bad.write_text("[]")
    out = tito("render", "/no/such/model", "--messages", str(bad))
    assert out.returncode == 2 and "neither a file" in out.stderr


def test_template_file_and_capabilities():
    out = tito("template", str(tokenizer_dir("qwen2.5-7b-instruct")), "--chat-template", "renderers/templates/chatml.jinja")
    assert out.returncode == 0, out.stderr
    assert "verified for chatml" in out.stdout
    assert "thinking switch: no" in out.stdout and "tools: no" in out.stdout
    qwen3 = tito("template", str(tokenizer_dir("qwen3-0.6b")))
    assert "thinking switch: yes" in qwen3.stdout and "kwargs     enable_thinking" in qwen3.stdout
    missing = tito("template", str(tokenizer_dir("qwen3-0.6b")), "--chat-template", "/no/such.jinja")
    assert missing.returncode == 2 and "cannot read chat template file" in missing.stderr


def test_tito_serve_command_starts_serves_and_stops(tmp_path, capsys):
    from actors.cli import main

    # a config error is reported before anything starts; the server below runs its engine in-process
    assert main(["serve", "--set", "sessions.idle_timeout=3"]) == 2
    assert "sessions.idle_timeout: unknown key" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {tokenizer_dir('qwen2.5-7b-instruct')}\nserved_model_name: cli-test\nengine:\n  backend: replay\n"
                      f"  options: {{synthetic: true, vocab_size: 151665, max_model_len: 256}}\nengine_in_process: true\n"
                      f"ray:\n  num_cpus: 1\n")
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "serve", str(config), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "tito serve did not come up"
                time.sleep(0.25)
        with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
            card = json.loads(r.read())["data"][0]
        assert card["id"] == "cli-test" and card["max_model_len"] == 256
        req = urllib.request.Request(url + "/inference/v1/generate", method="POST", data=json.dumps({
            "model": "cli-test", "token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            assert len(json.loads(r.read())["choices"][0]["token_ids"]) == 3
    finally:
        out = interrupt(proc)
    assert proc.returncode == 0 and "tito serve: cli-test on http://127.0.0.1" in out
