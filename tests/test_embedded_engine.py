"""The embedded engine with the real SmolLM2-135M model (fp32, CPU).

One engine and one event loop serve the whole module (loading is the slow part); every test uses small
``max_tokens``. The reference for logprobs is a separately loaded copy of the model run once over
prompt + completion, with no cache. The module ends with the shared conformance suite
(tests/engine_conformance.py) run against a second engine instance.
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
import torch

from rollout.engines.embedded import EmbeddedEngine
from rollout.engines.embedded_kv import SessionKV, SessionStore
from rollout.engines.protocol import EngineBackend, EngineError, GenerateRequest, SamplingParams
from tests._support import smollm2_gguf
from tests.engine_conformance import conformance_tests

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n
#  <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n" in SmolLM2's tokens
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
          8182, 2, 198, 1, 4093, 198, 19161, 2, 198, 1, 520, 9531, 198]
USER_TURN = [2, 198, 1, 4093, 198, 19161, 2, 198, 1, 520, 9531, 198]  # "<|im_end|>\n<|im_start|>user\nHello..."
IM_END = 2


@pytest.fixture(scope="module")
def env():
    """(runner, engine): one engine on one event loop for the module."""
    gguf = smollm2_gguf()
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing")
    runner = asyncio.Runner()
    engine = runner.run(_build(str(gguf)))
    yield runner, engine
    runner.run(engine.close())
    runner.close()


async def _build(model: str) -> EmbeddedEngine:
    return EmbeddedEngine(model, threads=1, max_batch=8)


@pytest.fixture(scope="module")
def reference_model(env):
    from rollout.models import load_causal_lm

    return load_causal_lm(env[1].model_name)


def req(rid: str, prompt=PROMPT, *, session: str | None = None, **sampling) -> GenerateRequest:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(rid, list(prompt), SamplingParams(**sampling), session_id=session)


def gen(env, request: GenerateRequest):
    runner, engine = env
    return runner.run(engine.generate(request))


def gather(env, *requests: GenerateRequest):
    runner, engine = env

    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return runner.run(go())


def reference_logprobs(model, prompt: list[int], completion: list[int], transform=lambda x: x) -> list[float]:
    """Logprobs of ``completion`` from one uncached forward pass over prompt + completion."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    logp = torch.log_softmax(transform(rows), dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(completion)]


def test_protocol_and_info(env):
    engine = env[1]
    assert isinstance(engine, EngineBackend)
    info = engine.info()
    assert (info.backend, info.vocab_size, info.max_model_len, info.eos_token_ids) == ("embedded", 49152, 8192, [2])


def test_greedy_logprobs_match_full_forward(env, reference_model):
    r = gen(env, req("lp-greedy", max_tokens=12, ignore_eos=True)).results[0]
    assert r.finish_reason == "length" and len(r.completion_ids) == 12
    want = reference_logprobs(reference_model, PROMPT, r.completion_ids)
    assert max(abs(a - b) for a, b in zip(r.logprobs, want)) <= 1e-4
    # greedy: every sampled token is the argmax of the reference distribution
    with torch.inference_mode():
        logits = reference_model(torch.tensor([PROMPT + r.completion_ids])).logits[0]
    assert logits[len(PROMPT) - 1 : -1].argmax(-1).tolist() == r.completion_ids


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 40, 1.0), (1.0, 0, 0.8)])
def test_sampled_logprobs_are_those_of_the_processed_distribution(env, reference_model, temperature, top_k, top_p):
    r = gen(env, req(f"lp-{temperature}-{top_k}-{top_p}", max_tokens=10, temperature=temperature, top_k=top_k,
                     top_p=top_p, seed=5, ignore_eos=True)).results[0]

    def processed(x: torch.Tensor) -> torch.Tensor:
        x = x / temperature
        if top_k:
            kth = x.topk(top_k, dim=-1).values[:, -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if top_p < 1:
            sorted_x, order = x.sort(dim=-1, descending=True)
            probs = sorted_x.softmax(-1)
            drop = probs.cumsum(-1) - probs >= top_p
            drop[:, 0] = False
            x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x.masked_fill(drop, float("-inf")))
        return x

    want = reference_logprobs(reference_model, PROMPT, r.completion_ids, processed)
    assert all(w > float("-inf") for w in want), "a sampled token lies outside the filtered distribution"
    assert max(abs(a - b) for a, b in zip(r.logprobs, want)) <= 1e-4


