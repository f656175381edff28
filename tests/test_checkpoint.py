"""Checkpoint validation before a weight update (rollout/engines/checkpoint.py), with the real SmolLM2-135M embedded
engine (fp32, CPU) and real safetensors checkpoints written here.

Each bad checkpoint is refused by ``update_weights`` with a CheckpointError naming the tensor, before the engine
drains or loads anything: the version stays, and a greedy generation afterwards is token- and logprob-identical
to the one before the attempt. Without the check, transformers loads a checkpoint missing a tensor or holding an
unknown one (the missing tensor randomly initialised), loads NaN and inf weights, and refuses a wrong shape with
an error that names no tensor. A valid checkpoint still loads and changes the logprobs; ``tito serve`` refuses a
bad one with a 400 naming the tensor while its engine keeps serving.

Checkpoints are sharded as a trainer writes a large model (one file per layer, ``model.safetensors.index.json``):
the base model is written once per module, and each case hard-links the shards it does not change, so a case
writes ~17 MB instead of 540 MB. One engine and one event loop serve the module.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from rollout.engines.checkpoint import (
    CheckpointError,
    expected_from_dir,
    expected_from_model,
    validate_checkpoint,
)
from rollout.engines.protocol import GenerateRequest, SamplingParams
from tests._support import smollm2_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n" in SmolLM2's tokens
PROMPT = [1, 4093, 198, 19161, 2, 198, 1, 520, 9531, 198]
Q_PROJ = "model.layers.3.self_attn.q_proj.weight"
SHAPE_Q = (576, 576)


# ---- a base checkpoint in shards, and cases derived from it ---------------------------------------------------


def _shard_of(name: str) -> str:
    parts = name.split(".")
    return f"layer-{int(parts[2]):02d}.safetensors" if name.startswith("model.layers.") else "rest.safetensors"


class Checkpoints:
    """The base model as a sharded checkpoint, and variants of it that rewrite only the shards they change."""

    def __init__(self, root: Path, base_dir: Path) -> None:
        from safetensors.torch import load_file, save_file

        self.root = root
        self.base_dir = base_dir
        self.tensors = load_file(str(base_dir / "model.safetensors"))  # memory-mapped: read as written
        self.base = root / "base"
        self.base.mkdir()
        shards: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in self.tensors.items():
            shards.setdefault(_shard_of(name), {})[name] = t
        for file, part in shards.items():
            save_file(part, str(self.base / file), metadata={"format": "pt"})
        self.layout = {name: _shard_of(name) for name in self.tensors}
        self._finish(self.base, self.layout)

    def _finish(self, target: Path, layout: dict[str, str], config: bool = True) -> None:
        """The index of ``layout``, and the model's config files beside the weights."""
        (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": layout}))
        if config:
            for file in ("config.json", "generation_config.json"):
                shutil.copyfile(self.base_dir / file, target / file)

    def make(self, name: str, changes: dict[str, torch.Tensor | None], *, config: bool = True) -> Path:
        """A checkpoint ``root/name``: the base with ``changes`` applied (a tensor sets or adds a name, None drops
        it); changed shards are rewritten (an emptied one is left out), the others hard-linked."""
        from safetensors.torch import save_file

        target = self.root / name
        target.mkdir()
        layout = dict(self.layout)
        for n, t in changes.items():
            if t is None:
                layout.pop(n, None)
            else:
                layout[n] = layout.get(n, _shard_of(n))
        touched = {_shard_of(n) if n not in self.layout else self.layout[n] for n in changes}
        for file in sorted(set(self.layout.values())):
            if file not in touched:
                _link(self.base / file, target / file)
                continue
            part = {n: (changes[n] if n in changes else self.tensors[n]).contiguous()
                    for n, f in layout.items() if f == file}
            if part:
                save_file(part, str(target / file), metadata={"format": "pt"})
        self._finish(target, layout, config)
        return target


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copyfile(src, dst)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> Iterator[Checkpoints]:
    from rollout.models import convert_gguf

    gguf = smollm2_gguf()
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing")
    root = tmp_path_factory.mktemp("checkpoints")
    yield Checkpoints(root, convert_gguf(gguf))
    shutil.rmtree(root, ignore_errors=True)  # ~600 MB: not left for pytest's keep-3 retention


@pytest.fixture(scope="module")
def env(ckpts):
    """(run, engine): one embedded engine, loaded from the base model directory, on one event loop."""
    from rollout.engines.embedded import EmbeddedEngine

    runner = asyncio.Runner()
    engine = EmbeddedEngine(str(ckpts.base_dir), threads=1, max_batch=4)
    yield runner.run, engine
    runner.run(engine.close())
    runner.close()


def greedy(env, tag: str) -> tuple[list[int], list[float]]:
    run, engine = env
    out = run(engine.generate(GenerateRequest(f"greedy-{tag}", list(PROMPT),
                                              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))))
    r = out.results[0]
    return r.completion_ids, r.logprobs


# ---- bad checkpoints: refused, nothing changes ------------------------------------------------------------------


