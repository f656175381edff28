"""``tito serve`` whose local Ray dies: killing that Ray's raylet kills the engine actors; /health answers 503
and the server exits with status 3 (EXIT_ENGINES_LOST) within a bounded time, so a supervisor restarts it,
instead of answering 503 "no engine is alive" forever.

The server runs as a subprocess that starts its own local Ray; the raylet killed is the one among that
subprocess's descendants (found through /proc by parent pid, never by name: other Rays run on this
machine). Every process the test started is killed afterwards by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rollout.serve.launch import EXIT_ENGINES_LOST

from ._support import REPO, http_call, tokenizer_dir

ENV = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
VOCAB = 151665


def _descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid`` (pid -> command name), from /proc's parent links."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        parents[int(entry.name)], names[int(entry.name)] = ppid, name
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = names[child]
                frontier.append(child)
    return found


def _name(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1: stat.rindex(")")]


def _kill(pids: dict[int, str]) -> None:
    """SIGKILL each pid that still runs the command it ran when recorded (a reused pid is left alone)."""
    for pid, name in pids.items():
        if _name(pid) == name:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_serve_exits_when_its_ray_dies(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {tokenizer_dir('qwen2.5-7b-instruct')}\n"
        "engine:\n  backend: replay\n  count: 2\n  num_cpus: 0\n"
        f"  options: {{synthetic: true, vocab_size: {VOCAB}, max_model_len: 256}}\n"
        "renderer:\n  num_cpus: 0\nray:\n  num_cpus: 1\n")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "serve", str(config), "--port", str(port)],
                                cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started: dict[int, str] = {}
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(OSError):
                if http_call(url + "/health", timeout=5)[0] == 200:
                    break
            assert time.monotonic() < deadline, "tito serve did not come up"
            time.sleep(0.5)
        gen = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}
        assert http_call(url + "/inference/v1/generate", "POST", gen)[0] == 200
        started = _descendants(proc.pid)
        raylets = [pid for pid, name in started.items() if name == "raylet"]
        assert len(raylets) == 1, started  # the server's own Ray: exactly one raylet below it

        os.kill(raylets[0], signal.SIGKILL)
        t_kill = time.monotonic()
        health = []
        while proc.poll() is None and time.monotonic() - t_kill < 120:
            with contextlib.suppress(OSError):
                health.append(http_call(url + "/health", timeout=15)[0])
            time.sleep(1)
        exited_s = time.monotonic() - t_kill
        assert proc.poll() == EXIT_ENGINES_LOST, (proc.poll(), health, log.read_text()[-3000:])
        print(f"raylet killed -> tito serve exited {EXIT_ENGINES_LOST} after {exited_s:.1f} s; /health said {health}")
        assert set(health) <= {200, 503}, health  # never a hang: each probe answered until the exit
        with contextlib.suppress(OSError):
            raise AssertionError(f"the port still answers after the exit: {http_call(url + '/health', timeout=5)}")
        assert "engines died" in log.read_text()
    finally:
        if proc.poll() is None:
            started.update(_descendants(proc.pid))
            proc.kill()
            proc.wait(timeout=30)
        # what the server's Ray left behind (workers orphaned by the raylet): only pids this test saw start
        _kill(started)


def test_serve_restarts_a_killed_engine_on_the_weights_it_serves(tmp_path):
    """One of two engine actors SIGKILLed after POST /update_weights: the requests go on (on the other engine, then
    on both), the lost one is named, restarted by Ray, loaded with the served checkpoint (version 1) before it takes
    a request, and rejoins; /health and /metrics count the loss and the restart."""
    import torch

    from rollout.follow.publish import publish_weights

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    weights = tmp_path / "weights"
    step = publish_weights(weights, 1, {"w": torch.ones(4)}, config={"model_type": "none"})
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {tokenizer_dir('qwen2.5-7b-instruct')}\n"
        "engine:\n  backend: replay\n  count: 2\n  num_cpus: 0\n  heartbeat_interval_s: 0.5\n"
        f"  options: {{synthetic: true, vocab_size: {VOCAB}, max_model_len: 256}}\n"
        f"renderer:\n  num_cpus: 0\nray:\n  num_cpus: 1\nserver:\n  weights_root: {weights}\n")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "serve", str(config), "--port", str(port)],
                                cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started: dict[int, str] = {}
    url = f"http://127.0.0.1:{port}"
    gen = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(OSError):
                if http_call(url + "/health", timeout=5)[0] == 200:
                    break
            assert time.monotonic() < deadline, "tito serve did not come up"
            time.sleep(0.5)
        status, body = http_call(url + "/update_weights", "POST", {"weight_dir": str(step)})
        assert status == 200, body
        started = _descendants(proc.pid)
        reports = http_call(url + "/health")[1]["engines"]
        victim = reports[0]["pid"]
        assert started.get(victim) is not None, (victim, started)  # the server's own engine actor
        os.kill(victim, signal.SIGKILL)
        codes = [http_call(url + "/inference/v1/generate", "POST", gen)[0] for _ in range(10)]
        assert codes == [200] * 10, codes
        deadline = time.monotonic() + 90
        while True:
            status, health = http_call(url + "/health", timeout=15)
            if health.get("engines_restarted") == 1 and status == 200 and health["status"] == "ok":
                break
            assert time.monotonic() < deadline, (health, log.read_text()[-3000:])
            time.sleep(0.5)
        engines = health["engines"]
        assert [e["weight_version"] for e in engines] == [1, 1] and engines[0]["pid"] != victim, engines
        assert health["engines_lost"] == 1 and not engines[0]["fenced"]
        metrics = http_call(url + "/metrics")[1]
        for line in ("tito_engines_lost_total 1", "tito_engines_restarted_total 1", "tito_engines_serving 2"):
            assert line in metrics.splitlines(), metrics
        codes = [http_call(url + "/inference/v1/generate", "POST", gen)[0] for _ in range(6)]
        assert codes == [200] * 6
        text = log.read_text()
        assert "tito serve: engine 0 lost: " in text and "1 of 2 engines serving; restarting it" in text, text[-3000:]
        assert "tito serve: engine 0 restarted and rejoined with version 1 in " in text, text[-3000:]
    finally:
        if proc.poll() is None:
            started.update(_descendants(proc.pid))
            proc.kill()
            proc.wait(timeout=30)
        _kill(started)