def test_greedy_is_deterministic(env):
    a = gen(env, req("det-a", max_tokens=10, ignore_eos=True)).results[0]
    b = gen(env, req("det-b", max_tokens=10, ignore_eos=True)).results[0]
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs


def test_seeded_sampling_reproduces(env):
    def run(rid, seed):
        return gen(env, req(rid, max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)).results[0].completion_ids

    first = run("seed-a", 1234)
    assert run("seed-b", 1234) == first
    # the same seed also reproduces inside a batch of other requests
    out = gather(env, req("seed-c", max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True),
                 req("seed-noise", PROMPT[:20], max_tokens=12, temperature=1.0, ignore_eos=True))
    assert out[0].results[0].completion_ids == first
    assert any(run(f"seed-other-{s}", s) != first for s in (1, 2))


def test_batch_composition_does_not_change_greedy(env):
    alone = gen(env, req("bc-alone", max_tokens=10, ignore_eos=True)).results[0]
    others = [req(f"bc-other-{i}", PROMPT[: 8 + 5 * i], max_tokens=4 + 3 * i, ignore_eos=True) for i in range(3)]
    outs = gather(env, others[0], req("bc-batched", max_tokens=10, ignore_eos=True), *others[1:])
    batched = outs[1].results[0]
    assert batched.completion_ids == alone.completion_ids
    assert max(abs(a - b) for a, b in zip(batched.logprobs, alone.logprobs)) <= 1e-4


def test_scores_do_not_depend_on_the_batch(env):
    """prompt_logprobs and top_logprobs of requests admitted in one packed step, between a plain request and
    one that asks for both, equal the same requests run alone (the packed forward keeps every position of a
    scored prompt and the last position of the others: the indices must not shift)."""
    plain = req("b-plain", PROMPT[:20], max_tokens=4)
    scored = req("b-scored", PROMPT, max_tokens=4, prompt_logprobs=2, top_logprobs=3)
    tail = req("b-tail", USER_TURN, max_tokens=4, top_logprobs=2, prompt_logprobs=1)
    together = gather(env, plain, scored, tail)
    alone = [gen(env, msgspec.structs.replace(r, request_id=r.request_id + "-alone")) for r in (plain, scored, tail)]
    for a, b in zip(together, alone):
        assert a.results[0].completion_ids == b.results[0].completion_ids
        for x, y in zip(a.results[0].top_logprobs or [], b.results[0].top_logprobs or []):
            assert x.top_ids == y.top_ids and x.rank == y.rank and abs(x.logprob - y.logprob) < 1e-4
        if b.prompt_logprobs is not None:
            assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(b.prompt_logprobs)
            for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert x.top_ids == y.top_ids and x.rank == y.rank
                assert max(abs(p - q) for p, q in zip([x.logprob, *x.top_logprobs], [y.logprob, *y.top_logprobs])) < 1e-4
    assert together[0].prompt_logprobs is None and together[0].results[0].top_logprobs is None


def test_short_request_overtakes_long_one(env):
    runner, engine = env
    finished: list[str] = []

    async def go():
        async def one(r):
            out = await engine.generate(r)
            finished.append(r.request_id)
            return out

        long = asyncio.create_task(one(req("long", max_tokens=40, ignore_eos=True)))
        await asyncio.sleep(0.3)  # the long request is decoding by now
        short = asyncio.create_task(one(req("short", PROMPT[:12], max_tokens=3, ignore_eos=True)))
        return await long, await short

    long_out, short_out = runner.run(go())
    assert finished == ["short", "long"]
    assert len(long_out.results[0].completion_ids) == 40 and len(short_out.results[0].completion_ids) == 3
    assert short_out.results[0].timings.queue_s < 1.0  # it joined the running batch, not the end of a queue


