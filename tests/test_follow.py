"""Follow mode (continuous RL) in one process, on real parts: the SmolLM2 embedded engine, the real renderer
service writing real Arrow shards, real safetensors checkpoints published into a run directory. No Ray: the
service runs on the same driver ``tito run --follow`` uses (the CLI and a SIGKILL restart: test_follow_cli.py).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from rollout.config import FollowConfig, RunConfig
from rollout.data import layout, load_samples
from rollout.data.shards import read_manifest
from rollout.engines.protocol import GenerateRequest, SamplingParams, close_backend
from rollout.envs.base import Task
from rollout.envs.registry import make_env
from rollout.follow.publish import publish_weights
from rollout.follow.service import FollowService, TaskPool, min_version, recover
from rollout.handles import LocalEngine, LocalRenderer
from rollout.loop import RolloutDriver
from rollout.renderer_service import RendererService

from ._support import smollm2_gguf

# long answers, so a weight update lands while turns are running
STORY = "Write a long story about a dragon who learns to count. Use many sentences."


@pytest.fixture(scope="module")
def model_path() -> str:
    from rollout.models import resolve_model

    smollm2_gguf()  # skips (or fails under CI) without the model
    return str(resolve_model("smollm2-135m"))


@pytest.fixture(scope="module")
def base_state(model_path):
    from rollout.models import load_causal_lm

    model = load_causal_lm(model_path)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config_of(model) -> dict:
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the GGUF's: the published checkpoint is plain fp32
    return cfg


def _tasks(n: int, prompt: str = STORY) -> list[Task]:
    return [Task(task_id=f"t{i}", messages=[{"role": "user", "content": f"{prompt} ({i})"}], answer="7")
            for i in range(n)]


def _config(tokens: int = 24, **follow) -> RunConfig:
    """Batches of one group of two rollouts, run two at a time: batch 2 waits for batch 1's rollouts, so with an
    update during batch 1 some of batch 2 starts after it."""
    return RunConfig(
        env={"name": "arithmetic", "options": {"difficulty": 1}}, group_size=2, max_turns=1,
        max_tokens_per_turn=tokens, max_tokens_per_rollout=tokens, sampling={"temperature": 1.0, "seed": 7},
        max_concurrent_rollouts=2, follow=FollowConfig(**{"groups_per_step": 1, "poll_interval_s": 0.05, **follow}))


class Harness:
    """The service's parts in this process: one embedded engine, one renderer service, a driver."""

    def __init__(self, cfg: RunConfig, run_dir: Path, model_path: str, tasks: list[Task], engine=None) -> None:
        from rollout.engines.embedded import EmbeddedEngine
        from rollout.startup import create_parser

        self.engine = engine or EmbeddedEngine(model_path, threads=1, max_batch=8, fetch=False)
        self.service = RendererService(model_path, out_dir=str(run_dir / layout.ROLLOUTS), flush_interval_s=None)
        parser = create_parser(cfg.renderer, model_path)
        engines, renderers = [LocalEngine(self.engine)], [LocalRenderer(self.service)]
        self.driver = RolloutDriver(cfg, make_env(cfg.env.name, **cfg.env.options), engines, renderers,
                                    self.engine.info(), parser)
        self.lines: list[str] = []
        self.follow = FollowService(cfg, run_dir, self.driver, engines, renderers, tasks, config=cfg.model_dump(mode="json"),
                                    renderer_info=self.service.info(), log=self.lines.append)


def _perturbed(state: dict[str, torch.Tensor], scale: float, *, kv: bool = False) -> dict[str, torch.Tensor]:
    """The base weights with the final norm scaled: every logprob moves, every tensor is still present. The final
    norm acts after the last layer, so the KV stays the same; ``kv``: layer 0's input norm is scaled too, which
    moves every layer's KV (what tells old KV + new weights apart from the new weights alone)."""
    out = dict(state)
    for name in ("model.norm.weight", *(("model.layers.0.input_layernorm.weight",) if kv else ())):
        out[name] = state[name] * scale
    return out


