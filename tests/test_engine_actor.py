"""EngineActor on a real local Ray (2 CPUs): replay engines (num_cpus=0), and one embedded engine on SmolLM2 when
its converted checkpoint is already in the cache (otherwise that test is skipped: converting takes ~30 s)."""

from __future__ import annotations

import os
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import ray  # noqa: E402

from actors.engine import EngineActor, EngineActorImpl, start_engine_actors  # noqa: E402
from rollout.engines.factory import EngineSpec  # noqa: E402
from rollout.engines.protocol import EngineError, GenerateRequest, SamplingParams  # noqa: E402

REPLAY = {"synthetic": True, "vocab_size": 1000, "max_model_len": 4096, "token_delay_s": 0.005}


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=0,
        include_dashboard=False,
        object_store_memory=100 * 2**20,
        namespace="tito-test-engine-actor",
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def replay_actors():
    handles = [e.actor for e in start_engine_actors([{"kind": "replay", "kwargs": REPLAY, "replicas": 2,
                                                      "max_concurrency": 4}])]
    yield handles
    for h in handles:
        ray.kill(h)


def req(rid: str, prompt=(10, 11, 12), **sampling) -> GenerateRequest:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=rid, prompt_ids=list(prompt), sampling=SamplingParams(**sampling))


def test_spec_resources_and_config_validation():
    assert EngineSpec("vllm").resources() == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert EngineSpec("embedded", num_cpus=0.5).resources() == {"num_cpus": 0.5, "num_gpus": 0.0}
    assert EngineSpec("replay").resources()["num_cpus"] == 0.0
    with pytest.raises(ValueError, match="unknown engine config keys.*gpus"):
        EngineSpec.from_config({"kind": "replay", "gpus": 1})
    with pytest.raises(ValueError, match="unknown engine kind"):
        EngineSpec("llamacpp")


def test_info_and_health(replay_actors):
    infos = ray.get([h.info.remote() for h in replay_actors])
    assert [i.backend for i in infos] == ["replay", "replay"] and infos[0].vocab_size == 1000
    health = ray.get(replay_actors[0].health.remote())
    assert health["ok"] is True and health["kind"] == "replay" and health["backend"]["ok"] is True


def test_concurrent_generate_across_actors(replay_actors):
    reqs = [req(f"c{i}", prompt=(10, 11, 12 + i), max_tokens=20) for i in range(8)]
    refs = [replay_actors[i % 2].generate.remote(r) for i, r in enumerate(reqs)]
    outs = ray.get(refs, timeout=30)
    assert [o.request_id for o in outs] == [r.request_id for r in reqs]
    assert all(len(o.results[0].completion_ids) == 20 and o.results[0].finish_reason == "length" for o in outs)
    # greedy + synthetic: the same prompt gives the same ids on either actor
    again = ray.get(replay_actors[1].generate.remote(req("c0-again", prompt=(10, 11, 12), max_tokens=20)))
    assert again.results[0].completion_ids == outs[0].results[0].completion_ids
    peaks = [ray.get(h.health.remote())["peak_in_flight"] for h in replay_actors]
    assert max(peaks) > 1, f"generate calls did not overlap inside an actor (peaks {peaks})"


def test_abort_through_actor_when_generate_slots_are_full(replay_actors):
    actor = replay_actors[0]
    long = [actor.generate.remote(req(f"long{i}", max_tokens=2000, ignore_eos=True)) for i in range(4)]  # 4 = max
    time.sleep(0.3)
    t0 = time.monotonic()
    assert ray.get([actor.abort.remote(f"long{i}") for i in range(4)], timeout=10) == [True] * 4
    outs = ray.get(long, timeout=20)
    assert time.monotonic() - t0 < 8, "abort waited behind the generate calls"
    assert all(o.results[0].finish_reason == "abort" and len(o.results[0].completion_ids) < 2000 for o in outs)
    assert ray.get(actor.abort.remote("nope")) is False
    assert ray.get(actor.generate.remote(req("after-abort"))).results[0].finish_reason == "length"


def test_bad_request_raises_engine_error_on_caller_and_actor_keeps_serving(replay_actors):
    actor = replay_actors[1]
    good = actor.generate.remote(req("good", max_tokens=40))
    with pytest.raises(EngineError, match="bad-vocab.*outside the vocabulary"):
        ray.get(actor.generate.remote(req("bad-vocab", prompt=(1, 5000))))
    with pytest.raises(EngineError, match="max_tokens"):
        ray.get(actor.generate.remote({"request_id": "no-max", "prompt_ids": [1, 2], "sampling": {}}))
    assert ray.get(good).results[0].finish_reason == "length"
    as_dict = {"request_id": "dict", "prompt_ids": [1, 2], "sampling": {"max_tokens": 2}}
    assert len(ray.get(actor.generate.remote(as_dict)).results[0].completion_ids) == 2
    assert ray.get(actor.health.remote())["refused"] >= 2


def test_update_weights_through_actor(replay_actors):
    actor = replay_actors[0]
    ray.get(actor.update_weights.remote("/ckpt/step-3", 3))
    assert ray.get(actor.info.remote()).weight_version == 3
    assert ray.get(actor.generate.remote(req("wv"))).results[0].weight_version == 3


def test_startup_failure_surfaces_and_impl_works_without_ray():
    with pytest.raises(TypeError, match="no_such_arg"):
        start_engine_actors({"kind": "replay", "kwargs": {"no_such_arg": 1}})
    assert EngineActor is not EngineActorImpl and callable(EngineActorImpl("replay").start)


def test_embedded_actor_smollm2():
    from rollout.models import converted_dir
    from tests._support import smollm2_gguf

    gguf = smollm2_gguf()
    if not (converted_dir(gguf) / "config.json").is_file():
        pytest.skip(
            "SmolLM2 is not converted in the cache yet (conversion takes ~30 s; run tests/test_embedded_engine.py)"
        )
    (engine,) = start_engine_actors(
        {"kind": "embedded", "kwargs": {"model": str(gguf), "threads": 1, "max_batch": 4}, "num_cpus": 0.5}
    )
    actor = engine.actor
    try:
        info = ray.get(actor.info.remote())
        assert info.backend == "embedded" and info.vocab_size == 49152
        refs = [
            actor.generate.remote(req(f"e{i}", prompt=(1, 9690, 198 + i), max_tokens=6, ignore_eos=True))
            for i in range(2)
        ]
        outs = ray.get(refs, timeout=60)
        assert all(len(o.results[0].completion_ids) == 6 and o.results[0].logprobs for o in outs)
        with pytest.raises(EngineError, match="empty prompt"):
            ray.get(actor.generate.remote(req("e-bad", prompt=())))
    finally:
        ray.get(actor.close.remote())
        ray.kill(actor)
