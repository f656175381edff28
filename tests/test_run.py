"""Runs on a real local Ray: the run writes readable shards once per rollout, an engine killed
mid-run loses and duplicates nothing, and --resume completes an interrupted run without duplicates.
The engines are replay engines in synthetic mode (fast, deterministic); the embedded engine's run is
in test_demo.py."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from actors.engine import start_engine_actors  # noqa: E402
from actors.placement import RayPlacement  # noqa: E402
from rollout.cli.run import done_rollouts, run  # noqa: E402
from rollout.config import load_config  # noqa: E402
from rollout.data.inspect_shards import summarize  # noqa: E402
from rollout.data.shards import MANIFEST, SCHEMA_VERSION, SUMMARY, read_table  # noqa: E402
from rollout.envs import make_env  # noqa: E402
from rollout.handles import LocalRenderer  # noqa: E402
from rollout.loop import RolloutDriver  # noqa: E402
from rollout.renderer_service import RendererService  # noqa: E402

from ._support import init_local_ray, tokenizer_dir  # noqa: E402

RAY = RayPlacement()

VOCAB = 151665  # the Qwen2.5 fixture's vocabulary


@pytest.fixture(scope="module", autouse=True)
def local_ray(tmp_path_factory):
    init_local_ray(tmp_path_factory, "tito-test-run")
    yield
    ray.shutdown()


def _config(tmp_path, **over):
    sets = [
        f"model={tokenizer_dir('qwen2.5-7b-instruct')}", "engine.backend=replay", "engine.count=2",
        f"engine.options={{synthetic: true, vocab_size: {VOCAB}, max_model_len: 4096, token_delay_s: 0.002}}",
        "env.name=try_again", "tasks.count=3", "group_size=2", "max_turns=3", "max_tokens_per_turn=24",
        "max_tokens_per_rollout=72", f"output.dir={tmp_path / 'out'}", "sampling.seed=7", "renderer.actors=2",
    ]
    sets += [f"{k}={v}" for k, v in over.items()]
    return load_config(None, sets)


def _rows(out_dir):
    rows = []
    for path in sorted(out_dir.glob("data/train-*")) + sorted(out_dir.glob("shard-*")):
        rows += read_table(path).select(["rollout_id", "task_id", "segment_index", "loss_mask", "reward"]).to_pylist()
    return rows


def test_run_writes_each_rollout_once(tmp_path):
    cfg = _config(tmp_path)
    summary = run(cfg, RAY, progress=False)
    out = tmp_path / "out"
    assert summary["rollouts"] == 6 and summary["errors"] == 0
    rows = _rows(out)
    firsts = [r["rollout_id"] for r in rows if r["segment_index"] == 0]
    assert sorted(firsts) == sorted({r["rollout_id"] for r in rows}) and len(firsts) == 6
    assert all(any(r["loss_mask"]) for r in rows)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["rows"] == len(rows)
    saved = json.loads((out / SUMMARY).read_text())
    assert saved["rollouts"] == 6 and saved["this_run"]["rollouts"] == 6
    # the resolved config and the sampling params travel with the data: manifest, summary and rows
    assert manifest["config"] == saved["config"] == cfg.model_dump(mode="json")
    assert manifest["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 7}
    sampled = read_table(next(out.glob("data/*.arrow")), columns=["temperature", "top_p", "top_k", "seed"])
    assert set(map(tuple, (r.values() for r in sampled.to_pylist()))) == {(1.0, 1.0, 0, 7)}
    assert summarize(out)["rollouts"] == 6
    # a second run into the same directory must not silently mix runs
    with pytest.raises(ValueError, match="--resume"):
        run(cfg, RAY, progress=False)


def test_resume_completes_without_duplicates(tmp_path):
    run(_config(tmp_path, **{"tasks.count": 2}), RAY, progress=False)  # "interrupted" after 2 of 4 tasks
    before = done_rollouts(tmp_path / "out")
    assert len(before) == 4
    summary = run(_config(tmp_path, **{"tasks.count": 4}), RAY, resume=True, progress=False)
    assert summary["this_run"]["skipped_tasks_resumed"] == 2 and summary["this_run"]["rollouts"] == 4
    # manifest and summary cover every shard on disk, both runs'
    assert summary["rollouts"] == 8 and summary["tasks"] == 4
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["rows"] == len(_rows(tmp_path / "out")) and len(manifest["files"]) == len(list((tmp_path / "out").glob("data/*")))
    firsts = [r["rollout_id"] for r in _rows(tmp_path / "out") if r["segment_index"] == 0]
    assert len(firsts) == len(set(firsts)) == 8


def test_engine_killed_mid_run_loses_and_duplicates_nothing(tmp_path):
    cfg = _config(tmp_path, **{"tasks.count": 4, "engine.options": "{synthetic: true, vocab_size: 151665, "
                                                    "max_model_len: 4096, token_delay_s: 0.02}"})
    engines = start_engine_actors([{"kind": "replay", "kwargs": dict(cfg.engine.options), "replicas": 2, "num_cpus": 0}])
    info = ray.get(engines[0].actor.info.remote())
    svc = RendererService(cfg.model, out_dir=str(tmp_path / "out"), rows_per_file=3)
    env = make_env("try_again")
    tasks = env.generate_tasks(4, 0)
    driver = RolloutDriver(cfg, env, engines, [LocalRenderer(svc)], info, svc.renderer)

    async def main():
        job = asyncio.create_task(driver.run(tasks))
        await asyncio.sleep(0.4)  # rollouts are mid-turn on both engines
        ray.kill(engines[0].actor)
        return await job

    outcomes = asyncio.run(main())
    svc.close()
    assert driver.reruns > 0, "the kill should have hit running rollouts"
    assert len(outcomes) == 8 and all(o.error is None for o in outcomes)
    firsts = [r["rollout_id"] for r in _rows(tmp_path / "out") if r["segment_index"] == 0]
    assert sorted(firsts) == sorted(o.rollout_id for o in outcomes) and len(set(firsts)) == 8
    ray.kill(engines[1].actor)


def _old_layout(out, cfg, files: dict[str, list[dict]]) -> None:
    """An output directory as schema 1 wrote it: shard-*.arrow at the top, no sampling columns, and a
    manifest.json without the config."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from rollout.data.shards import SAMPLING_COLUMNS, SCHEMA, VERSION_COLUMNS
    from tito_renderers import create_renderer, load_tokenizer

    from .test_data import synthetic_row

    sha = create_renderer(load_tokenizer(cfg.model)).template_sha256
    old = pa.schema([f for f in SCHEMA if f.name not in SAMPLING_COLUMNS + VERSION_COLUMNS + ("lora", "task")])
    out.mkdir(parents=True)
    for name, specs in files.items():
        rows = [dict(synthetic_row(i), model=cfg.model, template_sha256=sha, **spec) for i, spec in enumerate(specs)]
        table = pa.Table.from_pylist([{k: r[k] for k in old.names} for r in rows], schema=old)
        with pa.OSFile(str(out / name), "wb") as sink, ipc.new_file(sink, old) as w:
            w.write_table(table)
    (out / "manifest.json").write_text(json.dumps({"schema_version": "1", "files": [], "rows": 0}))


