"""Weights over the wire: vLLM's weight-transfer routes on `tito serve` with gloo, two embedded engines (SmolLM2-135M,
real Ray, loopback HTTP), driven by a trainer written here with plain torch.distributed (not tito's helper) and by
tito's own GlooWeightSender.

What a trainer relies on: the tensors it broadcasts are the weights served afterwards (every parameter's checksum,
and the sampled logprobs equal a plain forward pass under them), only after finish, under the version it named;
a refused or broken update (bad metadata, NaN, a trainer that never connects or dies mid-transfer) leaves the
served weights and version as they were and the server serving.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from ._support import EMBEDDED_ENGINE, SMOLLM2, http_call, reference, serving, smollm2_gguf  # noqa: E402
from .test_follow import _forward_logprobs, _perturbed, base_state, model_path  # noqa: E402,F401

EOS = 2
ENGINES = 2
TIMEOUT_S = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = [f"model={smollm2_gguf()}", *EMBEDDED_ENGINE, f"engine.count={ENGINES}", "engine.num_cpus=0.25",
                "engine.weight_transfer=gloo", f"engine.weight_transfer_timeout_s={TIMEOUT_S}"]
    with serving(tmp_path_factory, "tito-test-weight-transfer", settings) as srv:
        yield srv


def call(srv, method, path, body=None, timeout=120):
    return http_call(srv.url + path, method, body, timeout=timeout)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PlainTrainer:
    """A trainer's side written with torch.distributed alone, in the issue's layout: rank 0, hosting
    ``TCPStore(master_address, master_port, world_size, is_master=True)`` (which waits for every engine to connect),
    then ``ProcessGroupGloo(store, 0, world_size, timeout)``."""

    def __init__(self, srv, world_size: int | None = None, rank_offset: int = 1) -> None:
        self.srv = srv
        status, ws = call(srv, "GET", "/get_world_size")
        assert status == 200
        self.world = world_size or 1 + ws["world_size"]
        self.rank_offset = rank_offset
        self.port = free_port()
        self.group = None

    def init(self):
        info = {"master_address": "127.0.0.1", "master_port": self.port, "rank_offset": self.rank_offset,
                "world_size": self.world}
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(call, self.srv, "POST", "/init_weight_transfer_engine", {"init_info": info})
            self.store = dist.TCPStore("127.0.0.1", self.port, self.world, True, timeout=timeout)
            self.group = dist.ProcessGroupGloo(self.store, 0, self.world, timeout)
            return answer.result()

    def update(self, tensors: dict[str, torch.Tensor], info: dict | None = None):
        """One /update_weights with a broadcast of each tensor meanwhile; returns the route's answer."""
        info = info or {"names": list(tensors), "dtype_names": [str(t.dtype).split(".")[-1] for t in tensors.values()],
                        "shapes": [list(t.shape) for t in tensors.values()]}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(call, self.srv, "POST", "/update_weights", {"update_info": info})
            for t in tensors.values():
                self.group.broadcast(t.contiguous(), 0).wait()
            return answer.result()


def checksums(srv) -> dict[str, str]:
    status, body = call(srv, "POST", "/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def prompt() -> list[int]:
    hf = reference(SMOLLM2)
    text = hf.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=False,
                                  add_generation_prompt=True)
    return hf(text, add_special_tokens=False)["input_ids"]


def greedy(srv, max_tokens=12):
    status, out = call(srv, "POST", "/inference/v1/generate", {"token_ids": prompt(), "sampling_params": {
        "max_tokens": max_tokens, "temperature": 0, "stop_token_ids": [EOS], "logprobs": 1}})
    assert status == 200, out
    choice = out["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]], out


def served_version(srv) -> int:
    status, body = call(srv, "GET", "/weight_info")
    assert status == 200
    return int(body["weight_version"])


def test_a_plain_torch_trainer_sends_weights_that_are_then_served(server, base_state):  # noqa: F811
    model, base = base_state
    status, info = call(server, "GET", "/server_info")
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
    before = checksums(server)
    assert len(before) == ENGINES * sum(1 for _ in model.named_parameters())
    assert before["dp0:pp0:pcp0:tp0:model.norm.weight"] == sha(base["model.norm.weight"])

    trainer = PlainTrainer(server)
    assert trainer.init() == (200, {"message": "Weight transfer initialized"})
    v0 = served_version(server)
    new = _perturbed(base, 1.7, kv=True)
    changed = {k: new[k].to(torch.bfloat16) for k in ("model.norm.weight", "model.layers.0.input_layernorm.weight")}
    assert call(server, "POST", "/start_weight_update", {"is_checkpoint_format": True})[0] == 200
    # two update_weights calls in one update, each a part of the model (vLLM allows both)
    first, second = dict(list(changed.items())[:1]), dict(list(changed.items())[1:])
    got = trainer.update(first)
    assert got == (200, {"message": "Weights updated"}), got
    # received, not served: the engines still serve the old weights until finish
    assert checksums(server) == before
    assert trainer.update(second)[0] == 200
    status, done = call(server, "POST", "/finish_weight_update", {"weight_version": str(v0 + 5)})
    assert status == 200, done
    assert served_version(server) == v0 + 5

    after = checksums(server)
    for i in range(ENGINES):  # every engine holds what was sent (bf16 on the wire, fp32 in the model)
        for name, t in changed.items():
            assert after[f"dp{i}:pp0:pcp0:tp0:{name}"] == sha(t.float())
    untouched = [k for k in before if not any(k.endswith(n) for n in changed)]
    assert all(after[k] == before[k] for k in untouched)

    served = {**base, **{k: t.float() for k, t in changed.items()}}
    for _ in range(ENGINES):  # each engine in turn (least loaded routing): logprobs = a forward pass under them
        ids, lps, out = greedy(server)
        ref = _forward_logprobs(model, served, prompt() + ids)[len(prompt()):]
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-4), (lps, ref.tolist())
