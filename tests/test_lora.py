"""LoRA adapters on the embedded engine (SmolLM2-135M), with peft as the reference: adapters written by peft's
``save_pretrained`` (random A and B, so every delta counts), sampled from alone and mixed in one batch with the base
model, each sampled token's logprob checked against a peft forward pass of base + that adapter; a reload swaps the
adapter and bumps its version; bad adapters are refused naming the problem, and the engine goes on serving."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from rollout.engines.embedded import EmbeddedEngine
from rollout.engines.lora import AdapterError
from rollout.engines.protocol import EngineError, GenerateRequest, SamplingParams
from tests._support import logprobs_of, smollm2_gguf, write_adapter

peft = pytest.importorskip("peft")

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712]


@pytest.fixture(scope="module")
def env():
    gguf = smollm2_gguf()
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing")
    runner = asyncio.Runner()
    engine = runner.run(_build(str(gguf)))
    yield runner, engine
    runner.run(engine.close())
    runner.close()


async def _build(model: str) -> EmbeddedEngine:
    return EmbeddedEngine(model, threads=1, max_batch=8, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def adapters(env, tmp_path_factory):
    """Two adapters saved by peft, with a peft model of each (the reference) and the plain base."""
    from rollout.models import load_causal_lm

    root = tmp_path_factory.mktemp("adapters")
    refs = {}
    for name, seed, targets in (("a", 1, ("q_proj", "v_proj", "down_proj")), ("b", 2, ("k_proj", "o_proj", "up_proj"))):
        refs[name] = write_adapter(load_causal_lm(env[1].model_name), root / name, seed=seed, targets=targets)
    return root, refs, load_causal_lm(env[1].model_name)


def req(rid: str, lora: str | None = None, **sampling) -> GenerateRequest:
    sampling = {"max_tokens": 10, "temperature": 1.0, "seed": 7, "ignore_eos": True, **sampling}
    return GenerateRequest(rid, list(PROMPT), SamplingParams(**sampling), lora=lora)


def test_adapters_mixed_in_one_batch_match_peft(env, adapters):
    runner, engine = env
    root, refs, base = adapters

    async def go():
        assert await engine.load_lora_adapter("a", str(root / "a")) == 0
        assert await engine.load_lora_adapter("b", str(root / "b"), version=5) == 5
        return await asyncio.gather(*(engine.generate(req(f"mix-{i}-{lora}", lora, seed=i))
                                      for i, lora in enumerate([None, "a", "b", "a", None, "b"])))

    outs = runner.run(go())
    worst = 0.0
    for out, lora in zip(outs, [None, "a", "b", "a", None, "b"]):
        r = out.results[0]
        want = logprobs_of(refs[lora] if lora else base, PROMPT, r.completion_ids)
        worst = max(worst, max(abs(x - y) for x, y in zip(r.logprobs, want)))
        assert r.weight_version == {None: 0, "a": 0, "b": 5}[lora]
    assert worst <= 1e-4, worst
    # the adapters change the distribution: the base model's logprobs of an adapter's tokens differ
    r = outs[1].results[0]
    assert max(abs(x - y) for x, y in zip(r.logprobs, logprobs_of(base, PROMPT, r.completion_ids))) > 1e-2
    assert engine.lora_adapters()["b"]["version"] == 5 and engine.lora_adapters()["a"]["rank"] == 8


def test_reload_swaps_the_adapter_and_bumps_its_version(env, adapters, tmp_path):
    runner, engine = env
    root, refs, base = adapters
    newer = write_adapter(base_copy(engine), tmp_path / "a2", seed=11)

    async def go():
        await engine.load_lora_adapter("a", str(root / "a"))
        before = engine.lora_adapters()["a"]["version"]
        version = await engine.load_lora_adapter("a", str(tmp_path / "a2"))
        return before, version, await engine.generate(req("reloaded", "a"))

    before, version, out = runner.run(go())
    assert version == before + 1
    r = out.results[0]
    assert r.weight_version == version
    assert max(abs(x - y) for x, y in zip(r.logprobs, logprobs_of(newer, PROMPT, r.completion_ids))) <= 1e-4


def base_copy(engine):
    from rollout.models import load_causal_lm

    return load_causal_lm(engine.model_name)


def test_session_kv_of_one_adapter_is_not_reused_by_another(env, adapters):
    runner, engine = env
    root, refs, base = adapters

    async def go():
        await engine.load_lora_adapter("a", str(root / "a"))
        await engine.load_lora_adapter("b", str(root / "b"))
        first = await engine.generate(GenerateRequest("s1", list(PROMPT), SamplingParams(max_tokens=4, temperature=0),
                                                      session_id="sess", lora="a"))
        await engine.wait_idle()
        grown = PROMPT + first.results[0].completion_ids + [198]
        second = await engine.generate(GenerateRequest("s2", grown, SamplingParams(max_tokens=4, temperature=0),
                                                       session_id="sess", lora="b"))
        return grown, second

    grown, second = runner.run(go())
    r = second.results[0]
    assert r.cached_prompt_tokens == 0  # a's KV is not b's
    assert max(abs(x - y) for x, y in zip(r.logprobs, logprobs_of(refs["b"], grown, r.completion_ids))) <= 1e-4


def test_bad_adapters_are_refused_naming_the_problem_and_the_engine_serves_on(env, adapters, tmp_path):
    runner, engine = env
    root, refs, base = adapters
    from safetensors.torch import load_file, save_file

    def variant(name: str, edit_config=None, edit_tensors=None, truncate: bool = False):
        d = tmp_path / name
        d.mkdir()
        cfg = json.loads((root / "a" / "adapter_config.json").read_text())
        tensors = load_file(str(root / "a" / "adapter_model.safetensors"))
        if edit_config:
            edit_config(cfg)
        if edit_tensors:
            edit_tensors(tensors)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        save_file(tensors, str(d / "adapter_model.safetensors"))
        if truncate:
            data = (d / "adapter_model.safetensors").read_bytes()
            (d / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
        return d

    key = next(k for k in load_file(str(root / "a" / "adapter_model.safetensors")) if "lora_B" in k)

    def nan(t):
        t[key] = t[key].clone()
        t[key][0, 0] = math.nan

    def other_base(t):  # a larger model's hidden size: every shape is off
        for k in list(t):
            t[k] = torch.zeros(8, 960) if "lora_A" in k else torch.zeros(960, 8)

    def unknown_module(t):
        t["base_model.model.model.layers.0.mlp.gate_proj_x.lora_A.weight"] = torch.zeros(8, 576)
        t["base_model.model.model.layers.0.mlp.gate_proj_x.lora_B.weight"] = torch.zeros(1536, 8)

    cases = [
        (variant("nan", edit_tensors=nan), "non-finite"),
        (variant("big-rank", edit_config=lambda c: c.update(r=32)), "exceeds this engine's max_lora_rank 16"),
        (variant("other-base", edit_tensors=other_base), "has shape"),
        (variant("unknown", edit_tensors=unknown_module), "not in the served model"),
        (variant("dora", edit_config=lambda c: c.update(use_dora=True)), "use_dora"),
        (variant("truncated", truncate=True), "unreadable"),
        (tmp_path / "missing", "is not a directory"),
    ]
    for path, needle in cases:
        with pytest.raises(AdapterError, match=needle):
            runner.run(engine.load_lora_adapter("bad", str(path)))
    assert "bad" not in engine.lora_adapters()
    with pytest.raises(EngineError, match="no LoRA adapter named 'nope'"):
        runner.run(engine.generate(req("unknown-adapter", "nope")))
    assert runner.run(engine.generate(req("after-bad"))).results[0].finish_reason == "length"


def test_unload_then_max_loras(env, adapters):
    runner, engine = env
    root, _, _ = adapters
    runner.run(engine.load_lora_adapter("a", str(root / "a")))
    runner.run(engine.load_lora_adapter("b", str(root / "b")))
    with pytest.raises(AdapterError, match="max_loras"):
        runner.run(engine.load_lora_adapter("c", str(root / "a")))
    runner.run(engine.unload_lora_adapter("b"))
    with pytest.raises(EngineError, match="no LoRA adapter named 'b'"):
        runner.run(engine.generate(req("unloaded", "b")))
    assert runner.run(engine.load_lora_adapter("c", str(root / "b"))) == 0
    with pytest.raises(EngineError, match="no LoRA adapter named 'zzz'"):
        runner.run(engine.unload_lora_adapter("zzz"))


def test_republished_served_weights_cost_no_reload_and_keep_the_session_kv(env, tmp_path):
    """prime-rl sends ``step_0`` (the starting model, republished without config.json) at start-up: the engine
    compares it with what it serves and only moves the version; the session KV of earlier turns stays usable."""
    from rollout.follow.publish import publish_weights

    runner, engine = env
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    step0 = publish_weights(tmp_path, 1, state, config=engine.model.config.to_dict())
    (step0 / "config.json").unlink()  # as prime-rl's trainer writes it

    async def go():
        first = await engine.generate(GenerateRequest("s0-1", list(PROMPT), SamplingParams(max_tokens=4, temperature=0),
                                                      session_id="s0"))
        await engine.wait_idle()
        skipped = engine.stats["reloads_skipped"]
        version = engine.info().weight_version + 1
        await engine.update_weights(str(step0), version)
        grown = PROMPT + first.results[0].completion_ids + [198]
        second = await engine.generate(GenerateRequest("s0-2", grown, SamplingParams(max_tokens=4, temperature=0),
                                                       session_id="s0"))
        return engine.stats["reloads_skipped"] - skipped, version, second.results[0]

    skipped, version, r = runner.run(go())
    assert skipped == 1 and r.weight_version == version
    assert r.cached_prompt_tokens > 0  # the KV of turn 1 was kept: nothing was reloaded


def test_adapters_stay_applied_through_a_full_weight_update(env, adapters, tmp_path):
    """A full checkpoint load rebuilds the model: the loaded adapters must apply to the new weights."""
    from rollout.follow.publish import publish_weights
    from rollout.models import load_causal_lm

    runner, engine = env
    root, _, _ = adapters
    new_base = load_causal_lm(engine.model_name)
    with torch.no_grad():
        new_base.model.norm.weight.mul_(1.25)
    ckpt = publish_weights(tmp_path / "run", 1, {k: v.clone() for k, v in new_base.state_dict().items()},
                           config=new_base.config.to_dict())
    want_model = write_adapter(new_base, tmp_path / "a-on-new", seed=1)  # adapter "a"'s weights, on the new base

    async def go():
        await engine.load_lora_adapter("a", str(root / "a"))
        await engine.update_weights(str(ckpt), engine.info().weight_version + 1)
        return await engine.generate(req("after-update", "a"))

    r = runner.run(go()).results[0]
    assert max(abs(x - y) for x, y in zip(r.logprobs, logprobs_of(want_model, PROMPT, r.completion_ids))) <= 1e-4