def _forward_logprobs(model, state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 under ``state``: a plain forward pass, nothing shared with the engine."""
    model.load_state_dict(state, strict=False)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return torch.cat([torch.zeros(1, dtype=torch.float64), lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])


def _kept_logprobs(model, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], ids: list[int],
                   split: int) -> torch.Tensor:
    """As :func:`_forward_logprobs`, for a sequence kept running through a weight swap: the KV of ``ids[:split]``
    computed under ``old``, every later position under ``new`` attending to it."""
    model.load_state_dict(old, strict=False)
    with torch.inference_mode():
        first = model(torch.tensor([ids[:split]]), use_cache=True)
    model.load_state_dict(new, strict=False)
    with torch.inference_mode():
        rest = model(torch.tensor([ids[split:]]), cache=first.cache, use_cache=True)
    logits = torch.cat([first.logits[0], rest.logits[0]]).double()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return torch.cat([torch.zeros(1, dtype=torch.float64), lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])


def test_task_pool_cycles_every_task_once_per_epoch_and_is_reproducible():
    tasks = _tasks(5)
    pool = TaskPool(tasks, seed=3)
    first = [t.task_id for k in range(1, 6) for _, t in pool.draw(k, 2)]  # 2 groups per batch
    assert sorted(first[:5]) == sorted(t.task_id for t in tasks)  # epoch 0: each task once
    assert sorted(first[5:10]) == sorted(t.task_id for t in tasks)  # epoch 1: again, reshuffled
    again = TaskPool(tasks, seed=3)  # a restarted service draws batch 3 the same way, without drawing 1 and 2
    assert [t.task_id for _, t in again.draw(4, 2)] == first[6:8]
    assert [g for g, _ in pool.draw(2, 2)] == [2, 3]
    assert min_version(1, 0) == 0 and min_version(5, 1) == 3


def test_recover_keeps_the_sealed_prefix_and_removes_the_rest(tmp_path):
    for k in (1, 2, 3, 5):
        d = layout.step_dir(tmp_path, k)
        (d / "data").mkdir(parents=True)
        (d / "data" / "train-r0-00000.arrow").write_bytes(b"x")
    for k in (1, 2, 5):  # 3 was cut short; 5 sits after the gap
        (layout.step_dir(tmp_path, k) / layout.SEALED).write_text("{}")
    assert recover(tmp_path) == 2
    assert sorted(layout.step_dirs(tmp_path)) == [1, 2]
    assert recover(tmp_path / "nothing-yet") == 0


async def _turns_under_way(h: Harness, settle_s: float) -> None:
    """Until some tokens of running turns are sampled (the embedded engine counts them; any other engine:
    ``settle_s`` after requests are in flight)."""
    stats = getattr(h.engine, "stats", None)
    while not h.driver._in_flight or (stats is not None and stats["decode_tokens"] < 8):
        await asyncio.sleep(0.01)
    if stats is None:
        await asyncio.sleep(settle_s)


def check_mid_turn_update(run_dir: Path, model_path: str, model, base: dict, *, make_engine=None,
                          atol: float, inflight: str = "abort_resume", tokens: int = 24,
                          settle_s: float = 0.5) -> None:
    """abort_resume on ``engine``: a turn stopped by the update keeps its tokens (old version) and goes on under
    the new weights; every sampled token's logprob equals a plain forward pass of ``model`` under the weights of
    the version recorded for it (within ``atol``), and differs from the other version's where a rollout spans.

    ``inflight="keep"``: no turn is stopped; a turn running at the swap goes on under the new weights on the KV the
    old ones computed, each token stamped by the engine (versions non-decreasing within the turn). Its tokens before
    the swap equal the old version's forward pass; those after equal the new weights over that old KV, which no
    single version's forward pass reproduces (v1 then moves the KV too, and that is checked)."""
    keep = inflight == "keep"
    v1 = _perturbed(base, 1.3, kv=keep)
    cfg = _config(tokens, max_steps=2, max_off_policy_steps=1, inflight=inflight)
    # the checkpoint is on disk before the run, without STABLE: it must not be loaded until STABLE appears
    staged = publish_weights(run_dir / "staging", 1, v1, config=_config_of(model))
    target = layout.broadcast_dir(run_dir, 1)
    target.parent.mkdir(parents=True)
    staged.rename(target)
    (target / layout.STABLE).unlink()

    async def trainer(h: Harness) -> None:
        await _turns_under_way(h, settle_s)
        assert h.engine.info().weight_version == 0  # no STABLE yet: never loaded
        (target / layout.STABLE).touch()

    async def main() -> tuple[Harness, int]:
        # the engine is built on the loop that runs it (vLLM's AsyncLLM binds to it)
        h = Harness(cfg, run_dir, model_path, _tasks(2), engine=make_engine() if make_engine else None)
        # one request first, so the run's first turns do not include an engine's first-request warm-up
        await h.engine.generate(GenerateRequest(request_id="warm-up", prompt_ids=[1, 2, 3],
                                                sampling=SamplingParams(max_tokens=2)))
        try:
            sealed, _ = await asyncio.gather(h.follow.run(), trainer(h))
        finally:
            await close_backend(h.engine)
        return h, sealed

    h, sealed = asyncio.run(main())
    assert sealed == 2
    h.service.close()
    rows = [s for k in (1, 2) for s in load_samples(layout.step_dir(run_dir, k))]
    assert len(rows) == 4 and len({s.rollout_id for s in rows}) == 4
    spanning = {s.rollout_id for s in rows if len({int(v) for v in s.weight_versions if v >= 0}) == 2}
    if inflight == "abort_resume":
        assert h.driver.resumed_turns >= 1 and spanning, h.lines
    elif keep:  # the running turns went on in place: nothing stopped, nothing resumed
        assert h.driver.resumed_turns == 0 and spanning, h.lines
    else:  # drain: the running turns finished on the old weights, then new turns started on the new ones
        assert h.driver.resumed_turns == 0 and not spanning
        assert {int(s.meta["weight_version"]) for s in rows} == {0, 1}
    states = {0: base, 1: v1}
    worst = other_gap = 0.0
    kept_gap = float("inf")  # keep: how far the kept tokens after the swap are from v1's plain forward pass
    for s in rows:
        ids = [int(t) for t in s.token_ids]
        versions = [int(v) for v in s.weight_versions]
        assert [v >= 0 for v in versions] == [bool(m) for m in s.loss_mask]  # -1 exactly on context tokens
        assert s.meta["weight_version"] == min(v for v in versions if v >= 0)
        assert s.meta["weight_version_max"] == max(versions)
        # every row under both versions: its own must match, and (where it spans) the other must not
        by_version = {v: _forward_logprobs(model, states[v], ids) for v in (0, 1)}
        want = {v: by_version[v] for v in (0, 1)}
        if keep and s.rollout_id in spanning:
            sampled = [v for v in versions if v >= 0]
            assert sampled == sorted(sampled), versions  # one turn: the old version, then the new one
            # the first new token was sampled at the position of the one before it: fed under the new weights
            want[1] = _kept_logprobs(model, base, v1, ids, versions.index(1) - 1)
            kept_gap = min(kept_gap, max(abs(float(s.logprobs[t]) - float(by_version[1][t]))
                                         for t, v in enumerate(versions) if v == 1))
        for t, v in enumerate(versions):
            if v < 0:
                continue
            worst = max(worst, abs(float(s.logprobs[t]) - float(want[v][t])))
            if s.rollout_id in spanning:
                other_gap = max(other_gap, abs(float(s.logprobs[t]) - float(by_version[1 - v][t])))
    model.load_state_dict(base)
    assert worst <= atol, worst
    if spanning:
        assert other_gap > 1e-2  # the check tells the versions apart: a wrong stamp would fail it
    if keep:  # old KV + new weights: not v1's forward pass either (v0's is excluded by other_gap)
        assert kept_gap > 1e-3, kept_gap
    metrics = [json.loads(line) for line in (run_dir / layout.METRICS).read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # each batch lists the loads in its own window; overlapping batches may both list one (docs/follow.md)
    updates = list({u["version"]: u for m in metrics for u in m["weight_updates"]}.values())
    assert [u["version"] for u in updates] == [1] and metrics[-1]["total_weight_updates"] == 1
    assert (updates[0]["aborted_requests"] >= 1) == (inflight == "abort_resume")  # keep and drain: 0
    manifest = read_manifest(layout.step_dir(run_dir, 2))
    assert manifest["follow"]["step"] == 2 and manifest["follow"]["min_version"] == 0


def test_weights_published_mid_turn_stamp_each_token_with_the_version_that_sampled_it(tmp_path, model_path,
                                                                                      base_state):
    model, base = base_state
    check_mid_turn_update(tmp_path, model_path, model, base, atol=1e-4)


def test_drain_finishes_running_turns_on_the_old_weights(tmp_path, model_path, base_state):
    model, base = base_state
    check_mid_turn_update(tmp_path, model_path, model, base, atol=1e-4, inflight="drain")


def test_without_new_weights_it_seals_s_plus_one_batches_then_waits_idle(tmp_path, model_path, base_state):
    """The trainer publishes nothing (or died): at most max_off_policy_steps + 1 batches, then no request
    reaches the engine and nothing more is written, and the service says what it waits for. New weights
    let it go on; a corrupt checkpoint is refused in one line naming the tensor and changes nothing."""
    model, base = base_state
    cfg = _config(8, max_steps=3, max_off_policy_steps=1)
    h = Harness(cfg, tmp_path, model_path, _tasks(3, "What is 3 + 4?"))

    async def main() -> int:
        run = asyncio.create_task(h.follow.run())
        while h.follow.sealed < 2:
            await asyncio.sleep(0.05)
        steps = h.engine.stats["steps"]
        await asyncio.sleep(1.5)
        assert h.follow.sealed == 2 and not run.done()
        assert h.engine.stats["steps"] == steps and not h.driver._in_flight  # idle: the engine ran nothing
        assert not layout.step_dir(tmp_path, 3).exists()
        assert any("batch 3 needs version >= 1" in line for line in h.lines), h.lines
        # a corrupt checkpoint (NaN in one tensor), published by hand as a broken trainer would
        bad = dict(base)
        bad["model.layers.2.mlp.up_proj.weight"] = base["model.layers.2.mlp.up_proj.weight"].clone()
        bad["model.layers.2.mlp.up_proj.weight"][0, 0] = float("nan")
        d = layout.broadcast_dir(tmp_path, 1)
        d.mkdir(parents=True)
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in bad.items() if k != "lm_head.weight"}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(_config_of(model)))
        (d / layout.STABLE).touch()
        await asyncio.sleep(1.0)
        assert h.engine.info().weight_version == 0 and h.follow.sealed == 2 and not run.done()
        refused = [line for line in h.lines if "refused" in line]
        assert len(refused) == 1 and "model.layers.2.mlp.up_proj.weight" in refused[0], h.lines
        publish_weights(tmp_path, 2, _perturbed(base, 1.1), config=_config_of(model))
        return await asyncio.wait_for(run, 120)

    assert asyncio.run(main()) == 3
    h.service.close()
    assert h.engine.weight_version == 2
    third = read_manifest(layout.step_dir(tmp_path, 3))
    assert third["follow"]["admitted_at_version"] == 2
    assert set(third["follow"]["tokens_per_version"]) == {"2"}


