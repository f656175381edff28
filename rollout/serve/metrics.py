"""Prometheus text exposition (format 0.0.4) for the server: counters, gauges and histograms.

Small and dependency-free: the server updates plain Python numbers on its event loop (one thread,
so no locks) and renders them on ``GET /metrics``.
"""

from __future__ import annotations

from collections import defaultdict

from ..engines.protocol import SchedulerStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Histogram:
    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break


class Metrics:
    """Named metrics with label sets. ``inc``/``set``/``observe`` create series on first use."""

    def __init__(self, prefix: str = "tito") -> None:
        self.prefix = prefix
        self.help: dict[str, tuple[str, str]] = {}  # name -> (type, help)
        self.values: dict[str, dict[Labels, float]] = defaultdict(dict)
        self.histograms: dict[str, dict[Labels, Histogram]] = defaultdict(dict)
        self.buckets: dict[str, tuple[float, ...]] = {}

    def counter(self, name: str, help_text: str) -> None:
        self.help[name] = ("counter", help_text)

    def gauge(self, name: str, help_text: str) -> None:
        self.help[name] = ("gauge", help_text)

    def histogram(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.help[name] = ("histogram", help_text)
        self.buckets[name] = buckets

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        series = self.values[name]
        key = tuple(sorted(labels.items()))
        series[key] = series.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        self.values[name][tuple(sorted(labels.items()))] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        series = self.histograms[name]
        h = series.get(key)
        if h is None:
            h = series[key] = Histogram(self.buckets[name])
        h.observe(value)

    def get(self, name: str, **labels: str) -> float:
        return self.values.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        lines: list[str] = []
        for name, (kind, help_text) in self.help.items():
            full = f"{self.prefix}_{name}"
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
            if kind == "histogram":
                for labels, h in self.histograms.get(name, {}).items():
                    running = 0
                    for bound, n in zip(h.buckets, h.counts):
                        running += n
                        lines.append(f"{full}_bucket{_labels(labels + (('le', repr(float(bound))),))} {running}")
                    lines.append(f"{full}_bucket{_labels(labels + (('le', '+Inf'),))} {h.count}")
                    lines.append(f"{full}_sum{_labels(labels)} {h.sum!r}")
                    lines.append(f"{full}_count{_labels(labels)} {h.count}")
            else:
                for labels, value in self.values.get(name, {}).items():
                    lines.append(f"{full}{_labels(labels)} {_number(value)}")
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def server_metrics() -> Metrics:
    """The server's metric set (names without the ``tito_`` prefix)."""
    m = Metrics()
    m.counter("requests_total", "HTTP requests by route and status code")
    m.histogram("request_latency_seconds", "time from request received to response ready, by route")
    m.histogram("engine_seconds", "the engine's own time per request (queue + prefill + decode, as it reports)")
    m.histogram("server_overhead_seconds", "request latency minus the engine's own time (generate routes)")
    m.counter("prompt_tokens_total", "prompt tokens of served requests")
    m.counter("completion_tokens_total", "sampled tokens of served requests")
    m.counter("cached_prompt_tokens_total", "prompt tokens the engine served from its cache (session KV / prefix)")
    m.histogram("completion_tokens", "sampled tokens per request", TOKEN_BUCKETS)
    m.counter("finish_total", "completions by finish reason")
    m.counter("aborts_total", "requests aborted, by cause (client_disconnect, abort_requests, pause)")
    m.counter("client_disconnects_total", "clients that hung up before their answer, by stage: body (before the "
              "request body was in: nothing ran), running (the engine request was aborted; also in aborts_total)")
    m.counter("unknown_sampling_params_total", "sampling_params keys /inference/v1/generate ignored (as vLLM "
              "does: neither server knows them), by key (beyond 64 distinct keys: _other)")
    m.counter("engine_errors_total", "requests failed by an engine or the server (500)")
    m.counter("session_turns_total", "session chat turns, by how the prompt was built (first, bridged, break, retry)")
    m.counter("breaks_total", "session turns that could not be bridged append-only, by reason")
    m.counter("sessions_expired_total", "sessions dropped after their idle timeout")
    m.counter("sessions_ended_total", "sessions ended, by how: header (X-Session-End), delete, expired, "
              "evicted (the least recently used idle ones, over sessions.max_idle_bytes)")
    m.gauge("sessions_active", "sessions held")
    m.gauge("sessions_bytes", "payload bytes the sessions hold (token ids + samples; bounded by max_idle_bytes)")
    m.counter("prefix_cache_resets_total", "POST /reset_prefix_cache calls served")
    m.gauge("sleeping", "1 while the engines are asleep (POST /sleep): weights and KV freed")
    m.gauge("requests_in_flight", "requests running on the engines")
    m.gauge("cache_reuse_ratio", "cached prompt tokens / prompt tokens, over all served requests")
    m.gauge("routing_moves", "sticky sessions moved to another engine because theirs was overloaded")
    m.gauge("engine_load", "requests in flight per engine")
    m.gauge("paused", "1 while generation is paused")
    m.gauge("weight_version", "the weight version of new samples")
    m.gauge("engines_serving", "engines taking requests (a lost one leaves until it is restarted and back)")
    m.gauge("engines_lost_total", "engines lost since start: killed, OOM-killed or hung (rollout/engines/healer.py)")
    m.gauge("engines_restarted_total", "lost engines restarted, brought up to the current weights and back")
    m.histogram("weight_update_seconds", "POST /update_weights: from the call to the engines generating again "
                "(validation + load; requests in flight are kept, not waited for)")
    m.histogram("weight_update_paused_seconds", "POST /update_weights: the time new requests were held (the load)")
    m.histogram("weight_transfer_receive_seconds", "POST /update_weights {update_info}: receiving the announced "
                "tensors over the trainer's group (the engines serve meanwhile)")
    return m


def vllm_families(model_name: str, stats: list[SchedulerStats | None], loads: list[int], held: int = 0) -> str:
    """vLLM's scheduler families, as vLLM's own ``/metrics`` names and labels them (``model_name``, ``engine``),
    one series per engine: what prime-rl's concurrency controller reads (running, waiting and capacity-waiting
    requests, KV cache usage, preemptions, and the KV budget in ``vllm:cache_config_info``'s labels).

    ``stats[i]`` is engine i's scheduler report; an engine without one (the replay engine, a dead or silent one)
    gets its requests in flight as running (``loads[i]``) and no KV series. ``held``: sequences waiting at the
    server for a pause to end, counted as waiting on the first engine (no engine has seen them)."""
    series: dict[str, list[tuple[Labels, float]]] = defaultdict(list)
    for i, (s, load) in enumerate(zip(stats, loads)):
        labels: Labels = (("engine", str(i)), ("model_name", model_name))
        extra = held if i == 0 else 0
        running = s.running if s else load
        waiting = (s.waiting if s else 0) + extra
        # held requests wait for the pause, not for room: deferred
        capacity = (s.waiting if s.waiting_for_capacity is None else s.waiting_for_capacity) if s else 0
        series["num_requests_running"].append((labels, running))
        series["num_requests_waiting"].append((labels, waiting))
        series["num_requests_waiting_by_reason"] += [(labels + (("reason", "capacity"),), capacity),
                                                     (labels + (("reason", "deferred"),), waiting - capacity)]
        if s is None:
            continue
        series["kv_cache_usage_perc"].append((labels, s.kv_cache_usage))
        series["num_preemptions"].append((labels, s.preemptions))
        info = (("block_size", str(s.block_size)), ("engine", str(i)),
                ("kv_cache_size_tokens", str(s.kv_cache_size_tokens)),
                ("num_gpu_blocks", str(s.kv_cache_size_tokens // max(1, s.block_size))))
        series["cache_config_info"].append((info, 1))
    lines: list[str] = []
    for name, kind, help_text in _VLLM_FAMILIES:
        if name not in series:
            continue
        full = f"vllm:{name}_total" if kind == "counter" else f"vllm:{name}"  # as prometheus_client writes one
        lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        lines += [f"{full}{_labels(labels)} {_number(value)}" for labels, value in series[name]]
    return "\n".join(lines) + "\n" if lines else ""


_VLLM_FAMILIES = (
    ("num_requests_running", "gauge", "Number of requests in model execution batches."),
    ("num_requests_waiting", "gauge", "Number of requests waiting to be processed."),
    ("num_requests_waiting_by_reason", "gauge", "Number of waiting requests by reason: 'capacity' = waiting for "
     "scheduling capacity; 'deferred' = deferred by transient constraints."),
    ("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage."),
    ("num_preemptions", "counter", "Cumulative number of preemption from the engine."),
    ("cache_config_info", "gauge", "Information of the LLMCache: its KV budget (num_gpu_blocks x block_size)."),
)
