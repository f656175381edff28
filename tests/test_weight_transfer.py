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
import json
import os
import socket
import subprocess
import sys
import time
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
        assert {s["version"] for s in out["choices"][0]["weight_versions"]} == {str(v0 + 5)}
        ref = _forward_logprobs(model, served, prompt() + ids)[len(prompt()):]
        assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-4), (lps, ref.tolist())


def refused(answer, status, *needles):
    code, body = answer
    assert code == status, answer
    message = body["error"]["message"]
    assert all(n in message for n in needles), message
    return message


def test_bad_input_is_refused_naming_it_and_the_served_weights_stay(server, base_state):  # noqa: F811
    model, base = base_state
    before, v0 = checksums(server), served_version(server)
    status, ws = call(server, "GET", "/get_world_size")
    # a world_size that does not match the fleet, an NCCL-only field: refused before any engine waits
    wrong = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 7}
    refused(call(server, "POST", "/init_weight_transfer_engine", {"init_info": wrong}), 400, "world_size is 7",
            f"{ws['world_size']} inference worker")
    nccl = {**wrong, "world_size": 1 + ws["world_size"], "nccl_unique_id_b64": "AAAA"}
    refused(call(server, "POST", "/init_weight_transfer_engine", {"init_info": nccl}), 400, "nccl_unique_id_b64")

    trainer = PlainTrainer(server)
    assert trainer.init()[0] == 200
    refused(call(server, "POST", "/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}}),
            400, "before start_weight_update")
    refused(call(server, "POST", "/finish_weight_update", {}), 400, "without a matching start_weight_update")
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    refused(call(server, "POST", "/start_weight_update", {}), 409, "already active")  # SkyRL #1605
    # lists of different lengths, a dtype vLLM does not know, a per-rank list of the wrong length: nothing to
    # receive can be worked out, so the call is refused at once (and, as in vLLM, ends the update)
    for info, needle in [({"names": ["a", "b"], "dtype_names": ["float32"], "shapes": [[1], [1]]}, "same length"),
                         ({"names": ["model.norm.weight"], "dtype_names": ["float17"], "shapes": [[576]]}, "float17"),
                         ([{"names": [], "dtype_names": [], "shapes": []}], "list of 1 entries")]:
        refused(call(server, "POST", "/update_weights", {"update_info": info}), 400, needle)
        assert call(server, "POST", "/start_weight_update", {})[0] == 200
    # a name the model lacks, a shape of another model: received (the trainer's broadcast completes, the group
    # stays in step) then refused, naming the tensor
    norm = base["model.norm.weight"]
    refused(trainer.update({"model.layers.99.mlp.up_proj.weight": torch.ones(3, 4)}), 400,
            "model.layers.99.mlp.up_proj.weight is not a tensor of the served model")
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    refused(trainer.update({"model.norm.weight": torch.ones(norm.numel() + 1)}), 400, "model.norm.weight has shape")
    # NaN: received, refused by finish naming the tensor; weights and version as before
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    bad = norm.clone()
    bad[3] = float("nan")
    assert trainer.update({"model.norm.weight": bad})[0] == 200
    refused(call(server, "POST", "/finish_weight_update", {}), 400, "model.norm.weight holds 1 NaN")
    assert checksums(server) == before and served_version(server) == v0
    # a version that does not increase: 409, the update dropped
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    assert trainer.update({"model.norm.weight": norm * 2})[0] == 200
    refused(call(server, "POST", "/finish_weight_update", {"weight_version": str(v0)}), 409, "not above")
    refused(call(server, "POST", "/finish_weight_update", {"weight_version": "step-3"}), 400, "integer")
    assert checksums(server) == before and served_version(server) == v0
    # the group is still in step after all that: a good update goes through
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    assert trainer.update({"model.norm.weight": norm})[0] == 200
    assert call(server, "POST", "/finish_weight_update", {})[0] == 200
    after = checksums(server)
    assert served_version(server) == v0 + 1
    assert all(after[f"dp{i}:pp0:pcp0:tp0:model.norm.weight"] == sha(norm) for i in range(ENGINES))
    assert all(after[k] == before[k] for k in before if not k.endswith(":model.norm.weight"))
    greedy(server)


def test_a_trainer_that_never_connects_costs_one_bounded_call(server):
    v0, before = served_version(server), checksums(server)
    nobody = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
              "world_size": 1 + ENGINES}
    t0 = time.monotonic()
    refused(call(server, "POST", "/init_weight_transfer_engine", {"init_info": nobody}), 504, "could not join",
            str(nobody["master_port"]))
    assert time.monotonic() - t0 < TIMEOUT_S + 20
    refused(call(server, "POST", "/start_weight_update", {}), 400, "before init_weight_transfer_engine")
    assert served_version(server) == v0 and checksums(server) == before
    greedy(server)  # serving all along