def test_keep_goes_on_in_place_and_stamps_each_token(tmp_path, model_path, base_state):
    """follow.inflight keep on the embedded engine: rollouts span both versions with none aborted or resumed, the
    versions within a turn never go back, the tokens before the swap are v0's forward pass exactly, and those after
    are the new weights over the KV v0 computed: exactly that (within 1e-4), which is neither version's own forward
    pass (checked against v1's; abort_resume is the exact mode)."""
    model, base = base_state
    check_mid_turn_update(tmp_path, model_path, model, base, atol=1e-4, inflight="keep")


def test_keep_is_refused_before_any_work_where_the_engine_cannot_keep(tmp_path, model_path):
    """An engine backend that does not stamp each token's version cannot keep turns running through an update: the
    run stops at once with one line naming the backend and the two modes that work, before any batch directory,
    metrics line or request. Every backend here stamps them (vLLM reads its weight_versions spans back), so the
    driver is told its engines are of a backend outside KEEPS_RUNNING (a replay engine stands in)."""
    import msgspec

    from rollout.engines.replay import ReplayEngine

    engine = ReplayEngine(synthetic=True, vocab_size=49152)
    h = Harness(_config(8, max_steps=1, inflight="keep"), tmp_path, model_path, _tasks(2), engine=engine)
    h.driver.info = msgspec.structs.replace(h.driver.info, backend="sglang")
    with pytest.raises(ValueError, match="the sglang engine backend cannot keep .* abort_resume or drain"):
        asyncio.run(h.follow.run())
    h.service.close()
    assert not (tmp_path / layout.METRICS).exists() and not layout.step_dirs(tmp_path)
