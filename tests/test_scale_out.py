"""A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): a head without CPUs where the
driver runs, a renderer node offering the custom resource ``renderer_node``, and per test two engine nodes
with one CPU each. Replay engines in synthetic mode (fast, deterministic).

* Placement: engines spread one per node (``engine.placement: spread``, the default), the renderer actor on
  the node its ``renderer.resources`` name, not the driver's; the shards land in ``output.dir``.
* Output on a cluster: the renderer actors write the shards, so ``output.dir`` must be shared storage; a
  renderer that cannot read the driver's probe file there is refused before the run starts.
* A node holding an engine removed mid-run: the run completes, every rollout exactly once in the shards,
  and the summary counts the re-runs.
* ``tito serve`` on the cluster: an engine's node removed, requests keep succeeding on the other engine and
  /health stays 200 ("degraded") while one engine lives.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from actors.placement import RayPlacement  # noqa: E402
from actors.renderer import NotSharedStorage, PlacedRendererService, check_shared_storage  # noqa: E402
from rollout.cli.run import run  # noqa: E402
from rollout.config import ServeConfig, load_config  # noqa: E402
from rollout.data.shards import read_table  # noqa: E402

from ._support import http_call, tokenizer_dir  # noqa: E402

RAY = RayPlacement()

VOCAB = 151665
STORE = 80 * 2**20  # object store per node: the cluster shares this machine's memory with others


@pytest.fixture(scope="module")
def cluster():
    import shutil
    import tempfile

    from ray.cluster_utils import Cluster

    # Ray keeps its sessions and the machine-wide "current cluster" address file under RAY_TMPDIR: a private
    # one, so this cluster never overwrites or deletes /tmp/ray/ray_current_cluster of another run on the
    # machine. Short, because Ray's Unix socket paths below it must stay under 107 characters.
    ray_tmp = tempfile.mkdtemp(prefix="tito-ray-", dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = ray_tmp
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "object_store_memory": STORE})
    try:
        c.renderer_node = c.add_node(num_cpus=0, resources={"renderer_node": 1}, object_store_memory=STORE)
        ray.init(address=c.address, namespace="tito-test-scale-out", log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture
def engine_nodes(cluster):
    """Two nodes with one CPU each (the only CPUs in the cluster, so engines land there); removed after."""
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=STORE) for _ in range(2)]
    cluster.wait_for_nodes()
    yield nodes
    for node in nodes:
        if node in cluster.worker_nodes:
            cluster.remove_node(node)


def _settings(tmp_path, token_delay_s: float) -> list[str]:
    return [
        f"model={tokenizer_dir('qwen2.5-7b-instruct')}", "engine.backend=replay", "engine.count=2",
        "engine.num_cpus=0.25", f"engine.options={{synthetic: true, vocab_size: {VOCAB}, max_model_len: 4096, "
                                f"token_delay_s: {token_delay_s}}}",
        "renderer.num_cpus=0", "renderer.resources={renderer_node: 0.5}",
        f"output.dir={tmp_path / 'out'}",
    ]


def _run_config(tmp_path, cluster, token_delay_s: float, tasks: int, **over):
    sets = _settings(tmp_path, token_delay_s) + [
        "env.name=try_again", f"tasks.count={tasks}", "group_size=2", "max_turns=3", "max_tokens_per_turn=16",
        "max_tokens_per_rollout=48", "sampling.seed=5", f"ray.address={cluster.address}",
    ]
    return load_config(None, sets + [f"{k}={v}" for k, v in over.items()])


def _first_segments(out_dir: Path) -> list[str]:
    ids = []
    for path in sorted(out_dir.glob("data/train-*")):
        rows = read_table(path, columns=["rollout_id", "segment_index"]).to_pylist()
        ids += [r["rollout_id"] for r in rows if r["segment_index"] == 0]
    return ids


def _expected_ids(tasks: int, group: int) -> set[str]:
    from rollout.envs import make_env

    return {f"{t.task_id}#{k}" for t in make_env("try_again").generate_tasks(tasks, 0) for k in range(group)}


def test_engines_spread_renderer_on_its_node_and_shards_in_the_output_dir(cluster, engine_nodes, tmp_path):
    from actors.engine import start_engine_actors
    from actors.renderer import start_renderer_actors
    from rollout.startup import engine_specs

    cfg = _run_config(tmp_path, cluster, 0.001, tasks=3)
    driver_node = ray.get_runtime_context().get_node_id()
    engines = start_engine_actors(engine_specs(cfg.engine, cfg.model))
    renderers = start_renderer_actors(1, cfg.model, num_cpus=cfg.renderer.num_cpus,
                                      resources=dict(cfg.renderer.resources), out_dir=str(tmp_path / "probe"))
    try:
        engine_at = [ray.get(e.actor.health.remote())["node_id"] for e in engines]
        renderer_at = ray.get(renderers[0].actor.node_id.remote())
    finally:
        for handle in engines + renderers:
            ray.kill(handle.actor)
    assert sorted(engine_at) == sorted(n.node_id for n in engine_nodes)  # one engine per engine node
    assert renderer_at == cluster.renderer_node.node_id != driver_node
    assert not list((tmp_path / "probe").glob(".tito-shared-probe-*"))  # the probe is removed after the check

    # the whole run with that placement: every rollout once, in output.dir (this machine's disk is the
    # "shared storage" the renderer node writes to)
    summary = run(cfg, RAY, progress=False)
    firsts = _first_segments(tmp_path / "out")
    assert summary["rollouts"] == 6 and summary["errors"] == 0
    assert sorted(firsts) == sorted(_expected_ids(3, 2))


@ray.remote(num_cpus=0)
class _OtherMount(PlacedRendererService):
    """A renderer on a node where the output path is another directory (a node-local disk, not the shared
    storage): it reads the probe's path under its own root."""

    def reads_probe(self, path: str, token: str) -> bool:
        return super().reads_probe(str(Path(self.root) / Path(path).relative_to("/")), token)

    def __init__(self, model_path: str, root: str) -> None:
        super().__init__(model_path)
        self.root = root