def test_resume_repairs_split_and_duplicated_groups_of_the_old_layout(tmp_path):
    """Schema 1 wrote per 1024 rows, so a group could straddle two files; a crash then a resume left
    partial groups and rollouts written twice with conflicting rewards. Resume removes those groups'
    rows and reruns them whole: every task ends with exactly G rollouts, none twice."""
    cfg = _config(tmp_path)
    out = tmp_path / "out"
    tasks = [t.task_id for t in make_env("try_again").generate_tasks(3, 0)]
    partial, doubled, whole = tasks

    def member(t, k, reward=1.0):
        return {"task_id": t, "group_id": t, "rollout_id": f"{t}#{k}", "reward": reward, "segment_count": 1,
                "breaks": "[]"}

    _old_layout(out, cfg, {
        # the whole group, and a group cut short at a file boundary
        "shard-r0-00000.arrow": [member(whole, 0), member(whole, 1), member(partial, 0), member(doubled, 0)],
        # a resume of schema 1 reran the straddling group: its first member again, another reward
        "shard-r0-00001.arrow": [member(doubled, 1), member(doubled, 0, reward=9.0)],
    })
    summary = run(cfg, RAY, resume=True, progress=False)
    assert summary["this_run"]["groups_rerun_after_repair"] == sorted([partial, doubled])
    assert summary["this_run"]["rollouts"] == 4 and summary["this_run"]["skipped_tasks_resumed"] == 1
    rows = _rows(out)
    keys = [(r["rollout_id"], r["segment_index"]) for r in rows]
    assert len(keys) == len(set(keys)), "a rollout segment is in the shards twice"
    per_task = {t: {r["rollout_id"] for r in rows if r["task_id"] == t} for t in tasks}
    assert all(ids == {f"{t}#0", f"{t}#1"} for t, ids in per_task.items()), per_task
    assert 9.0 not in {r["reward"] for r in rows}
    assert not (out / "shard-r0-00001.arrow").exists()  # only the repaired groups' rows were in it
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["rows"] == len(rows) == sum(f["rows"] for f in manifest["files"])
    assert summary["rollouts"] == 6 and summary["tasks"] == 3


