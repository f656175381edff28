"""Checkpoints as prime-rl's trainer writes them (PrimeIntellect-ai/prime-rl @ 559b447,
``src/prime_rl/utils/weights.py`` ``partition_weights`` / ``save_state_dict_parallel``): bf16 tensors, decoder
layers and the "" unit spread over the ranks by byte size, each rank's slice split with huggingface_hub,
``model.safetensors`` for one shard else ``model-0000i-of-0000n.safetensors`` + an index (indent=2, sort_keys),
metadata ``{"format": "pt"}``, a separate copy of the tied ``lm_head.weight``, no config.json, STABLE last and the
orchestrator's NCCL_READY. The embedded engine loads them exactly (the bf16 values upcast), and refuses a
config.json whose tying differs from the served model, keeping its weights and version."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch

from rollout.engines.checkpoint import CheckpointError
from rollout.engines.protocol import GenerateRequest, SamplingParams
from tests._support import smollm2_gguf

PROMPT = [1, 4093, 198, 19161, 2, 198, 1, 520, 9531, 198]
_UNIT = re.compile(r"^(.*?\blayers\.\d+)\.")


def write_broadcast(state: dict[str, torch.Tensor], d: Path, ranks: int, *, tied_head: bool = True) -> Path:
    """A step directory laid out as prime-rl's filesystem broadcast writes it (see the module doc)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    state = {k: v.to(torch.bfloat16).clone() for k, v in state.items() if tied_head or k != "lm_head.weight"}
    units: dict[str, str] = {k: (m.group(1) if (m := _UNIT.match(k)) else "") for k in state}
    size: dict[str, int] = {}
    for k, u in units.items():
        size[u] = size.get(u, 0) + state[k].numel() * state[k].element_size()
    load, owner = [0] * ranks, {}
    for u in sorted(size, key=lambda u: (-size[u], u)):  # biggest unit first, to the least loaded rank
        owner[u] = min(range(ranks), key=load.__getitem__)
        load[owner[u]] += size[u]
    d.mkdir(parents=True)
    shards = []  # (rank, tmp name, tensor names), in rank order
    for r in range(ranks):
        part = {k: v for k, v in state.items() if owner[units[k]] == r}
        split = split_torch_state_dict_into_shards(part, filename_pattern=f"tmp-rank{r}{{suffix}}.safetensors")
        for tmp, names in split.filename_to_tensors.items():
            if names:
                save_file({n: part[n].contiguous() for n in names}, str(d / tmp), metadata={"format": "pt"})
                shards.append((tmp, names))
    weight_map = {}
    for i, (tmp, names) in enumerate(shards, start=1):
        final = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (d / tmp).rename(d / final)
        weight_map.update(dict.fromkeys(names, final))
    if len(shards) > 1:
        total = sum(state[n].nbytes for n in weight_map)
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    (d / "STABLE").touch()
    (d / "NCCL_READY").touch()  # the orchestrator's, before its /update_weights
    return d


@pytest.fixture(scope="module")
def env():
    from rollout.engines.embedded import EmbeddedEngine
    from rollout.models import convert_gguf

    gguf = smollm2_gguf()
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing")
    base = convert_gguf(gguf)
    runner = asyncio.Runner()
    engine = EmbeddedEngine(str(base), threads=1, max_batch=2)
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    yield runner.run, engine, base, state
    runner.run(engine.close())
    runner.close()


def sampled(run, engine, tag):
    out = run(engine.generate(GenerateRequest(tag, list(PROMPT), SamplingParams(max_tokens=4, temperature=0.0,
                                                                                 ignore_eos=True))))
    return out.results[0].completion_ids, out.results[0].logprobs


def forward_logprobs(model, ids: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + completion])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(completion)]