def test_output_dir_not_shared_with_a_renderer_node_is_refused(cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    actor = _OtherMount.options(resources={"renderer_node": 0.5}).remote(
        str(tokenizer_dir("qwen2.5-7b-instruct")), str(tmp_path / "node-local"))
    try:
        with pytest.raises(NotSharedStorage, match=f"output dir {out} is not shared.*{cluster.renderer_node.node_id}"):
            check_shared_storage([actor], str(out))
    finally:
        ray.kill(actor)
    assert not list(out.iterdir())  # nothing left behind by the refused check


def test_node_removed_mid_run_loses_and_duplicates_no_rollout(cluster, engine_nodes, tmp_path):
    tasks = 8
    # slow tokens and a 1 s flush: rollouts are still running on both engines when the first file appears
    cfg = _run_config(tmp_path, cluster, 0.05, tasks=tasks, **{"max_concurrent_rollouts": 4,
                                                               "output.flush_interval_s": 0.5})
    result: dict = {}

    def target() -> None:
        try:
            result["summary"] = run(cfg, RAY, progress=False)
        except BaseException as exc:  # handed to the test thread below
            result["error"] = exc

    job = threading.Thread(target=target)
    t0 = time.monotonic()
    job.start()
    while not list((tmp_path / "out").glob("data/train-*")):
        assert job.is_alive() and time.monotonic() - t0 < 300, result
        time.sleep(0.1)
    cluster.remove_node(engine_nodes[0])
    removed_at = time.monotonic() - t0
    job.join(timeout=600)
    assert not job.is_alive() and "error" not in result, result.get("error")
    summary = result["summary"]
    firsts = _first_segments(tmp_path / "out")
    print(f"node removed at {removed_at:.1f} s; run took {time.monotonic() - t0:.1f} s; "
          f"reruns {summary['this_run']['reruns_after_engine_death']}")
    assert len(firsts) == len(set(firsts)) == tasks * 2  # each rollout exactly once
    assert set(firsts) == _expected_ids(tasks, 2)
    assert summary["rollouts"] == tasks * 2 and summary["errors"] == 0
    assert summary["this_run"]["reruns_after_engine_death"] > 0  # rollouts on the removed node were re-run


def test_serve_keeps_serving_when_an_engine_node_is_removed(cluster, engine_nodes, tmp_path):
    from rollout.serve.launch import ServerThread, build_state

    cfg = load_config(None, _settings(tmp_path, 0.01)[:-1] + [f"ray.address={cluster.address}"], schema=ServeConfig)
    state, actors = build_state(cfg, RAY)
    srv = ServerThread(state).start()
    try:
        status, health = http_call(srv.url + "/health")
        assert status == 200 and health["status"] == "ok"
        # sequential requests on idle engines go to engine 0 (the least loaded, first): remove its node
        victim = next(n for n in engine_nodes if n.node_id == health["engines"][0]["node_id"])
        gen = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
        assert http_call(srv.url + "/inference/v1/generate", "POST", gen)[0] == 200
        cluster.remove_node(victim)
        codes = [http_call(srv.url + "/inference/v1/generate", "POST", dict(gen, token_ids=[1, 2, i]), timeout=120)[0]
                 for i in range(6)]
        assert codes == [200] * 6, codes
        # engine 0 was lost with its node, its request re-sent to engine 1, and the healer restarted it on a node
        # that is still there (the cluster's head) and routes to it again
        healer = state.fleet.healer
        assert state.fleet.reroutes >= 1 and healer.lost_total >= 1
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (state.fleet.dead or healer.restarted_total < 1):
            time.sleep(0.5)
        assert not state.fleet.dead and healer.restarted_total >= 1, (state.fleet.dead, healer.events)
        status, health = http_call(srv.url + "/health", timeout=60)
        assert status == 200 and health["status"] == "ok", health
        assert [e["ok"] for e in health["engines"]] == [True, True]
        assert health["engines"][0]["node_id"] != victim.node_id
        assert http_call(srv.url + "/inference/v1/generate", "POST", gen, timeout=120)[0] == 200
    finally:
        srv.stop()
        for handle in actors:
            try:
                ray.kill(handle.actor)
            except Exception:
                pass
