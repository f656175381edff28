"""The start-up shared by ``tito run`` and ``tito serve``, and the floor it stands on: rollout/ never imports
actors/ (the Ray placement comes down from actors/cli.py), and only run and serve need one."""

from __future__ import annotations

import ast
import os
import signal
from pathlib import Path

from actors.placement import RayPlacement
from rollout.config import load_config
from rollout.startup import Placement, engine_specs, signals_deferred

ROLLOUT = Path(__file__).resolve().parent.parent / "rollout"


def _public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


def test_rollout_never_imports_actors_not_even_for_a_type_hint():
    found = []
    for path in sorted(ROLLOUT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(ROLLOUT.parent)}:{node.lineno} {n}" for n in names
                      if n == "actors" or n.startswith("actors.")]
    assert found == []


def test_ray_placement_has_exactly_the_placement_methods():
    assert _public(RayPlacement) == _public(Placement)


def test_run_and_serve_need_a_placement_the_other_commands_none(capsys):
    from rollout.cli.main import main

    for command in ("run", "serve"):
        assert main([command, "--set", "model=x"] if command == "serve" else [command, "x.yaml"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tito {command}: error: {command} starts Ray actors: run it as `tito {command}`"), err
    assert main(["pull", "no-such-model"]) == 2  # asks for no placement: its own error
    assert capsys.readouterr().err.startswith("tito pull: error: unknown model alias")


def test_engine_specs_come_from_the_engine_section_alone():
    cfg = load_config(None, ["engine.backend=replay", "engine.count=3", "engine.options.synthetic=true",
                             "engine.resources.big=1"])
    (spec,) = engine_specs(cfg.engine, "/m", num_cpus=0.5)
    assert (spec.kind, spec.replicas, spec.num_cpus, dict(spec.kwargs)) == ("replay", 3, 0.5, {"synthetic": True})
    assert spec.resources() == {"num_cpus": 0.5, "num_gpus": 0.0} and dict(spec.custom_resources) == {"big": 1}


def test_a_signal_while_ray_starts_goes_to_the_handler_in_place_once_it_is_up():
    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    try:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a point where a handler would run
            assert got == []  # noted, not handled, while "Ray starts"
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)



def test_serve_runs_the_same_preflight_as_run_before_ray_starts(capsys, tmp_path):
    """`tito serve` stops in seconds, rc 2, naming the problem, where `tito run` would: actors that a local Ray
    could never place, an output directory it cannot write. Ray is not started for either."""
    import ray

    from rollout.cli.main import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cases = [(["engine.backend=embedded", "engine.count=2", "engine.num_cpus=1", "ray.num_cpus=2"],
              "they would wait forever; use --set engine.num_cpus="),
             (["engine.backend=replay", f"output.dir={blocker / 'out'}"],
              f"output.dir {blocker / 'out'}: is under {blocker}, a file")]  # fmt: skip
    for settings, named in cases:
        argv = ["serve", *(x for s in settings for x in ("--set", s))]
        assert main(argv, RayPlacement()) == 2
        err = capsys.readouterr().err
        assert err.startswith("tito serve: error: ") and named in err, err
        assert not ray.is_initialized()


def test_a_ray_started_before_the_server_is_checked_with_the_configs_engine_cpus(tmp_path_factory):
    """Joined to a Ray already up (as the serve test fixtures and a cluster do), the CPU check counts
    ``engine.num_cpus`` as set: two engines at 0.5 and a renderer at 0.25 fit 2 CPUs; at 1 each they do not,
    and the error gives the sum it checked."""
    import pytest
    import ray

    from rollout.startup import wait_for_cluster_cpus

    from ._support import init_local_ray

    init_local_ray(tmp_path_factory, "tito-test-startup-cpus")
    try:
        fits = load_config(None, ["engine.backend=embedded", "engine.count=2", "engine.num_cpus=0.5"])
        wait_for_cluster_cpus(fits, None, note=None)
        wait_for_cluster_cpus(fits, 0.875, note=None)  # fit_cpus's share, where it gave one, counts instead
        too_many = load_config(None, ["engine.backend=embedded", "engine.count=2", "engine.num_cpus=1"])
        with pytest.raises(ValueError, match=r"2 engine actor\(s\) x 1 \+ 1 renderer actor\(s\) x 0.25 = 2.25 CPUs "
                                             r"but the Ray cluster has 2 CPUs"):
            wait_for_cluster_cpus(too_many, None, note=None)
    finally:
        ray.shutdown()
