"""Run configuration: errors name the key; overrides from the command line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from rollout.config import ConfigError, load_config

from ._support import REPO


def test_demo_config_loads():
    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.engine.backend == "embedded"


def test_unknown_and_bad_keys_are_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("group_size: 4\nengine:\n  backnd: embedded\n")
    with pytest.raises(ConfigError, match=r"engine.backnd: unknown key"):
        load_config(path)
    path.write_text("group_size: zero\n")
    with pytest.raises(ConfigError, match=r"group_size: .*integer"):
        load_config(path)
    path.write_text("engine:\n  backend: tpu\n")
    with pytest.raises(ConfigError, match=r"engine.backend"):
        load_config(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")


def test_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("group_size: 2\n")
    cfg = load_config(path, ["group_size=8", "engine.options.threads=2", "output.format=parquet", "model=x"])
    assert cfg.group_size == 8 and cfg.engine.options == {"threads": 2} and cfg.output.format == "parquet"
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(path, ["group_size"])
    with pytest.raises(ConfigError, match="sampling.temperature"):
        load_config(path, ["sampling.temperature=-1"])
    with pytest.raises(ConfigError, match="max_tokens_per_turn"):
        load_config(path, ["max_tokens_per_turn=10", "max_tokens_per_rollout=5"])


def test_resume_differences_name_every_field(tmp_path):
    """--resume compares the saved config: sampling, model, renderer and template hash must match;
    tasks.count, engines and output may change."""
    from rollout.data.outputs import ResumeMismatch, check_resume, resume_differences, write_outputs
    from rollout.data.shards import DATA_DIR, ShardWriter

    from .test_data import synthetic_row

    saved = load_config(None, ["sampling.top_p=0.9", "tasks.count=4"]).model_dump(mode="json")
    other = load_config(None, ["sampling.top_p=0.5", "tasks.count=8", "engine.count=2", "model=other",
                               "renderer.template_kwargs.enable_thinking=false"]).model_dump(mode="json")
    diffs = resume_differences(saved, other)
    assert sorted(d.split(":")[0] for d in diffs) == ["model", "renderer.template_kwargs.enable_thinking",
                                                      "sampling.top_p"], diffs
    assert resume_differences(saved, saved) == []
    out = tmp_path / "out"
    w = ShardWriter(out / DATA_DIR)
    w.add([synthetic_row(0)])
    w.close()
    write_outputs(out, saved, {"template_sha256": "a" * 64})
    check_resume(out, saved, "a" * 64)  # same config, same template: fine
    with pytest.raises(ResumeMismatch, match="template_sha256: a{16} -> b{16}"):
        check_resume(out, saved, "b" * 64)


def test_engine_options_the_backend_does_not_take_are_refused_naming_them():
    from rollout.startup import check_engine_options

    check_engine_options("vllm", {"max_model_len": 2048, "enforce_eager": True})  # accepted
    with pytest.raises(ValueError, match=r"threads not an option of the vllm backend \(its options: .*enforce_eager"):
        check_engine_options("vllm", {"threads": 1})  # what configs/serve.yaml sets for the embedded engine
    with pytest.raises(ValueError, match="thread not an option of the embedded backend"):
        check_engine_options("embedded", {"thread": 2})


# Issue 23: every bad value is a one-line error naming the key and what it accepts, before Ray starts.

@pytest.mark.parametrize("override, named", [
    ("sampling.top_k=-5", r"sampling\.top_k: Input should be greater than or equal to -1 — 0 or -1: off"),
    ("sampling.seed=99999999999999999999999", r"sampling\.seed: Input should be less than or equal to 9223372036854775807"),
    ("sampling.seed=-9223372036854775809", r"sampling\.seed: Input should be greater than or equal to -9223372036854775808"),
    ("sampling.temperature=true", r"sampling\.temperature: must be a number, got true — 0 \(greedy\) or at least 0\.01"),
    ("sampling.temperature=0.001", r"sampling\.temperature: must be 0 \(greedy\) or at least 0\.01, got 0\.001"),
    ("sampling.temperature=.inf", r"sampling\.temperature: Input should be a finite number"),
    ("group_size=true", r"group_size: must be a number, got true — rollouts per task"),
    ("engine.num_cpus=false", r"engine\.num_cpus: must be a number, got false"),
    ("renderer.actors=true", r"renderer\.actors: must be a number, got true"),
])
def test_bad_values_are_one_line_naming_the_key_and_what_it_accepts(override, named):
    with pytest.raises(ConfigError, match=r"^invalid configuration: " + named) as err:
        load_config(REPO / "configs" / "demo.yaml", [override])
    assert "\n" not in str(err.value)


def test_values_the_engines_accept_are_accepted():
    cfg = load_config(None, ["sampling.top_k=-1", "sampling.seed=9223372036854775807", "sampling.temperature=0",
                             "advantage.normalize_std=true", "renderer.template_kwargs.enable_thinking=false"])
    assert (cfg.sampling.top_k, cfg.sampling.seed, cfg.sampling.temperature) == (-1, 2**63 - 1, 0.0)
    assert cfg.advantage.normalize_std is True and cfg.renderer.template_kwargs == {"enable_thinking": False}
    assert load_config(None, ["sampling.seed=-9223372036854775808", "sampling.top_k=40"]).sampling.top_k == 40


def test_cli_config_error_is_rc2_and_one_line(capsys):
    from actors.cli import main

    assert main(["run", "configs/demo.yaml", "--out", "/nonexistent/never", "--set", "sampling.top_k=-5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tito run: error: invalid configuration: sampling.top_k:") and err.count("\n") == 1, err


# Task files: a repeated task id or a line that is not UTF-8 is named by file and line.

def test_a_repeated_task_id_is_refused_with_file_and_line(tmp_path):
    from rollout.envs.tasks import TaskFileError, load_tasks

    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt": "a", "task_id": "dup"}\n\n{"prompt": "b", "task_id": "dup"}\n')
    with pytest.raises(TaskFileError, match=rf"{path}, row 1 \(line 3\), column 'task_id': 'dup' already used by "
                                            r"row 0 \(line 1\)"):
        load_tasks(path)
    path.write_text('{"prompt": "a", "task_id": 7}\n{"prompt": "b", "task_id": "7"}\n')  # both become "7"
    with pytest.raises(TaskFileError, match=r"line 2\), column 'task_id': '7' already used"):
        load_tasks(path)
    path.write_text('{"prompt": "same"}\n{"prompt": "same"}\n')  # the derived id repeats
    with pytest.raises(TaskFileError, match=r"row 1 \(line 2\): the same messages and answer as row 0 \(line 1\)"):
        load_tasks(path)
    loaded = load_tasks(path, skip_bad_rows=True)  # skipping keeps the first
    assert len(loaded) == 1 and loaded.skipped == 1


def test_a_task_file_that_is_not_utf8_names_file_and_line(tmp_path):
    from rollout.envs.tasks import TaskFileError, load_tasks

    path = tmp_path / "t.jsonl"
    path.write_bytes(b'\xff{"prompt": "a"}\n')
    with pytest.raises(TaskFileError, match=rf"{path}, row 0 \(line 1\): not UTF-8 text: byte 0xff at column 1"):
        load_tasks(path)
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n{"prompt": "c"}\n')
    loaded = load_tasks(path, skip_bad_rows=True)
    assert [t.messages[0]["content"] for t in loaded] == ["a", "c"] and "(line 2): not UTF-8" in loaded.errors[0]
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')  # a byte order mark is not an error
    assert load_tasks(path).tasks[0].messages[0]["content"] == "a"


# Output directories: checked by writing a probe file where the first file will go; nothing is left.

def test_output_dirs_that_cannot_be_written_are_refused_before_anything(tmp_path):
    from rollout.startup import check_output_dir

    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=rf"output.dir {a_file}: is a file, not a directory"):
        check_output_dir(a_file)
    with pytest.raises(ValueError, match=rf"output.dir {a_file}/sub: is under {a_file}, a file, not a directory"):
        check_output_dir(a_file / "sub")
    with pytest.raises(ValueError, match=r"output.dir /proc/x/y: cannot write in /proc: "):
        check_output_dir(Path("/proc/x/y"))
    check_output_dir(tmp_path / "new" / "deeper")  # writable: fine, and nothing created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    (tmp_path / "run" / "data").mkdir(parents=True)  # a resume: the directory and its data/ are probed
    times = {p: p.stat().st_mtime_ns for p in (tmp_path / "run", tmp_path / "run" / "data")}
    check_output_dir(tmp_path / "run")
    assert {p: p.stat().st_mtime_ns for p in times} == times and not any((tmp_path / "run" / "data").iterdir())


def test_an_immutable_output_dir_is_refused(tmp_path):
    """Root ignores mode bits: an immutable directory (chattr +i, ext4) is what nobody can write."""
    from rollout.startup import check_output_dir

    locked = tmp_path / "locked"
    (locked / "data").mkdir(parents=True)
    if subprocess.run(["chattr", "+i", str(locked / "data")], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a file system with the immutable flag)")
    try:
        with pytest.raises(ValueError, match=rf"cannot write in {locked}/data: Operation not permitted"):
            check_output_dir(locked)  # a resume into it: its data/ is probed too
        subprocess.run(["chattr", "+i", str(locked)], check=True)
        with pytest.raises(ValueError, match=rf"output.dir {locked}/new: cannot write in {locked}: "):
            check_output_dir(locked / "new")
    finally:
        subprocess.run(["chattr", "-i", str(locked), str(locked / "data")], check=True)
    assert sorted(p.name for p in locked.iterdir()) == ["data"] and not any((locked / "data").iterdir())


# Ray CPUs: the actors must fit, else Ray never places them and the run sits at 0 rollouts.

def test_engines_share_the_local_cpus_or_the_run_stops_with_the_numbers():
    from rollout.startup import fit_cpus

    cfg = load_config(REPO / "configs" / "demo.yaml")  # 1 embedded engine (1 CPU) + 1 renderer (0.25)
    assert fit_cpus(cfg, 2) == (None, None)
    share, note = fit_cpus(load_config(REPO / "configs" / "demo.yaml", ["engine.count=2"]), 2)
    assert share == 0.875 and "= 2.25 CPUs and the local Ray has 2: each engine actor takes 0.875 CPU" in note
    with pytest.raises(ValueError, match=r"2 engine actor\(s\) x 1 \+ 1 renderer actor\(s\) x 0.25 = 2.25 CPUs but "
                                         r"the local Ray has 2 CPUs .*use --set engine.num_cpus=0.875"):
        fit_cpus(load_config(REPO / "configs" / "demo.yaml", ["engine.count=2", "engine.num_cpus=1"]), 2)
    with pytest.raises(ValueError, match=r"smaller renderer.num_cpus \(the renderers alone need 2\)"):
        fit_cpus(load_config(REPO / "configs" / "demo.yaml", ["renderer.actors=8"]), 2)
    assert fit_cpus(load_config(None, ["engine.backend=replay", "engine.count=16"]), 1) == (None, None)


# Signals, with real signals to this process: only the first stops a run; during ray.init it waits.

@pytest.fixture(params=["default_int_handler", "SIG_IGN"])
def sigint_found(request):
    """SIGINT as a Python process finds it: Python's KeyboardInterrupt handler, or ignored where the process was
    started as a background job (``make test &`` in a script: POSIX has the shell ignore SIGINT for it, and
    Python then installs no handler). The signal helpers must restore it either way."""
    import signal

    before = signal.signal(signal.SIGINT, getattr(signal, request.param))
    try:
        yield signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)


def test_only_the_first_signal_interrupts(sigint_found):
    import os
    import signal

    from rollout.cli.run import RunInterrupted, _signals_raise

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    assert before[signal.SIGINT] is sigint_found
    with pytest.raises(RunInterrupted) as first, _signals_raise():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a point where the handler runs
    assert first.value.signum == signal.SIGTERM
    with _signals_raise():  # a new run starts afresh; inside one, a second signal is ignored
        with pytest.raises(RunInterrupted):
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])
        os.kill(os.getpid(), signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert {s: signal.getsignal(s) for s in before} == before  # what the block found, whatever that was


def test_a_signal_while_ray_starts_is_raised_once_it_is_up(sigint_found):
    import os
    import signal

    import ray._private.utils as ray_utils

    from rollout.cli.run import RunInterrupted, _signals_raise
    from rollout.startup import signals_deferred

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(RunInterrupted) as got, _signals_raise(), signals_deferred():
        ray_utils.set_sigterm_handler(lambda *_: None)  # what ray.init does: here a no-op
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        signal.pthread_sigmask(signal.SIG_BLOCK, [])
        reached = True  # neither signal cut this block short
    assert reached and got.value.signum == signal.SIGTERM
    assert {s: signal.getsignal(s) for s in before} == before


# Issue 31: switching the backend with one flag works for every shipped config; options are still strict.

def _shipped_configs() -> list[tuple[Path, type]]:
    from rollout.config import RunConfig, ServeConfig

    configs = sorted((REPO / "configs").glob("*.yaml"))
    assert len(configs) >= 3
    return [(path, ServeConfig if path.name.startswith("serve") else RunConfig) for path in configs]


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_every_shipped_config_switches_backend_with_one_flag(backend):
    from rollout import startup

    for path, schema in _shipped_configs():
        # preflight is the validation `tito run` and `tito serve` do before anything starts; joining a cluster
        # (never contacted here) it stops after the engine options, before the checks of this machine's vLLM
        cfg = load_config(path, [f"engine.backend={backend}", "ray.address=ray://127.0.0.1:1"], schema)
        assert startup.preflight(cfg, None) == (None, None), path


def test_backend_options_are_checked_whichever_backend_runs():
    from rollout.config import ServeConfig
    from rollout.startup import check_engine_config

    serve = REPO / "configs" / "serve.yaml"
    cfg = load_config(serve, ["engine.backend_options.embedded.threads=3", "engine.options.max_model_len=512"],
                      ServeConfig)
    assert cfg.engine.backend_kwargs == {"threads": 3, "max_model_len": 512}  # engine.options win over a section
    with pytest.raises(ValueError, match=r"^engine\.backend_options\.vllm: thread not an option of the vllm"):
        check_engine_config(load_config(serve, ["engine.backend_options.vllm.thread=1"], ServeConfig).engine)
    with pytest.raises(ValueError, match=r"^engine\.options: threads not an option of the vllm backend"):
        check_engine_config(load_config(serve, ["engine.backend=vllm", "engine.options.threads=1"], ServeConfig).engine)
    with pytest.raises(ConfigError, match=r"engine\.backend_options\.vlm"):
        load_config(serve, ["engine.backend_options.vlm.threads=1"], ServeConfig)


def test_an_empty_out_is_an_error_before_anything_runs(tmp_path):
    """Issue 31: `--out ""` ran the config's output.dir under the current directory and exited 0."""
    import os
    import sys

    tito = Path(sys.executable).with_name("tito")
    for out in ("", "  "):
        done = subprocess.run([str(tito), "run", str(REPO / "configs" / "demo.yaml"), "--out", out], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr == f"tito run: error: --out {out!r}: an empty path; name a directory\n"
        assert list(tmp_path.iterdir()) == [], "nothing is written"
    with pytest.raises(ConfigError, match=r"output\.dir: must name a directory, got ''"):
        load_config(REPO / "configs" / "demo.yaml", ["output.dir=''"])


def test_weight_transfer_that_cannot_be_is_one_line_before_anything_starts():
    from rollout.config import ServeConfig
    from rollout.startup import check_engine_config, engine_specs

    serve = REPO / "configs" / "serve.yaml"

    def check(*items):
        check_engine_config(load_config(serve, list(items), ServeConfig).engine)

    check("engine.weight_transfer=gloo")  # the embedded engine receives over gloo
    with pytest.raises(ValueError, match=r"^engine\.weight_transfer: nccl is vLLM's own NCCL engine and needs "
                                         r"engine\.backend: vllm on CUDA GPUs"):
        check("engine.weight_transfer=nccl")
    with pytest.raises(ValueError, match=r"^engine\.weight_transfer: gloo: the replay engine receives no weights"):
        check("engine.backend=replay", "engine.weight_transfer=gloo")
    check("engine.backend=vllm", "engine.weight_transfer=gloo")  # received by tito's actor, reloaded by vLLM
    with pytest.raises(ValueError, match=r"^engine\.weight_transfer: nccl (needs CUDA GPUs and this vLLM is its CPU "
                                         r"build|is not yet available on the vllm backend)"):
        check("engine.backend=vllm", "engine.weight_transfer=nccl")
    with pytest.raises(ConfigError, match=r"engine\.weight_transfer"):
        load_config(serve, ["engine.weight_transfer=ipc"], ServeConfig)
    # what the engines are built with: nothing unless asked, so no engine listens by default
    cfg = load_config(serve, ["engine.weight_transfer=gloo", "engine.weight_transfer_timeout_s=9"], ServeConfig)
    assert engine_specs(cfg.engine, "m")[0].kwargs["weight_transfer_timeout_s"] == 9
    assert "weight_transfer" not in engine_specs(load_config(serve, [], ServeConfig).engine, "m")[0].kwargs
