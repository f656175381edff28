"""The ``vllm:`` families of tito's ``/metrics``, read the way prime-rl's orchestrator reads them (prometheus_client's
parser, then prime-rl 559b447's per-engine selection: tests/_support.py ``prime_rl_load``): its concurrency
controller grows episodes in flight only from these values. The engines' own counts are tested with each backend
(tests/test_embedded_engine.py, tests/test_vllm_serve.py); the running servers in tests/test_serve.py and
tests/test_serve_embedded.py."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from rollout.engines.protocol import SchedulerStats
from rollout.serve.metrics import server_metrics, vllm_families

from ._support import prime_rl_load


def test_each_engine_gets_vllms_names_labels_and_kv_budget():
    busy = SchedulerStats(running=3, waiting=4, kv_cache_usage=0.25, kv_cache_size_tokens=16384, block_size=16,
                          preemptions=2, waiting_for_capacity=1)
    text = server_metrics().render() + vllm_families("policy", [busy, None], loads=[5, 2], held=2)
    load = prime_rl_load(text)
    assert load["0"] == {"kv_capacity_tokens": 16384, "kv_usage": 0.25, "running": 3, "waiting": 6,
                         "waiting_capacity": 1.0, "preemptions": 2.0}
    # an engine that reports no scheduler (replay): its requests in flight run, no KV budget is claimed
    assert load["1"] == {"kv_capacity_tokens": None, "kv_usage": 0.0, "running": 2, "waiting": 0,
                         "waiting_capacity": 0.0, "preemptions": None}
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vllm:num_preemptions"].type == "counter"
    assert families["vllm:num_preemptions"].samples[0].name == "vllm:num_preemptions_total"
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"engine": "0", "model_name": "policy"}
    info = families["vllm:cache_config_info"].samples[0].labels
    assert int(info["num_gpu_blocks"]) * int(info["block_size"]) == 16384  # what an older prime-rl multiplies
    reasons = {s.labels["reason"]: s.value for s in families["vllm:num_requests_waiting_by_reason"].samples
               if s.labels["engine"] == "0"}
    assert reasons == {"capacity": 1, "deferred": 5}  # sums to waiting, as vLLM's do; held ones are deferred


def test_no_engine_report_still_parses():
    assert prime_rl_load(vllm_families("m", [None], loads=[0]))["0"]["kv_capacity_tokens"] is None