def test_session_reuse_prefills_only_new_tokens(env):
    engine = env[1]
    t1 = gen(env, req("s-1", session="sess-a", max_tokens=12, stop_token_ids=(IM_END,))).results[0]
    assert t1.cached_prompt_tokens == 0
    prompt2 = PROMPT + t1.completion_ids + ([] if t1.completion_ids[-1] == IM_END else [IM_END]) + USER_TURN[1:]
    before = engine.stats["prefill_tokens"]
    t2 = gen(env, req("s-2", prompt2, session="sess-a", max_tokens=8, ignore_eos=True)).results[0]
    assert t2.cached_prompt_tokens == len(PROMPT) + len(t1.completion_ids)
    assert engine.stats["prefill_tokens"] - before == len(prompt2) - t2.cached_prompt_tokens
    cold = gen(env, req("s-cold", prompt2, max_tokens=8, ignore_eos=True)).results[0]
    assert cold.cached_prompt_tokens == 0
    assert t2.completion_ids == cold.completion_ids
    assert max(abs(a - b) for a, b in zip(t2.logprobs, cold.logprobs)) <= 1e-4
    # a prompt that does not extend the session's tokens is prefilled in full
    t3 = gen(env, req("s-3", PROMPT[:10] + [4093], session="sess-a", max_tokens=2)).results[0]
    assert t3.cached_prompt_tokens == 0


def test_session_store_lru_respects_byte_bound(env):
    engine = env[1]
    bound = engine.kv.token_bytes * 70  # room for two ~35-token sessions, not three
    saved, engine.sessions.max_bytes = engine.sessions.max_bytes, bound
    try:
        for i in range(3):
            gen(env, req(f"lru-{i}", PROMPT, session=f"lru-{i}", max_tokens=2, ignore_eos=True))
            env[0].run(engine.wait_idle())
            assert engine.sessions.nbytes <= bound
        assert "lru-0" not in engine.sessions and "lru-2" in engine.sessions
        again = gen(env, req("lru-0b", PROMPT + [198], session="lru-0", max_tokens=2)).results[0]
        assert again.cached_prompt_tokens == 0  # evicted
    finally:
        engine.sessions.max_bytes = saved


def test_session_store_unit():
    store = SessionStore(max_bytes=3 * 4 * 10)
    kv = lambda n: SessionKV(list(range(n)), torch.zeros(1, 1, 1, n, 3))  # noqa: E731  (12 bytes a token)
    store.put("a", kv(4))
    store.put("b", kv(4))
    store.put("a", kv(5))  # replacing an entry frees the old one first
    assert store.nbytes == 12 * 9 and len(store) == 2
    store.put("c", kv(3))  # evicts b, the least recently stored
    assert "b" not in store and "a" in store and store.nbytes <= 120
    store.put("huge", kv(11))  # larger than the whole bound: not kept, nothing evicted for it
    assert "huge" not in store and "a" in store
    assert store.take("a").token_ids == list(range(5)) and "a" not in store


def test_abort_mid_generation_and_keep_serving(env):
    runner, engine = env

    async def go():
        task = asyncio.create_task(engine.generate(req("ab", max_tokens=500, ignore_eos=True)))
        await asyncio.sleep(0.5)
        assert await engine.abort("ab") is True
        out = await asyncio.wait_for(task, 30)
        assert await engine.abort("ab") is False
        return out

    r = runner.run(go()).results[0]
    assert r.finish_reason == "abort" and 0 < len(r.completion_ids) < 500 and len(r.logprobs) == len(r.completion_ids)
    assert gen(env, req("after-abort", max_tokens=3, ignore_eos=True)).results[0].finish_reason == "length"


def test_cancelling_the_caller_aborts(env):
    runner, engine = env

    async def go():
        task = asyncio.create_task(engine.generate(req("cancel-me", max_tokens=500, ignore_eos=True)))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if not engine._running:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the cancelled request kept decoding")

    runner.run(go())


def test_stop_token_ends_and_is_included(env):
    free = gen(env, req("stop-free", max_tokens=12, ignore_eos=True)).results[0].completion_ids
    stop = free[5]
    r = gen(env, req("stop", max_tokens=12, stop_token_ids=(stop, 49151))).results[0]
    first = free.index(stop)
    assert r.finish_reason == "stop" and r.stop_token_id == stop
    assert r.completion_ids == free[: first + 1] and len(r.logprobs) == first + 1
    # ignore_eos samples through stop ids
    r2 = gen(env, req("stop-ignored", max_tokens=12, stop_token_ids=(stop,), ignore_eos=True)).results[0]
    assert r2.completion_ids == free and r2.finish_reason == "length" and r2.stop_token_id is None


