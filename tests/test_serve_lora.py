"""LoRA adapters through ``tito serve``: two real embedded engines (SmolLM2-135M) as Ray actors, over loopback HTTP,
driven with the bodies vLLM's server and prime-rl send (vLLM's ``/v1/load_lora_adapter {lora_name, lora_path,
load_inplace}``, ``/v1/unload_lora_adapter {lora_name}``; prime-rl's ``/load_lora_adapter {lora_name, lora_path}``,
``src/prime_rl/utils/client.py`` at 559b447, which reloads one name from each ``broadcasts/step_N``). Adapters are
written by peft; the logprobs of every token an adapter sampled are checked against peft's forward pass."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from ._support import SMOLLM2, http_call, logprobs_of, reference, serving, write_adapter  # noqa: E402

peft = pytest.importorskip("peft")
NAME = "smollm2-lora"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def sessions_out(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def server(tmp_path_factory, root, sessions_out):
    from rollout.models import model_dir

    with serving(tmp_path_factory, "tito-test-serve-lora",
                 [f"model={model_dir('smollm2-135m')}", f"server.weights_root={root}", f"served_model_name={NAME}",
                  f"output.dir={sessions_out}",
                  "engine.backend=embedded", "engine.count=2", "engine.num_cpus=0.5",
                  "engine.options={threads: 1, max_batch: 4, max_model_len: 1024, max_lora_rank: 16}"]) as srv:
        yield srv


@pytest.fixture(scope="module")
def adapters(root):
    """peft models (the reference) of two adapters, saved under the weights root as prime-rl's steps."""
    from rollout.models import load_causal_lm, model_dir

    base = lambda: load_causal_lm(str(model_dir("smollm2-135m")))  # noqa: E731
    refs = {"step_1": write_adapter(base(), root / "broadcasts" / "step_1", seed=1),
            "step_2": write_adapter(base(), root / "broadcasts" / "step_2", seed=2),
            "other": write_adapter(base(), root / "other", seed=3, targets=("k_proj", "up_proj"))}
    return refs, base()


def call(srv, path, body=None, method="POST"):
    return http_call(srv.url + path, method, body, None, None, 300)