DYING_TRAINER = r"""
import datetime, sys, os, torch, torch.distributed as dist
port, world = int(sys.argv[1]), int(sys.argv[2])
t = datetime.timedelta(seconds=30)
store = dist.TCPStore("127.0.0.1", port, world, True, timeout=t)
group = dist.ProcessGroupGloo(store, 0, world, t)
print("joined", flush=True)
sys.stdin.readline()
group.broadcast(torch.full((576,), 3.0), 0).wait()  # the first of three announced tensors, then it dies
os._exit(1)
"""


def test_a_trainer_that_dies_mid_transfer_leaves_the_served_weights(server, base_state):  # noqa: F811
    v0, before = served_version(server), checksums(server)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", DYING_TRAINER, str(port), str(1 + ENGINES)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 1 + ENGINES}
        assert call(server, "POST", "/init_weight_transfer_engine", {"init_info": info})[0] == 200
        assert proc.stdout.readline().strip() == "joined"
        assert call(server, "POST", "/start_weight_update", {})[0] == 200
        announced = {"names": ["model.norm.weight", "model.layers.0.input_layernorm.weight",
                               "model.layers.1.input_layernorm.weight"],
                     "dtype_names": ["float32"] * 3, "shapes": [[576]] * 3}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(call, server, "POST", "/update_weights", {"update_info": announced})
            t0 = time.monotonic()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            status, body = answer.result()
        assert status in (502, 504), body
        assert "update is dropped" in body["error"]["message"]
        assert time.monotonic() - t0 < 2 * TIMEOUT_S + 20
    finally:
        proc.kill()
        proc.wait()
    assert served_version(server) == v0 and checksums(server) == before  # the first tensor never became served
    greedy(server)
    refused(call(server, "POST", "/finish_weight_update", {}), 400, "without a matching start")


def test_the_version_routes_as_vllm_has_them(server):
    v0 = served_version(server)
    assert call(server, "POST", "/update_weight_version", {"new_version": str(v0 + 3)}) == \
        (200, {"success": True, "new_version": str(v0 + 3)})
    assert call(server, "GET", "/weight_info") == (200, {"weight_version": str(v0 + 3)})
    _, _, out = greedy(server)
    assert {s["version"] for s in out["choices"][0]["weight_versions"]} == {str(v0 + 3)}
    refused(call(server, "POST", "/update_weight_version", {"new_version": str(v0)}), 409, "below")
    refused(call(server, "POST", "/update_weight_version", {"new_version": "latest"}), 400, "integer")
    refused(call(server, "POST", "/weight_checker", {"action": "compare"}), 400, "baseline")


