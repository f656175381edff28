"""Run configuration: errors name the key; overrides from the command line."""

from __future__ import annotations

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
    from rollout.outputs import ResumeMismatch, check_resume, resume_differences, write_outputs
    from rollout.shards import DATA_DIR, ShardWriter

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
    from rollout.run import _check_engine_options

    _check_engine_options("vllm", {"max_model_len": 2048, "enforce_eager": True})  # accepted
    with pytest.raises(ValueError, match=r"threads not an option of the vllm backend \(its options: .*enforce_eager"):
        _check_engine_options("vllm", {"threads": 1})  # what configs/serve.yaml sets for the embedded engine
    with pytest.raises(ValueError, match="thread not an option of the embedded backend"):
        _check_engine_options("embedded", {"thread": 2})


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