def test_n_completions_share_the_prompt(env):
    out = gen(env, req("n4", max_tokens=6, temperature=1.0, seed=7, n=4, ignore_eos=True))
    ids = [r.completion_ids for r in out.results]
    assert len(ids) == 4 and all(len(x) == 6 for x in ids) and len({tuple(x) for x in ids}) > 1
    single = gen(env, req("n1-seed9", max_tokens=6, temperature=1.0, seed=9, ignore_eos=True)).results[0]
    assert ids[2] == single.completion_ids  # completion i of a seeded request uses seed + i


def test_bad_input_raises_and_engine_keeps_serving(env):
    runner, engine = env

    async def go():
        good = asyncio.create_task(engine.generate(req("good", max_tokens=6, ignore_eos=True)))
        await asyncio.sleep(0)
        for bad, word in [(req("empty", []), "empty"), (req("oov", PROMPT + [49152]), "vocab"),
                          (req("long", max_tokens=8192), "max_model_len"), (req("n-big", n=9), "max_batch")]:
            with pytest.raises(EngineError, match=word):
                await engine.generate(bad)
        return await good

    assert len(runner.run(go()).results[0].completion_ids) == 6


def test_internal_error_fails_only_that_request(env):
    """A fault inside one request's prefill (injected by wrapping the engine's own method) gives that
    request finish_reason "error" with the message; a concurrent request completes."""
    runner, engine = env
    original = engine._admit

    def faulty(r):
        if r.request.request_id == "boom":
            raise RuntimeError("injected fault")
        return original(r)

    engine._admit = faulty
    try:
        boom, ok = gather(env, req("boom", max_tokens=4), req("fine", max_tokens=4, ignore_eos=True))
    finally:
        del engine._admit
    assert boom.results[0].finish_reason == "error" and "injected fault" in boom.results[0].error
    assert ok.results[0].finish_reason == "length" and len(ok.results[0].completion_ids) == 4
    assert not engine._running or all(s.req.request.request_id != "boom" for s in engine._running)


def test_update_weights_stamps_version_and_drops_session_kv(env, tmp_path):
    from rollout.follow.publish import publish_weights

    runner, engine = env
    # other weights (the served ones would be seen as such, and cost no reload: tests/test_lora.py)
    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"] * 1.01
    ckpt = publish_weights(tmp_path, 1, state, config=engine.model.config.to_dict())
    gen(env, req("uw-1", session="uw", max_tokens=2))
    runner.run(engine.wait_idle())
    assert "uw" in engine.sessions
    v = engine.info().weight_version + 1
    t0 = time.perf_counter()
    runner.run(engine.update_weights(str(ckpt), v))
    assert time.perf_counter() - t0 < 30
    assert engine.info().weight_version == v and "uw" not in engine.sessions
    r = gen(env, req("uw-2", max_tokens=2)).results[0]
    assert r.weight_version == v
    with pytest.raises(EngineError, match="update_weights"):
        runner.run(engine.update_weights("/nonexistent/checkpoint", v + 1))
    assert engine.info().weight_version == v


def test_more_requests_than_rows_queue_and_all_finish(env):
    engine = env[1]
    reqs = [req(f"q-{i}", PROMPT[: 6 + i], max_tokens=2 + i % 3, ignore_eos=True) for i in range(engine.max_batch + 3)]
    outs = gather(env, *reqs)
    assert [len(o.results[0].completion_ids) for o in outs] == [2 + i % 3 for i in range(len(reqs))]


