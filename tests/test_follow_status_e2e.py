"""`tito status` against a real `tito run --follow` process on real Ray: healthy while it runs (exit 0), stale
once it is SIGKILLed (exit 1, naming the dead pid): status.json is left as the killed process last wrote it."""

from __future__ import annotations

import pytest

from rollout.cli.main import main as tito
from rollout.follow.status import read_status

from .test_follow_cli import _config, _kill_session, _start, _until
from .test_run_failfast import ray_tmp  # noqa: F401 - the fixture


@pytest.mark.slow
def test_status_is_healthy_while_it_runs_and_stale_after_sigkill(tmp_path, ray_tmp, capsys):  # noqa: F811
    config, run = _config(tmp_path), tmp_path / "run"
    proc = _start(config, run, ray_tmp, "--set", "follow.max_steps=20")
    try:
        _until(proc, "batch 1 sealed")
        assert tito(["status", str(run)]) == 0, capsys.readouterr()
        out = capsys.readouterr().out
        assert "healthy" in out and "state" in out, out
        status = read_status(run)
        assert status["pid"] == proc.pid and status["engines_configured"] == 1
        proc.kill()  # SIGKILL: no last write
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_session(ray_tmp)
    assert tito(["status", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"pid {proc.pid} is not running" in out, out