def test_tito_helper_sends_a_whole_model_and_reset_proves_it_covered_every_tensor(server, base_state):  # noqa: F811
    from rollout.engines.gloo_sender import GlooWeightSender, WeightSendError

    model, base = base_state
    before = checksums(server)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(WeightSendError, match=f"{taken.getsockname()[1]}.*in use"):
            GlooWeightSender(server.url, master_port=taken.getsockname()[1], timeout_s=TIMEOUT_S).init()
    finally:
        taken.close()
    sender = GlooWeightSender(server.url, timeout_s=TIMEOUT_S)
    sender.init()
    status, answer = call(server, "POST", "/weight_checker", {"action": "reset"})
    assert (status, answer) == (200, {"status": "reset"})
    zeroed = checksums(server)
    assert all(zeroed[k] != before[k] for k in before if "norm" in k)
    v = served_version(server)
    new = _perturbed(base, 0.8)
    params = [(name, new[name]) for name, _ in model.named_parameters()]
    sent = sender.send(params, version=v + 2)
    assert sent["tensors"] == len(params) and sent["bytes"] == sum(t.numel() * 4 for _, t in params)
    assert served_version(server) == v + 2
    after = checksums(server)
    assert after == {k: sha(new[k.split(":", 4)[4]]) for k in before}  # every parameter: the reset left none
    ids, lps, _ = greedy(server)
    ref = _forward_logprobs(model, new, prompt() + ids)[len(prompt()):]
    assert torch.allclose(torch.tensor(lps, dtype=torch.float64), ref, atol=2e-4)
    sender.send([(name, base[name]) for name, _ in model.named_parameters()])  # back to the base weights
    assert checksums(server) == {k: sha(base[k.split(":", 4)[4]]) for k in before}
    assert served_version(server) == v + 3
    sender.close()
    refused(call(server, "POST", "/start_weight_update", {}), 400, "before init_weight_transfer_engine")


TRL_SCRIPT = """
import json, sys
from trl.generation.vllm_client import VLLMClient

client = VLLMClient(base_url=sys.argv[1])
out = {"weight_transfer_config": client.get_server_info()["weight_transfer_config"],
       "world_size": client.get_world_size()}
try:
    client.init_communicator("cpu")  # TRL's check before its NCCL rendezvous
except Exception as exc:
    out["init_communicator"] = f"{type(exc).__name__}: {exc}"
if sys.argv[2] == "update":
    with client.weight_update():  # POST /start_weight_update {}, then /finish_weight_update {}
        pass
    out["updated"] = True
print(json.dumps(out))
"""


def test_trl_vllm_client_weight_sync_calls_up_to_its_nccl_rendezvous(server, tmp_path_factory):
    """TRL 1.16's VLLMClient, unchanged, in its cached venv: it finds a weight-transfer engine (gloo) and the world
    size, stops where it would open its NCCL group (it needs CUDA), and its weight_update() bracket (start and finish,
    as TRL sends them) publishes a version on a group a plain torch trainer opened."""
    from ._support import client_venv, run_in_venv
    from .test_clients_rl import TRL_REQUIREMENTS, _vllm_site

    site = _vllm_site()
    if site is None:
        pytest.skip("TRL's VLLMClient needs vLLM importable: build .venv-vllm (make .venv-vllm/.tito-installed)")
    root = client_venv("trl", TRL_REQUIREMENTS, inherit=[site])
    out = run_in_venv(root, TRL_SCRIPT, server.url, "probe", cwd=tmp_path_factory.mktemp("trl"), timeout=300)
    assert out["weight_transfer_config"] == {"backend": "gloo"} and out["world_size"] == ENGINES
    assert "needs a CUDA device" in out["init_communicator"], out
    trainer = PlainTrainer(server)
    assert trainer.init()[0] == 200
    v0 = served_version(server)
    out = run_in_venv(root, TRL_SCRIPT, server.url, "update", cwd=tmp_path_factory.mktemp("trl"), timeout=300)
    assert out["updated"] and served_version(server) == v0 + 1