def test_scheduler_stats_count_rows_queue_and_kv_as_vllm_reports_them(env):
    runner, engine = env
    cap = engine.max_batch * engine.info().max_model_len

    async def go():
        idle = engine.scheduler_stats()
        first = asyncio.create_task(engine.generate(req("st-a", max_tokens=300, ignore_eos=True, n=6, temperature=1.0)))
        while not engine._running:
            await asyncio.sleep(0.01)
        # 6 rows run; 3 more cannot fit the 8 rows, and 2 behind them wait in order
        rest = [asyncio.create_task(engine.generate(req(rid, max_tokens=300, ignore_eos=True, n=n, temperature=1.0)))
                for rid, n in (("st-b", 3), ("st-c", 2))]
        await asyncio.sleep(0.3)
        busy = engine.scheduler_stats()
        held = sum(s.fed for s in engine._running)
        for rid in ("st-a", "st-b", "st-c"):
            await engine.abort(rid)
        await asyncio.gather(first, *rest)
        return idle, busy, held, engine.scheduler_stats()

    idle, busy, held, after = runner.run(go())
    assert (idle.running, idle.waiting, idle.kv_cache_usage, idle.kv_cache_size_tokens) == (0, 0, 0.0, cap)
    assert (busy.running, busy.waiting, busy.waiting_for_capacity, busy.preemptions) == (6, 5, 5, 0)
    assert busy.kv_cache_usage > 0 and busy.kv_cache_usage == pytest.approx(held / cap, abs=6 * 20 / cap)
    assert (after.running, after.waiting, after.kv_cache_usage) == (0, 0, 0.0)


def test_update_weights_waits_for_running_requests(env):
    from rollout.models import converted_dir

    runner, engine = env
    v = engine.info().weight_version + 1

    async def go():
        running = asyncio.create_task(engine.generate(req("uw-running", max_tokens=12, ignore_eos=True)))
        await asyncio.sleep(0.3)
        await engine.update_weights(str(converted_dir(smollm2_gguf())), v)
        assert running.done()  # the swap happened only after it finished
        return await running

    out = runner.run(go())
    assert out.results[0].weight_version == v - 1 and len(out.results[0].completion_ids) == 12
    assert gen(env, req("uw-next", max_tokens=1)).results[0].weight_version == v


