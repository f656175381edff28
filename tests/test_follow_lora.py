"""Follow mode with a trainer that publishes only a LoRA adapter each step, as prime-rl's LoRA runs do
(``broadcasts/step_N/`` holding ``adapter_model.safetensors`` + ``adapter_config.json``, then ``STABLE``): the engine
loads it as version N without holding the run, later turns are sampled with it, and each shard row records the
adapter (``lora``) and each token the version that sampled it. Every sampled token's logprob is checked against a
plain forward pass: peft's base + adapter for version 1, the base model for version 0."""

from __future__ import annotations

import asyncio

import pytest

from rollout.data import layout, load_samples
from rollout.engines.protocol import close_backend
from rollout.follow.service import LORA_NAME

from ._support import logprobs_of, write_adapter
from .test_follow import Harness, _config, _tasks, _turns_under_way, model_path  # noqa: F401

peft = pytest.importorskip("peft")


def test_an_adapter_step_loads_as_its_version_and_rows_record_it(tmp_path, model_path):  # noqa: F811
    from rollout.models import load_causal_lm

    base = load_causal_lm(model_path)
    staged = tmp_path / "staging" / "step_1"
    adapter = write_adapter(load_causal_lm(model_path), staged, seed=5)
    cfg = _config(12, max_steps=3, max_off_policy_steps=1)  # batch 3 needs version >= 1: it runs on the adapter

    async def trainer(h: Harness) -> None:
        await _turns_under_way(h, 0.5)
        target = layout.broadcast_dir(tmp_path, 1)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged.rename(target)
        (target / layout.STABLE).touch()  # last, as prime-rl's trainer writes it

    async def main():
        h = Harness(cfg, tmp_path, model_path, _tasks(3))
        try:
            sealed, _ = await asyncio.gather(h.follow.run(), trainer(h))
        finally:
            await close_backend(h.engine)
        return h, sealed

    h, sealed = asyncio.run(main())
    assert sealed == 3, h.lines
    h.service.close()
    assert any("adapter v1 loaded" in line for line in h.lines), h.lines
    assert h.follow.weights.loads[-1]["adapter"] is True and h.follow.weights.loads[-1]["version"] == 1
    rows = [s for k in (1, 2, 3) for s in load_samples(layout.step_dir(tmp_path, k))]
    by_lora = {None: [], LORA_NAME: []}
    worst = 0.0
    for s in rows:
        ids = [int(t) for t in s.token_ids]
        versions = {int(v) for v in s.weight_versions if v >= 0}
        by_lora[s.meta.get("lora")].append(s)
        assert versions == ({1} if s.meta["lora"] == LORA_NAME else {0}), (s.meta["lora"], versions)
        model = adapter if s.meta["lora"] == LORA_NAME else base
        start = next(t for t, m in enumerate(s.loss_mask) if m)
        want = logprobs_of(model, ids[:start], ids[start:])
        worst = max(worst, max(abs(float(s.logprobs[start + i]) - w) for i, w in enumerate(want)))
    assert by_lora[LORA_NAME] and by_lora[None], {k: len(v) for k, v in by_lora.items()}
    assert worst <= 1e-4, worst