SKYRL_VERSION = "0.3.0"
SKYRL_SCRIPT = """
import asyncio, json, pathlib, sys, types

# SkyRL's broadcast module imports torch and ray at the top; this Python 3.12 venv has neither (no torch wheel for it
# here), so they are empty stand-ins: only its BroadcastInitInfo (a dataclass) and the HTTP client run, unchanged
class Stub(types.ModuleType):
    def __getattr__(self, name):
        return type(name, (), {})
for name in ("ray", "torch", "torch.distributed"):
    sys.modules[name] = Stub(name)
import skyrl.backends.skyrl_train as st
package = types.ModuleType("skyrl.backends.skyrl_train.weight_sync")  # its __init__ imports the CUDA IPC strategy
package.__path__ = [str(pathlib.Path(st.__file__).parent / "weight_sync")]
sys.modules[package.__name__] = package
from skyrl.backends.skyrl_train.weight_sync.broadcast_strategy import BroadcastInitInfo
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

async def main(url, port, update_info):
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1)
    out = {"world_size": list(await client.get_world_size())}
    total = out["world_size"][0]
    # as BroadcastTransferStrategy.create_init_info builds it: trainer rank 0, the engines after it
    info = BroadcastInitInfo(override_existing_receiver=True, master_addr="127.0.0.1", master_port=port,
                             rank_offset=1, world_size=total + 1)
    await client.init_weight_update_communicator(info)
    await client.pause(mode="keep")
    await client.start_weight_update(is_checkpoint_format=True)
    print("broadcast now", flush=True)
    await client.update_weights_nccl(update_info)
    await client.finish_weight_update()
    await client.resume()
    try:
        await client.start_weight_update(is_checkpoint_format=False)
    except Exception as exc:
        out["kernel_format"] = str(exc)
    await client.teardown()
    print(json.dumps(out), flush=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])))
"""


def _python312() -> str | None:
    """A Python 3.12 that runs (a pyenv shim on PATH may name one that is not installed)."""
    import glob
    import shutil

    for found in [*sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))),
                  shutil.which("python3.12")]:
        if found and subprocess.run([found, "-c", "pass"], capture_output=True).returncode == 0:
            return found
    return None


def test_skyrl_remote_inference_client_weight_sync_over_gloo(server, base_state, tmp_path):  # noqa: F811
    """SkyRL 0.3's RemoteInferenceClient, unchanged (PyPI, Python 3.12): its world size, its init_info payload
    (BroadcastInitInfo), pause keep, then its start / update_weights_nccl / finish, which it sends through vLLM's
    /collective_rpc, while this process broadcasts as the trainer's rank 0; then resume. The tensors broadcast are
    served under the next version."""
    from ._support import cached_venv

    python = _python312()
    if python is None:
        pytest.skip("SkyRL 0.3 needs Python 3.12 (its typing.TypedDict under pydantic); none is installed here")

    def add_skyrl(root):
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "-q",
                               "--no-deps", f"skyrl=={SKYRL_VERSION}"], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]

    root = cached_venv(f"client-skyrl-{SKYRL_VERSION}-py312", ["aiohttp", "pydantic"], prepare=add_skyrl,
                       python=python)
    model, base = base_state
    v0 = served_version(server)
    sent = {"model.norm.weight": base["model.norm.weight"] * 0.9}
    info = {"names": list(sent), "dtype_names": ["float32"], "shapes": [list(sent["model.norm.weight"].shape)]}
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1 + ENGINES, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S * 4))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    proc = subprocess.Popen([str(root / "bin" / "python"), "-I", "-c", SKYRL_SCRIPT, server.url, str(port),
                             json.dumps(info)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path)
    try:
        try:
            group = dist.ProcessGroupGloo(store, 0, 1 + ENGINES, datetime.timedelta(seconds=TIMEOUT_S * 4))
        except Exception:
            proc.kill()
            raise AssertionError(f"the engines never joined; SkyRL's side: {proc.communicate()[1][-3000:]}") from None
        line = proc.stdout.readline()
        assert line.strip() == "broadcast now", (line, proc.stderr.read() if proc.poll() is not None else "")
        for t in sent.values():
            group.broadcast(t.contiguous(), 0).wait()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["world_size"] == [ENGINES, ENGINES]
    assert "400" in result["kernel_format"] or "kernel-format" in result["kernel_format"], result
    assert served_version(server) == v0 + 1
    after = checksums(server)
    assert all(after[f"dp{i}:pp0:pcp0:tp0:model.norm.weight"] == sha(sent["model.norm.weight"])
               for i in range(ENGINES))
    refused(call(server, "POST", "/collective_rpc", {"method": "reload_weights"}), 400, "reload_weights",
            "skyrl_start_weight_update")