def _mixed_logprobs(model, old: dict, new: dict, ids: list[int], split: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= split + 1 with the KV of ``ids[:split]`` computed under ``old`` and every
    later position under ``new``: what a sequence kept running through a weight swap is sampled from."""
    model.load_state_dict(old)
    with torch.inference_mode():
        first = model(torch.tensor([ids[:split]]), use_cache=True)
    model.load_state_dict(new)
    with torch.inference_mode():
        rest = model(torch.tensor([ids[split:]]), cache=first.cache, use_cache=True)
    logp = torch.log_softmax(rest.logits[0, :-1].float(), dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(ids[split + 1:])]


def test_keep_running_update_goes_on_under_the_new_weights_on_the_old_kv(env, reference_model, tmp_path):
    """update_weights(keep_running=True) while a greedy request decodes: the swap happens between two steps, the
    request is not aborted and finishes its budget; its tokens before the swap are stamped v and are exactly v's
    forward pass, those after are stamped v + 1 and are exactly the new weights attending to the KV the old ones
    computed (no plain forward of either version gives them: that is what keep means in prime-rl and SkyRL). A
    request admitted after the swap is v + 1's forward pass alone. The kept request's KV mixes versions: it is not
    stored for its session's next turn, while the new request's is."""
    from rollout.follow.publish import publish_weights
    from rollout.models import converted_dir

    runner, engine = env
    base = {k: t.detach().clone() for k, t in reference_model.state_dict().items()}
    new = dict(base)
    # layer 0's input norm moves every layer's KV (the final norm alone moves only the logits, so old KV + new
    # weights would equal the new forward pass); the final norm makes the two versions' logprobs far apart
    for name in ("model.layers.0.input_layernorm.weight", "model.norm.weight"):
        new[name] = base[name] * 1.3
    config = reference_model.config.to_dict()
    config.pop("quantization_config", None)
    path = str(publish_weights(tmp_path, 1, new, config=config))
    v = engine.info().weight_version
    runner.run(engine.validate_weights(path))  # checked before: the update below only loads

    async def go():
        start = engine.stats["decode_tokens"]
        running = asyncio.create_task(engine.generate(req("keep-a", session="keep-a", max_tokens=48, ignore_eos=True)))
        while engine.stats["decode_tokens"] - start < 6:
            await asyncio.sleep(0.005)
        await engine.update_weights(path, v + 1, keep_running=True)
        assert not running.done()  # swapped under it, not after it
        fresh = await engine.generate(req("keep-b", session="keep-b", max_tokens=8, ignore_eos=True))
        kept = await running
        await engine.wait_idle()
        return kept.results[0], fresh.results[0]

    try:
        kept, fresh = runner.run(go())
        assert kept.finish_reason == "length" and len(kept.completion_ids) == 48
        versions = kept.token_versions
        k = versions.count(v)
        assert versions == [v] * k + [v + 1] * (48 - k) and 6 <= k < 48, versions
        assert kept.weight_version == v  # the lowest
        assert fresh.token_versions is None and fresh.weight_version == v + 1
        before = reference_logprobs(reference_model, PROMPT, kept.completion_ids)
        assert max(abs(a - b) for a, b in zip(kept.logprobs[:k], before[:k])) <= 1e-4
        ids = PROMPT + kept.completion_ids
        # token k is sampled from the logits at the position of token k - 1, the first fed under the new weights
        mixed = _mixed_logprobs(reference_model, base, new, ids, len(PROMPT) + k - 1)
        assert max(abs(a - b) for a, b in zip(kept.logprobs[k:], mixed)) <= 1e-4
        # reference_model holds the new weights now
        plain_new = reference_logprobs(reference_model, PROMPT, kept.completion_ids)[k:]
        assert max(abs(a - b) for a, b in zip(kept.logprobs[k:], plain_new)) > 1e-3  # old KV: not v + 1's forward
        assert max(abs(a - b) for a, b in zip(kept.logprobs[k:], before[k:])) > 1e-2  # nor v's
        want = reference_logprobs(reference_model, PROMPT, fresh.completion_ids)
        assert max(abs(a - b) for a, b in zip(fresh.logprobs, want)) <= 1e-4
        # sessions: the kept request's mixed KV was not stored; the fresh one's was
        assert "keep-a" not in engine.sessions and "keep-b" in engine.sessions
        follow_up = lambda r: PROMPT + r.completion_ids + [IM_END] + USER_TURN[1:]  # noqa: E731
        assert gen(env, req("keep-a2", follow_up(kept), session="keep-a", max_tokens=2)).results[0] \
            .cached_prompt_tokens == 0
        assert gen(env, req("keep-b2", follow_up(fresh), session="keep-b", max_tokens=2)).results[0] \
            .cached_prompt_tokens == len(PROMPT) + 8
    finally:
        reference_model.load_state_dict(base)
        runner.run(engine.update_weights(str(converted_dir(smollm2_gguf())), v + 2))  # the base weights again


def test_cli_pull_reports_an_available_model(capsys):
    from rollout.cli.main import main
    from rollout.models import ModelNotFound, resolve_model

    try:
        resolve_model("smollm2-135m")
    except ModelNotFound:
        pytest.skip("smollm2-135m is not available locally (the test must not download it)")

    assert main(["pull", "smollm2-135m"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out
    assert main(["pull", "no-such-model"]) == 2


def test_resolve_model_finds_pulled_file(tmp_path, monkeypatch):
    import rollout.models as models

    monkeypatch.setenv("TITO_CACHE", str(tmp_path))
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)  # as if the package were absent
    with pytest.raises(models.ModelNotFound, match="tito pull smollm2-135m"):
        models.resolve_model("smollm2-135m")
    (tmp_path / "models").mkdir()
    target = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    target.write_bytes(b"GGUF")
    assert models.resolve_model("smollm2-135m") == target
    assert models.pull_model("smollm2-135m") == target  # present: nothing is downloaded


def _make_conformance_engine():
    gguf = smollm2_gguf()
    if not gguf.is_file():
        pytest.skip(f"{gguf} is missing")
    return EmbeddedEngine(str(gguf), threads=1, max_batch=8)


def _weights_path() -> str | None:
    try:
        from rollout.models import converted_dir

        return str(converted_dir(smollm2_gguf()))
    except Exception:  # fixture absent: the conformance engine skips anyway
        return None


TestEmbeddedConformance = conformance_tests(_make_conformance_engine, weights_path=_weights_path())