def prompt() -> list[int]:
    hf = reference(SMOLLM2)
    return hf(hf.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False,
                                     add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def sampled(srv, model: str, seed: int = 0, max_tokens: int = 8):
    status, r = call(srv, "/inference/v1/generate", {"model": model, "token_ids": prompt(), "sampling_params": {
        "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "logprobs": 1, "ignore_eos": True}})
    assert status == 200, r
    choice = r["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]], choice["weight_versions"]


def test_prime_rl_loads_each_step_under_one_name_and_samples_from_it(server, adapters, root):
    refs, base = adapters
    p = prompt()
    status, r = call(server, "/load_lora_adapter", {"lora_name": "policy", "lora_path": str(root / "broadcasts/step_1")})
    assert (status, r) == (200, {"status": "ok"})
    for seed in range(4):  # two engines: requests land on both
        ids, lps, versions = sampled(server, "policy", seed)
        assert max(abs(a - b) for a, b in zip(lps, logprobs_of(refs["step_1"], p, ids))) <= 1e-4
        assert [v["version"] for v in versions] == ["1"]  # step_1 is policy version 1
    # the next step, same name: swapped in place (prime-rl never unloads), version 2
    status, r = call(server, "/load_lora_adapter", {"lora_name": "policy", "lora_path": str(root / "broadcasts/step_2")})
    assert status == 200, r
    ids, lps, versions = sampled(server, "policy", 9)
    assert max(abs(a - b) for a, b in zip(lps, logprobs_of(refs["step_2"], p, ids))) <= 1e-4
    assert [v["version"] for v in versions] == ["2"]
    # the base model is still served beside it
    ids, lps, _ = sampled(server, NAME, 3)
    assert max(abs(a - b) for a, b in zip(lps, logprobs_of(base, p, ids))) <= 1e-4


def test_vllm_routes_models_list_and_every_generation_route(server, adapters, root):
    refs, _ = adapters
    status, text = call(server, "/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(root / "other")})
    assert (status, text) == (200, "Success: LoRA adapter 'other' added successfully.")
    status, r = call(server, "/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(root / "other")})
    assert status == 400 and "has already been loaded" in r["error"]["message"]
    status, _ = call(server, "/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(root / "other"),
                                                       "load_inplace": True})
    assert status == 200
    _, models = call(server, "/v1/models", method="GET")
    cards = {c["id"]: c for c in models["data"]}
    assert cards["other"]["parent"] == NAME and cards["other"]["root"] == str(root / "other")
    assert cards[NAME]["parent"] is None
    p = prompt()
    status, r = call(server, "/v1/completions", {"model": "other", "prompt": p, "max_tokens": 5, "temperature": 1.0,
                                                 "seed": 1, "logprobs": 1, "return_token_ids": True,
                                                 "ignore_eos": True})
    assert status == 200, r
    choice = r["choices"][0]
    want = logprobs_of(refs["other"], p, choice["token_ids"])
    assert len(want) == 5 and max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], want)) <= 1e-4
    status, r = call(server, "/v1/chat/completions", {"model": "other", "max_tokens": 5, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "Name a colour."}]})
    assert status == 200, r
    status, text = call(server, "/v1/unload_lora_adapter", {"lora_name": "other"})
    assert (status, text) == (200, "Success: LoRA adapter 'other' removed successfully.")
    status, r = call(server, "/inference/v1/generate", {"model": "other", "token_ids": p,
                                                        "sampling_params": {"max_tokens": 2}})
    assert status == 404 and "The model `other` does not exist" in r["error"]["message"]
    status, r = call(server, "/v1/unload_lora_adapter", {"lora_name": "other"})
    assert status == 404 and "cannot be found" in r["error"]["message"]
    assert "other" not in {c["id"] for c in call(server, "/v1/models", method="GET")[1]["data"]}


def test_bad_adapters_are_refused_before_any_engine_changes(server, adapters, root, tmp_path_factory):
    import json

    from safetensors.torch import load_file, save_file

    bad = root / "bad"
    bad.mkdir()
    cfg = json.loads((root / "other" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 32, "lora_alpha": 32}))
    save_file(load_file(str(root / "other" / "adapter_model.safetensors")), str(bad / "adapter_model.safetensors"))
    trunc = root / "truncated"
    trunc.mkdir()
    (trunc / "adapter_config.json").write_text(json.dumps(cfg))
    data = (root / "other" / "adapter_model.safetensors").read_bytes()
    (trunc / "adapter_model.safetensors").write_bytes(data[: len(data) // 3])
    outside = tmp_path_factory.mktemp("outside")
    for body, status, needle in [
        ({"lora_name": "x", "lora_path": str(bad)}, 400, "rank 32 exceeds this engine's max_lora_rank 16"),
        ({"lora_name": "x", "lora_path": str(trunc)}, 400, "unreadable"),
        ({"lora_name": "x", "lora_path": str(outside)}, 403, "not under"),
        ({"lora_name": "x", "lora_path": str(root / "missing")}, 400, "is not a directory"),
        ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": NAME, "lora_path": str(root / "other")}, 400, "conflicts with a served base model"),
    ]:
        got, r = call(server, "/v1/load_lora_adapter", body)
        assert got == status and needle in r["error"]["message"], (body, got, r)
    assert "x" not in {c["id"] for c in call(server, "/v1/models", method="GET")[1]["data"]}
    assert sampled(server, NAME)[0]  # still serving


def test_a_chat_session_on_an_adapter_writes_rows_that_name_it(server, adapters, sessions_out):
    """The server-side session of a client that samples with ``model: policy`` (the adapter of step_2, loaded by
    the first test): its rows record the adapter and its version, and their logprobs are base + adapter's."""
    from rollout.data import load_samples

    refs, _ = adapters
    sid = "lora-session"
    status, r = http_call(server.url + "/v1/chat/completions", "POST", {
        "model": "policy", "max_tokens": 6, "temperature": 1.0, "seed": 2,
        "messages": [{"role": "user", "content": "Name a colour."}]}, {"X-Session-ID": sid}, None, 300)
    assert status == 200, r
    assert call(server, f"/v1/sessions/{sid}", method="DELETE")[0] == 200
    (row,) = [s for s in load_samples(sessions_out) if s.rollout_id == sid]
    assert row.meta["lora"] == "policy"
    ids = [int(t) for t in row.token_ids]
    start = next(i for i, m in enumerate(row.loss_mask) if m)
    assert {int(v) for v in row.weight_versions if v >= 0} == {2}
    want = logprobs_of(refs["step_2"], ids[:start], ids[start:])
    assert max(abs(float(row.logprobs[start + i]) - w) for i, w in enumerate(want)) <= 1e-4