def test_resume_of_a_schema_2_directory(tmp_path):
    """A directory written before per-token weight versions (schema 2: shards in data/ without
    weight_versions / weight_version_max) resumes: its partial group is repaired into a schema 3 file with
    the versions derived, the new files sit beside the old one, and every reader sees both."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from rollout.data import iter_samples
    from rollout.data.outputs import write_outputs
    from rollout.data.shards import DATA_DIR, SCHEMA, VERSION_COLUMNS
    from tito_renderers import create_renderer, load_tokenizer

    from .test_data import synthetic_row

    cfg = _config(tmp_path)
    out = tmp_path / "out"
    whole, partial, _ = [t.task_id for t in make_env("try_again").generate_tasks(3, 0)]
    sha = create_renderer(load_tokenizer(cfg.model)).template_sha256
    rows = [dict(synthetic_row(i), model=cfg.model, template_sha256=sha, task_id=t, group_id=t, rollout_id=f"{t}#{k}",
                 segment_count=1, breaks="[]", weight_version=2)
            for i, (t, k) in enumerate([(whole, 0), (whole, 1), (partial, 0)])]
    old = pa.schema([f for f in SCHEMA if f.name not in VERSION_COLUMNS], metadata={"tito.schema_version": "2"})
    (out / DATA_DIR).mkdir(parents=True)
    with pa.OSFile(str(out / DATA_DIR / "train-r0-00000.arrow"), "wb") as sink, ipc.new_file(sink, old) as w:
        w.write_table(pa.Table.from_pylist([{k: r.get(k) for k in old.names} for r in rows], schema=old))
    write_outputs(out, cfg.model_dump(mode="json"), {"template_sha256": sha})

    summary = run(cfg, RAY, resume=True, progress=False)
    assert summary["this_run"]["groups_rerun_after_repair"] == [partial]
    assert summary["this_run"]["rollouts"] == 4 and summary["rollouts"] == 6
    repaired = read_table(out / DATA_DIR / "train-r0-00000.arrow")
    assert repaired.schema.metadata[b"tito.schema_version"] == SCHEMA_VERSION.encode()
    assert repaired["weight_version_max"].to_pylist() == [2, 2]
    samples = list(iter_samples(out))
    assert len({s.rollout_id for s in samples}) == 6
    for s in samples:
        assert len(s.weight_versions) == len(s.token_ids)
        assert ((s.weight_versions >= 0) == s.loss_mask).all()
        want = 2 if s.rollout_id.startswith(whole) else 0  # the old rows' one version; the replay engine's 0
        assert set(s.weight_versions[s.loss_mask].tolist()) == {want} and s.meta["weight_version_max"] == want
    assert summarize(out)["rollouts"] == 6


def test_a_ray_renderer_writes_batch_outputs(tmp_path):
    from actors.renderer import start_renderer_actors
    from rollout.data.shards import DATA_DIR
    from rollout.turns import Finished, RolloutMeta, SampledTurn

    (renderer,) = start_renderer_actors(1, str(tokenizer_dir("qwen2.5-7b-instruct")), num_cpus=0)
    step = str(tmp_path / "rollouts" / "step_1")

    async def main():
        await renderer.begin("t#0", [{"role": "user", "content": "hi"}], None)
        await renderer.record_turn("t#0", SampledTurn(0, [40, 41, 42], None, 5, {"role": "assistant", "content": "x"},
                                                      versions=[5, 6, 6]))
        await renderer.finish_group([Finished("t#0", RolloutMeta(task_id="t", group_id="t"))], out_dir=step)
        return await renderer.close_output(step)

    try:
        closed = asyncio.run(main())
    finally:
        ray.kill(renderer.actor)
    assert closed["write_error"] is None and [f["rows"] for f in closed["files"]] == [1]
    row = read_table(tmp_path / "rollouts" / "step_1" / DATA_DIR / closed["files"][0]["file"]).to_pylist()[0]
    assert [v for v, m in zip(row["weight_versions"], row["loss_mask"]) if m] == [5, 6, 6]
    assert (row["weight_version"], row["weight_version_max"]) == (5, 6)


def test_resume_with_other_sampling_is_an_error_before_anything_runs(tmp_path):
    from rollout.data.outputs import ResumeMismatch, write_outputs
    from rollout.data.shards import DATA_DIR, ShardWriter

    from .test_data import synthetic_row

    cfg = _config(tmp_path, **{"tasks.count": 1})
    out = tmp_path / "out"
    w = ShardWriter(out / DATA_DIR)
    w.add([synthetic_row(0)])
    w.close()
    write_outputs(out, cfg.model_dump(mode="json"), {})
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    with pytest.raises(ResumeMismatch) as err:
        run(_config(tmp_path, **{"tasks.count": 2, "sampling.temperature": 0.5, "sampling.top_k": 20}), RAY,
            resume=True, progress=False)
    assert "sampling.temperature: 1.0 -> 0.5" in str(err.value) and "sampling.top_k: 0 -> 20" in str(err.value)
    assert "tasks.count" not in str(err.value)  # more tasks is what a resume is for
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before, "nothing may be written"
