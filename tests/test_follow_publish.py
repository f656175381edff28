"""rollout.follow.publish: the trainer's side of the weights (RUN_DIR/broadcasts/step_N/, STABLE last).

Fast tests use a tiny real transformers Llama (random init, 2 layers, tied embeddings) and plain torch
modules, written as real safetensors files and read back by ``load_causal_lm`` (the embedded engine's
loader). One module-scoped test loads the real SmolLM2-135M: the embedded engine loads a published
checkpoint with ``update_weights`` and its greedy logprobs then equal a plain forward pass of the published
weights (their tied embeddings included).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rollout.data.layout import BROADCASTS, STABLE, broadcast_dir, stable_versions
from rollout.follow import publish as publish_mod
from rollout.follow.publish import latest_version, publish_weights

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_llama(seed: int = 0, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def entries(run_dir: Path) -> list[str]:
    """Everything in broadcasts/, hidden temporaries included."""
    root = run_dir / BROADCASTS
    return sorted(os.listdir(root)) if root.is_dir() else []


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# -- layout and round trip ----------------------------------------------------------------------------------------

def test_publish_transformers_model_round_trip(tmp_path):
    from rollout.models import load_causal_lm

    model = tiny_llama()
    assert latest_version(tmp_path) == 0
    path = publish_weights(tmp_path, 1, model)
    assert path == broadcast_dir(tmp_path, 1)
    assert sorted(os.listdir(path)) == ["STABLE", "config.json", "model.safetensors"]
    assert (path / STABLE).stat().st_size == 0
    assert entries(tmp_path) == ["step_1"]  # no temporary left
    assert stable_versions(tmp_path) == [1] and latest_version(tmp_path) == 1

    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert "lm_head.weight" not in f.keys()  # tied: left out, as save_pretrained does
    written = read_all(path)
    state = model.state_dict()
    assert set(written) == set(state) - {"lm_head.weight"}
    for k, v in written.items():
        assert torch.equal(v, state[k]), k

    loaded = load_causal_lm(path)  # the embedded engine's loader
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    publish_weights(tmp_path, 2, model)
    assert latest_version(tmp_path) == 2 and entries(tmp_path) == ["step_1", "step_2"]


def test_untied_model_writes_lm_head(tmp_path):
    model = tiny_llama(tie=False)
    path = publish_weights(tmp_path, 1, model)
    written = read_all(path)
    assert torch.equal(written["lm_head.weight"], model.lm_head.weight)
    assert not torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])


def test_state_dict_with_config_dict_path_or_directory(tmp_path):
    model = tiny_llama()
    cfg = model.config.to_dict()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # a trainer's copy: the tie is by value now
    p1 = publish_weights(tmp_path / "run", 1, state, config=cfg)
    assert "lm_head.weight" not in read_all(p1)  # equal to the embeddings and tied by the config: dropped
    p2 = publish_weights(tmp_path / "run", 2, state, config=p1 / "config.json")
    p3 = publish_weights(tmp_path / "run", 3, state, config=p1)
    for p in (p2, p3):
        assert json.loads((p / "config.json").read_text())["model_type"] == "llama"
        assert read_all(p).keys() == read_all(p1).keys()


def test_plain_module_contiguous_and_shared_tensors(tmp_path):
    lin = torch.nn.Linear(4, 6)
    module = torch.nn.Module()
    module.a = lin
    module.b = lin  # the same parameters under two names, not a declared tie: both written
    state = module.state_dict()
    state["t"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous
    path = publish_weights(tmp_path, 1, state, config={"model_type": "custom"})
    written = read_all(path)
    assert torch.equal(written["a.weight"], lin.weight) and torch.equal(written["b.weight"], lin.weight)
    assert torch.equal(written["t"], state["t"])


def test_sharded_output_loads(tmp_path):
    from rollout.models import load_causal_lm

    model = tiny_llama()
    path = publish_weights(tmp_path, 1, model, max_shard_bytes=8 * 1024)
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    loaded = load_causal_lm(path)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


# -- refusals -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", [0, -1, True, 1.0, "1"])
def test_bad_version_refused(tmp_path, version):
    with pytest.raises(ValueError, match="version must be an int > 0"):
        publish_weights(tmp_path, version, tiny_llama())
    assert entries(tmp_path) == []


def test_existing_version_refused(tmp_path):
    model = tiny_llama()
    path = publish_weights(tmp_path, 1, model)
    before = (path / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(ValueError, match="version 1 already exists"):
        publish_weights(tmp_path, 1, model)
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    assert entries(tmp_path) == ["step_1"]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_refused(tmp_path, bad):
    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 2] = bad
    with pytest.raises(ValueError, match=r"non-finite .* model\.layers\.1\.mlp\.up_proj\.weight"):
        publish_weights(tmp_path, 1, model)
    assert entries(tmp_path) == [] and latest_version(tmp_path) == 0


def test_missing_or_bad_config_refused(tmp_path):
    state = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match="no config"):
        publish_weights(tmp_path, 1, state)
    with pytest.raises(ValueError, match="no model_type"):
        publish_weights(tmp_path, 1, state, config={"hidden_size": 2})
    with pytest.raises(ValueError, match="not a readable config.json"):
        publish_weights(tmp_path, 1, state, config=tmp_path / "nope.json")
    with pytest.raises(ValueError, match="not tensors"):
        publish_weights(tmp_path, 1, {"w": [1.0]}, config={"model_type": "x"})
    assert entries(tmp_path) == []


def test_tied_lm_head_with_other_values_refused(tmp_path):
    model = tiny_llama()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] += 1.0
    with pytest.raises(ValueError, match="ties lm_head.weight to model.embed_tokens.weight but their values differ"):
        publish_weights(tmp_path, 1, state, config=model.config.to_dict())
    assert entries(tmp_path) == []


# -- atomicity: the order of the writes, and failures --------------------------------------------------------------

def test_directory_appears_complete_and_stable_last(tmp_path, monkeypatch):
    """Intercept the rename and the STABLE creation: the temporary is hidden and complete when renamed, the
    step directory is complete when STABLE is created, and STABLE comes after everything else."""
    events: list[tuple[str, list[str]]] = []
    real_rename, real_open = os.rename, os.open
    target = broadcast_dir(tmp_path, 1)

    def rename(src, dst, *a, **kw):
        if Path(dst) == target:
            assert Path(src).parent == target.parent and Path(src).name.startswith(".")
            assert not target.exists()
            events.append(("rename", sorted(os.listdir(src))))
        return real_rename(src, dst, *a, **kw)

    def open_(path, flags, *a, **kw):
        if Path(path).name == STABLE:
            events.append(("stable", sorted(os.listdir(Path(path).parent))))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "open", open_)
    publish_weights(tmp_path, 1, tiny_llama())
    monkeypatch.undo()
    assert events == [("rename", ["config.json", "model.safetensors"]),
                      ("stable", ["config.json", "model.safetensors"])]
    times = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    assert times[STABLE] >= max(times.values())


@pytest.mark.parametrize("stage", ["save", "config", "rename", "stable"])
def test_failure_leaves_nothing(tmp_path, monkeypatch, stage):
    """A failure at any stage (a tensor file, config.json, the rename, STABLE) removes the temporary and
    any step directory this call created, and raises."""
    import safetensors.torch

    def boom(*a, **kw):
        raise OSError(f"disk full at {stage}")

    if stage == "save":
        monkeypatch.setattr(safetensors.torch, "save_file", boom)
    elif stage == "config":
        real = publish_mod._write_text
        monkeypatch.setattr(publish_mod, "_write_text",
                            lambda p, t: boom() if p.name == "config.json" else real(p, t))
    elif stage == "rename":
        monkeypatch.setattr(os, "rename", boom)
    else:
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda p, f, *a, **kw: boom() if Path(p).name == STABLE
                            else real_open(p, f, *a, **kw))
    with pytest.raises(OSError, match=f"disk full at {stage}"):
        publish_weights(tmp_path, 1, tiny_llama())
    monkeypatch.undo()
    assert entries(tmp_path) == []
    assert latest_version(tmp_path) == 0
    publish_weights(tmp_path, 1, tiny_llama())  # the version is still free
    assert entries(tmp_path) == ["step_1"]


def test_latest_version_ignores_unstable_and_stray(tmp_path):
    root = tmp_path / BROADCASTS
    (root / "step_7").mkdir(parents=True)  # no STABLE: being written, never read
    (root / ".step_9-tmp").mkdir()
    (root / "notes").mkdir()
    assert latest_version(tmp_path) == 0
    publish_weights(tmp_path, 3, tiny_llama())
    assert latest_version(tmp_path) == 3


# -- the real model: the embedded engine loads what was published ---------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    from tests._support import smollm2_gguf

    smollm2_gguf()  # skips when the model is not installed
    from rollout.models import load_causal_lm

    return load_causal_lm("smollm2-135m")


def test_embedded_engine_loads_published_smollm2(smollm2, tmp_path):
    from rollout.data.packing import PackedRow, packed_logprobs
    from rollout.engines.embedded import EmbeddedEngine
    from rollout.engines.protocol import GenerateRequest, SamplingParams

    torch.set_num_threads(1)
    model = smollm2
    base_embed = model.model.embed_tokens.weight.detach().clone()
    base_norm = model.model.norm.weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a visible change, in the tied embeddings too (a stale lm_head would show)
        model.model.embed_tokens.weight.add_(0.02 * torch.randn(base_embed.shape, generator=gen))
        model.model.norm.weight.mul_(1.1)
    try:
        path = publish_weights(tmp_path, 1, model)
        # "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
        #  <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n" in SmolLM2's tokens
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                  19712, 8182, 2, 198, 1, 4093, 198, 19161, 2, 198, 1, 520, 9531, 198]

        async def go():
            engine = EmbeddedEngine("smollm2-135m", threads=1, max_batch=2)
            try:
                sp = SamplingParams(max_tokens=12, temperature=0.0)
                before = await engine.generate(GenerateRequest("a", prompt, sp))
                await engine.update_weights(str(path), 1)
                after = await engine.generate(GenerateRequest("b", prompt, sp))
                return before.results[0], after.results[0]
            finally:
                await engine.close()

        before, after = asyncio.run(go())
        assert before.weight_version == 0 and after.weight_version == 1
        ids = prompt + after.completion_ids
        n = len(after.completion_ids)
        row = PackedRow(torch.tensor(ids).numpy(), torch.arange(len(ids)).numpy(),
                        torch.zeros(len(ids), dtype=torch.bool).numpy(), torch.zeros(len(ids)).numpy(),
                        torch.zeros(len(ids)).numpy(), torch.tensor([0, len(ids)], dtype=torch.int32).numpy())
        with torch.no_grad():
            ref = packed_logprobs(model, row)[-n:]  # the published weights, in memory: a plain forward pass
            assert torch.allclose(torch.tensor(after.logprobs), ref, atol=1e-4), (after.logprobs, ref.tolist())
            model.model.embed_tokens.weight.copy_(base_embed)
            model.model.norm.weight.copy_(base_norm)
            old = packed_logprobs(model, row)[-n:]
        assert (old - ref).abs().max() > 1e-2  # the engine really runs the new weights
    finally:
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(base_embed)
            model.model.norm.weight.copy_(base_norm)


def test_only_real_canonical_step_dirs_count_as_broadcasts(tmp_path):
    """Names a trainer never writes are not versions: ``step_01`` (broadcast_dir(1) names ``step_1``), ``step_``
    + 30 digits (it would outrank every real step and overflow the shards' int32 versions), ``step_-1``,
    ``step_abc``; nor is a symlinked step, even one pointing at a complete broadcast outside the run."""
    outside = tmp_path / "elsewhere" / "step_9"
    outside.mkdir(parents=True)
    (outside / STABLE).touch()
    root = tmp_path / "run" / BROADCASTS
    for name in ("step_0", "step_2", "step_01", "step_" + "9" * 30, "step_2147483648", "step_-1", "step_abc",
                 "step_"):
        (root / name).mkdir(parents=True)
        (root / name / STABLE).touch()
    (root / "step_9").symlink_to(outside, target_is_directory=True)
    assert stable_versions(tmp_path / "run") == [0, 2]
