"""``follow.weights: wire`` (rollout/follow/wire.py) on real parts: the SmolLM2 embedded engine receiving over a
real gloo group, the real renderer service writing Arrow shards, HTTP on loopback. The trainer is tito's
GlooWeightSender in a thread of this process (the routes' bytes are vLLM's: tests/test_weight_transfer.py sends
them with plain torch.distributed, TRL's and SkyRL's clients); the service is the one ``tito run --follow`` runs.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from rollout.config import RunConfig
from rollout.data import layout, load_samples
from rollout.engines.protocol import close_backend

from .test_follow import (  # noqa: F401
    Harness,
    _config,
    _forward_logprobs,
    _perturbed,
    _tasks,
    _turns_under_way,
    base_state,  # fixtures
    model_path,
)

TIMEOUT_S = 30.0


def _wire_config(tokens: int = 24, **follow) -> RunConfig:
    cfg = _config(tokens, listen="127.0.0.1:0", **follow).model_dump()
    cfg["engine"].update(weight_transfer="gloo", weight_transfer_timeout_s=TIMEOUT_S)
    cfg["follow"]["weights"] = "wire"
    return RunConfig.model_validate(cfg)


def _engine(path: str):
    from rollout.engines.embedded import EmbeddedEngine

    return EmbeddedEngine(path, threads=1, max_batch=8, fetch=False, weight_transfer="gloo",
                          weight_transfer_timeout_s=TIMEOUT_S)


def _call(url: str, method: str, route: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data, method=method, headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_weights_pushed_mid_turn_are_served_as_that_version_and_stamp_each_token(tmp_path, model_path, base_state):  # noqa: F811
    """The trainer sends version 1 over gloo while batch 1's turns run: they stop, keep their tokens (version 0)
    and go on under v1; batch 2 (on-policy: it needs v1) is admitted only after the finish. Every sampled token's
    logprob equals a plain forward pass under the weights of the version it is stamped with."""
    from rollout.engines.gloo_sender import GlooWeightSender

    model, base = base_state
    v1 = _perturbed(base, 1.3)
    run_dir = tmp_path / "run"
    cfg = _wire_config(64, max_steps=2, max_off_policy_steps=0)
    sent: dict = {}

    def push(url: str) -> None:
        sender = GlooWeightSender(url, timeout_s=TIMEOUT_S)
        sender.init()
        # the tensor that changed (a partial update, as vLLM allows): small, so it lands while the turns run
        sent.update(sender.send([("model.norm.weight", v1["model.norm.weight"])], version=1))
        status, info = _call(url, "GET", "/weight_info")
        sent["info"] = (status, info)
        sender.close()

    async def trainer(h: Harness) -> None:
        await _turns_under_way(h, 0.5)
        assert h.engine.info().weight_version == 0
        await asyncio.to_thread(push, h.follow.weights.listen_url)

    async def main() -> tuple[Harness, int]:
        h = Harness(cfg, run_dir, model_path, _tasks(2), engine=_engine(model_path))
        try:
            sealed, _ = await asyncio.gather(h.follow.run(), trainer(h))
        finally:
            await close_backend(h.engine)
        return h, sealed

    h, sealed = asyncio.run(main())
    h.service.close()
    assert sealed == 2, h.lines
    assert sent["tensors"] == 1 and sent["finish"]["weight_version"] == "1"
    assert sent["info"] == (200, {"weight_version": "1"})
    rows = {k: load_samples(layout.step_dir(run_dir, k)) for k in (1, 2)}
    assert h.driver.resumed_turns >= 1, h.lines  # abort_resume: turns stopped by the swap went on under v1
    assert all(int(v) == 1 for s in rows[2] for v in s.weight_versions if v >= 0)  # admitted after v1 only
    assert any(int(v) == 0 for s in rows[1] for v in s.weight_versions if v >= 0)
    states = {0: base, 1: v1}
    worst = other = 0.0
    for s in rows[1] + rows[2]:
        ids = [int(t) for t in s.token_ids]
        by_version = {v: _forward_logprobs(model, states[v], ids) for v in (0, 1)}
        for t, v in enumerate(int(v) for v in s.weight_versions):
            if v >= 0:
                worst = max(worst, abs(float(s.logprobs[t]) - float(by_version[v][t])))
                other = max(other, abs(float(s.logprobs[t]) - float(by_version[1 - v][t])))
    model.load_state_dict(base)
    assert worst <= 2e-3 and other > 1e-2, (worst, other)
    metrics = [json.loads(line) for line in (run_dir / layout.METRICS).read_text().splitlines()]
    updates = list({u["version"]: u for m in metrics for u in m["weight_updates"]}.values())
    assert [u["version"] for u in updates] == [1] and updates[0]["source"] == "wire"
    assert updates[0]["aborted_requests"] >= 1
    assert not (run_dir / layout.BROADCASTS).exists()  # no file was written for the weights
    assert any("swapped in" in line for line in h.lines), h.lines


def test_a_bad_update_is_refused_and_the_run_goes_on_under_the_weights_it_had(tmp_path, model_path, base_state,  # noqa: F811
                                                                              monkeypatch):
    """A NaN, a name the model lacks, a checkpoint sent to the wire listener, a route it does not serve and a
    missing admin key: each answered with what is wrong; the engines keep version 0 and the batches seal."""
    from rollout.engines.gloo_sender import GlooWeightSender, WeightSendError

    monkeypatch.setenv("TITO_ADMIN_API_KEY", "wire-admin")
    _, base = base_state
    run_dir = tmp_path / "run"
    cfg = _wire_config(max_steps=2, max_off_policy_steps=1)
    seen: dict = {}

    def push(url: str) -> None:
        seen["no_key"] = _call(url, "POST", "/start_weight_update", {})
        seen["health"] = _call(url, "GET", "/health")
        seen["other_route"] = _call(url, "POST", "/v1/completions", {"prompt": [1, 2]}, key="wire-admin")
        seen["checkpoint"] = _call(url, "POST", "/update_weights", {"weight_dir": str(tmp_path)}, key="wire-admin")
        sender = GlooWeightSender(url, timeout_s=TIMEOUT_S, api_key="wire-admin")
        sender.init()
        bad = dict(base)
        bad["model.norm.weight"] = torch.full_like(base["model.norm.weight"], float("nan"))
        for name, items in (("nan", [("model.norm.weight", bad["model.norm.weight"])]),
                            ("unknown", [("model.layers.99.mlp.up_proj.weight", torch.zeros(4, 4))])):
            try:
                sender.send(items, version=1)
            except WeightSendError as exc:
                seen[name] = str(exc)
                if sender.group is None:
                    sender.init()  # a refused update_weights leaves the group out of step: join again
        seen["after"] = _call(url, "GET", "/weight_info", key="wire-admin")
        sender.close()

    async def main() -> tuple[Harness, int]:
        h = Harness(cfg, run_dir, model_path, _tasks(2), engine=_engine(model_path))
        try:
            sealed, _ = await asyncio.gather(h.follow.run(), asyncio.to_thread(push, h.follow.weights.listen_url))
        finally:
            await close_backend(h.engine)
        return h, sealed

    h, sealed = asyncio.run(main())
    h.service.close()
    assert sealed == 2, h.lines  # max_off_policy_steps 1: batch 2 needs only v0
    assert seen["no_key"][0] == 401 and seen["health"][0] == 200
    assert seen["other_route"][0] == 404
    assert seen["checkpoint"][0] == 400 and "follow.weights: files" in seen["checkpoint"][1]["error"]["message"]
    assert "HTTP 400" in seen["nan"] and "model.norm.weight" in seen["nan"] and "NaN" in seen["nan"], seen["nan"]
    assert "HTTP 400" in seen["unknown"] and "model.layers.99.mlp.up_proj.weight" in seen["unknown"], seen["unknown"]
    assert seen["after"] == (200, {"weight_version": "0"})
    assert all(int(v) == 0 for k in (1, 2) for s in load_samples(layout.step_dir(run_dir, k))
               for v in s.weight_versions if v >= 0)
    assert any("refused" in line and "v1" in line for line in h.lines), h.lines


def test_wire_settings_are_checked_before_anything_starts(tmp_path):
    from rollout.follow.wire import bind_listener

    with pytest.raises(ValueError, match="engine.weight_transfer: gloo"):
        RunConfig(follow={"weights": "wire"})
    with pytest.raises(ValueError, match="HOST:PORT"):
        RunConfig(follow={"listen": "8011"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"follow.listen 127.0.0.1:{port}: cannot listen there"):
            bind_listener(f"127.0.0.1:{port}")


def test_tito_run_follow_names_a_port_in_use_before_loading_anything(tmp_path):
    """The CLI, as a user runs it: one line, exit 2 or 1, no run directory content, in seconds."""
    import subprocess
    import sys
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "actors.cli", "run", "configs/rl_loop.yaml", "--follow", str(tmp_path / "run"),
                               "--set", "engine.weight_transfer=gloo", "--set", "follow.weights=wire",
                               "--set", f"follow.listen=127.0.0.1:{port}", "--set", "follow.max_steps=1"],
                              capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent.parent)
        elapsed = time.monotonic() - t0
    assert done.returncode != 0
    assert f"follow.listen 127.0.0.1:{port}: cannot listen there" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert elapsed < 60, elapsed