def _scaled(ck: Checkpoints, name: str, value: float, count: int = 3) -> torch.Tensor:
    t = ck.tensors[name].clone()
    t.view(-1)[:count] = value
    return t


LAYER_3 = [f"model.layers.3.{p}" for p in ("input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
                                           "mlp.up_proj.weight", "post_attention_layernorm.weight",
                                           "self_attn.k_proj.weight", "self_attn.o_proj.weight",
                                           "self_attn.q_proj.weight", "self_attn.v_proj.weight")]

# name -> (changes, what the message must say); the tensor each names is checked too
CASES: dict[str, tuple[Callable[[Checkpoints], dict], list[str]]] = {
    "missing-tensor": (lambda ck: {Q_PROJ: None}, ["lacks 1 of the model's", Q_PROJ]),
    "missing-layer": (lambda ck: dict.fromkeys(LAYER_3), ["lacks 9 of the model's", "model.layers.3.", "(+5 more)"]),
    "unknown-tensor": (lambda ck: {"model.layers.3.self_attn.q_proj.bias": torch.zeros(576)},
                       ["does not have", "model.layers.3.self_attn.q_proj.bias"]),
    "wrong-shape": (lambda ck: {Q_PROJ: ck.tensors[Q_PROJ][:, :575].clone()}, [Q_PROJ, "[576, 575]", "[576, 576]"]),
    "int-dtype": (lambda ck: {Q_PROJ: torch.zeros(SHAPE_Q, dtype=torch.int32)}, [Q_PROJ, "dtype I32"]),
    "nan": (lambda ck: {Q_PROJ: _scaled(ck, Q_PROJ, float("nan"))}, [Q_PROJ, "3 NaN and 0 inf"]),
    "inf": (lambda ck: {"model.layers.7.mlp.up_proj.weight": _scaled(ck, "model.layers.7.mlp.up_proj.weight",
                                                                     float("-inf"), 2)},
            ["model.layers.7.mlp.up_proj.weight", "0 NaN and 2 inf"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_checkpoint_is_refused_naming_the_tensor_and_changes_nothing(env, ckpts, case):
    run, engine = env
    changes, needles = CASES[case]
    path = ckpts.make(case, changes(ckpts))
    version = engine.info().weight_version
    before = greedy(env, f"{case}-before")
    with pytest.raises(CheckpointError) as caught:
        run(engine.update_weights(str(path), version + 1))
    message = str(caught.value)
    assert message.startswith("update_weights: checkpoint") and "the weights were not changed" in message, message
    assert all(n in message for n in needles), (needles, message)
    assert caught.value.param == "weight_dir" and caught.value.tensor and caught.value.tensor in message
    assert "\n" not in message
    assert engine.info().weight_version == version
    assert greedy(env, f"{case}-after") == before, "the refused checkpoint changed what the engine samples"
    with pytest.raises(CheckpointError, match=caught.value.tensor.replace(".", r"\.")):
        run(engine.validate_weights(str(path)))  # the same check, without update_weights' wording


def test_layout_problems_are_named(ckpts, tmp_path):
    """Not a directory, no weights, a torn file, no or broken config.json, an index naming a missing shard."""
    expected = expected_from_dir(ckpts.base_dir)
    (tmp_path / "empty").mkdir()
    torn = ckpts.make("torn", {})
    shard = torn / "layer-05.safetensors"
    data = shard.read_bytes()
    shard.unlink()  # a hard link to the base's shard: replace it, never write through it
    shard.write_bytes(data[: len(data) // 2])  # a write cut short
    no_config = ckpts.make("no-config", {}, config=False)
    bad_config = ckpts.make("bad-config", {}, config=False)
    (bad_config / "config.json").write_text("{\"model_type\": ")
    lost_shard = ckpts.make("lost-shard", {})
    (lost_shard / "layer-09.safetensors").unlink()
    for path, needle in [(tmp_path / "nowhere", "not a directory (nothing is there)"),
                         (ckpts.base_dir / "config.json", "not a directory (it is a file)"),
                         (tmp_path / "empty", "holds no *.safetensors files"),
                         (torn, "cannot read the safetensors header of layer-05.safetensors"),
                         (bad_config, "config.json is not readable JSON"),
                         (lost_shard, "lists layer-09.safetensors, which is missing")]:
        with pytest.raises(CheckpointError) as caught:
            validate_checkpoint(path, expected)
        assert needle in str(caught.value) and str(path) in str(caught.value), (needle, str(caught.value))
    import pickle  # through Ray: the fields survive

    again = pickle.loads(pickle.dumps(caught.value))
    assert (str(again), again.problem, again.param) == (str(caught.value), caught.value.problem, "weight_dir")
    # no backend needs config.json (prime-rl writes none), but one present must be JSON
    assert validate_checkpoint(no_config, expected).tensors == len(ckpts.tensors)


def test_what_may_differ_from_the_model(env, ckpts):
    """A tied lm_head.weight may be present or absent; F16/BF16 tensors load into the fp32 model; the expected
    tensors read from the model and from its directory agree."""
    run, engine = env
    embed = ckpts.tensors["model.embed_tokens.weight"]
    from_model, from_dir = expected_from_model(engine.model), expected_from_dir(ckpts.base_dir)
    assert from_model == from_dir and from_model["lm_head.weight"].tied == ("model.embed_tokens.weight",)
    tied = ckpts.make("tied-head", {"lm_head.weight": embed.clone()})
    halves = ckpts.make("halves", {Q_PROJ: ckpts.tensors[Q_PROJ].half(),
                                   "model.layers.4.mlp.up_proj.weight":
                                       ckpts.tensors["model.layers.4.mlp.up_proj.weight"].bfloat16()})
    for path in (ckpts.base, tied, halves):
        report = run(engine.validate_weights(str(path)))
        assert report["tensors"] in (272, 273) and report["values_checked"] and report["bytes"] > 500e6, report
    no_embed = ckpts.make("no-embed", {"model.embed_tokens.weight": None})  # neither name of the tied tensor
    with pytest.raises(CheckpointError, match=r"lacks 1 of the model's 272 tensors: model\.embed_tokens\.weight \("):
        run(engine.validate_weights(str(no_embed)))


def test_valid_checkpoint_loads_and_changes_the_logprobs(env, ckpts):
    """The model's own weights with one matrix scaled by 1.1 pass, load, and change the logprobs; the same
    checkpoint checked by validate_weights just before is not read again unless a file changed; the base
    weights load back to the very same logprobs."""
    run, engine = env
    name = "model.layers.0.mlp.down_proj.weight"
    path = ckpts.make("scaled", {name: ckpts.tensors[name] * 1.1})
    version = engine.info().weight_version
    before = greedy(env, "valid-before")
    first = run(engine.validate_weights(str(path)))
    assert run(engine.validate_weights(str(path))) == first  # remembered: the same report, not a new read
    run(engine.update_weights(str(path), version + 1))
    assert engine.info().weight_version == version + 1
    after = greedy(env, "valid-after")
    assert max(abs(a - b) for a, b in zip(after[1], before[1])) > 1e-3, "the new weights did not change the logprobs"
    os.utime(path / "layer-00.safetensors")  # rewritten (same bytes): read again
    assert run(engine.validate_weights(str(path)))["seconds"] != first["seconds"]
    run(engine.update_weights(str(ckpts.base), version + 2))
    back = greedy(env, "valid-back")
    # the same weights again: the same tokens, logprobs within fp32 noise (a reloaded model's tensors may sit at
    # other addresses, and the CPU GEMM kernels' blocking then differs in the last bits: measured 1.7e-6)
    assert back[0] == before[0] and max(abs(a - b) for a, b in zip(back[1], before[1])) < 1e-4


# ---- tito serve: /update_weights ----------------------------------------------------------------------------


def test_serve_refuses_a_bad_checkpoint_with_400_before_pausing(env, ckpts):
    """POST /update_weights with a checkpoint holding NaN: 400 naming the tensor and the path the client sent,
    param weight_dir; the server was never paused, the version is unchanged and greedy output is identical."""
    from rollout.handles import LocalEngine, LocalRenderer
    from rollout.renderer_service import RendererService
    from rollout.serve.app import ServerState
    from rollout.serve.fleet import Fleet
    from rollout.serve.launch import ServerThread
    from rollout.serve.sessions import SessionManager
    from tests._support import http_call

    engine = env[1]
    bad = ckpts.make("serve-nan", {Q_PROJ: _scaled(ckpts, Q_PROJ, float("nan"), 5)})
    service = RendererService(str(ckpts.base_dir))  # the model directory holds the tokenizer too
    state = ServerState(fleet=Fleet([LocalEngine(engine)], [engine.info()]),
                        sessions=SessionManager([LocalRenderer(service)], idle_timeout_s=60, max_sessions=2),
                        parser=service.renderer, model_names=["smollm2"], root="smollm2",
                        weights_root=str(ckpts.root))
    srv = ServerThread(state).start()
    try:
        def generate() -> tuple[list[int], list[float]]:
            status, r = http_call(srv.url + "/inference/v1/generate", "POST", {
                "token_ids": PROMPT, "sampling_params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                         "logprobs": 1}}, timeout=120)
            assert status == 200, r
            choice = r["choices"][0]
            return choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]

        version = state.fleet.weight_version
        before = generate()
        paused = []
        pause = state.fleet.pause
        state.fleet.pause = lambda *a, **k: (paused.append(a), pause(*a, **k))[1]  # record any pause
        status, r = http_call(srv.url + "/update_weights", "POST", {"weight_dir": "serve-nan"}, timeout=120)
        assert status == 400 and r["error"]["param"] == "weight_dir", r
        message = r["error"]["message"]
        assert message.startswith("weight_dir 'serve-nan': ") and f"{Q_PROJ} holds 5 NaN" in message, message
        assert str(bad) not in message  # the server quotes what the client sent, not where its root is
        assert paused == [] and state.fleet.weight_version == version == engine.info().weight_version
        assert http_call(srv.url + "/is_paused")[1] == {"is_paused": False}
        assert generate() == before
    finally:
        srv.stop()