@pytest.mark.parametrize("ranks,tied_head", [(1, True), (2, True), (2, False)])
def test_prime_rl_broadcast_loads_exactly(env, tmp_path, ranks, tied_head):
    from rollout.models import load_causal_lm

    run, engine, base, state = env
    g = torch.Generator().manual_seed(ranks)
    trained = {k: v + 0.01 * torch.randn(v.shape, generator=g) if k == "model.layers.2.mlp.up_proj.weight" else v
               for k, v in state.items()}
    trained["lm_head.weight"] = trained["model.embed_tokens.weight"]
    d = write_broadcast(trained, tmp_path / "broadcasts" / "step_1", ranks, tied_head=tied_head)
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert not (d / "config.json").exists()
    assert files == (["model.safetensors"] if ranks == 1 else ["model-00001-of-00002.safetensors",
                                                               "model-00002-of-00002.safetensors"])
    version = engine.info().weight_version
    run(engine.update_weights(str(d), version + 1))
    assert engine.info().weight_version == version + 1
    for k, v in engine.model.state_dict().items():  # exactly the bf16 values upcast
        assert torch.equal(v, trained[k].to(torch.bfloat16).float()), k
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    ids, lps = sampled(run, engine, f"primerl-{ranks}-{tied_head}")
    plain = load_causal_lm(str(base))
    plain.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in trained.items()})
    assert max(abs(a - b) for a, b in zip(lps, forward_logprobs(plain, PROMPT, ids))) <= 1e-4


def test_config_with_other_tying_is_refused_and_changes_nothing(env, tmp_path):
    """issue 40: tie_word_embeddings false and no lm_head.weight passed validation and loaded a random lm_head."""
    run, engine, base, state = env
    d = write_broadcast(state, tmp_path / "step_2", 1, tied_head=False)
    config = json.loads((base / "config.json").read_text())
    before, version = sampled(run, engine, "tie-before"), engine.info().weight_version
    for key, value in [("tie_word_embeddings", False), ("num_hidden_layers", 29), ("vocab_size", 49153),
                       ("head_dim", 32), ("hidden_size", 512), ("intermediate_size", 1024),
                       ("num_attention_heads", 8), ("num_key_value_heads", 1), ("rope_theta", 10000.0),
                       ("model_type", "mistral"), ("architectures", ["MistralForCausalLM"])]:
        bad = {**config, key: value}
        if key == "rope_theta":
            bad.pop("rope_parameters")
        (d / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError) as caught:
            run(engine.update_weights(str(d), version + 1))
        named = "rope_parameters" if key == "rope_theta" else key
        assert named in str(caught.value) and "weights were not changed" in str(caught.value), str(caught.value)
    assert engine.info().weight_version == version and sampled(run, engine, "tie-after") == before


def test_a_republished_copy_of_the_served_weights_is_seen_as_such(env, tmp_path):
    """``same_tensors`` (what the vLLM backend asks before reloading prime-rl's ``step_0``) against the served
    model's own directory: an fp32 copy with the tied head written out is the same; a bf16 copy is the same exactly
    when every value survives the rounding; one value moved by one ulp is not."""
    from safetensors.torch import save_file

    from rollout.engines.checkpoint import same_tensors

    _, engine, base, state = env
    copy = tmp_path / "copy"
    copy.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(copy / "model.safetensors"))  # lm_head included
    assert "lm_head.weight" in state and same_tensors(copy, base, torch.float32)
    bf16 = write_broadcast(state, tmp_path / "bf16", 1)
    exact = all(torch.equal(v.to(torch.bfloat16).float(), v) for v in state.values())
    assert same_tensors(bf16, base, torch.float32) == exact
    moved = tmp_path / "moved"
    moved.mkdir()
    last = sorted(state)[-1]
    nudged = dict(state, **{last: state[last].clone()})
    nudged[last].view(-1)[0] = torch.nextafter(nudged[last].view(-1)[0], torch.tensor(float("inf")))
    save_file({k: v.contiguous() for k, v in nudged.items()}, str(moved / "model.safetensors"))
    assert not same_tensors(moved, base, torch.float32)
