"""scripts/launch_rollouts.py submits a run to a real Ray cluster (a head started here on loopback)
with `ray job submit`, and the run's shards appear where the config says.

The head is this test's own: its own temp dir and ports, started in a new session, and stopped by killing
that session's processes and their descendants only. `ray stop` would stop every Ray on the machine,
other people's runs included (issue 23)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ._support import REPO, free_ports, tokenizer_dir

VENV_BIN = Path(sys.executable).parent
LAUNCH = [sys.executable, "scripts/launch_rollouts.py"]



def _processes() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, session id), from /proc/<pid>/stat (zombies left out)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # it ended while we looked
        state, ppid, _pgrp, session = stat[stat.rindex(")") + 2 :].split()[:4]  # (the name may hold spaces)
        if state != "Z":
            table[int(entry)] = (int(ppid), int(session))
    return table


def session_processes(session: int) -> set[int]:
    """The processes of a session, and their descendants that left it (a job's driver: Ray starts it in a
    session of its own, as a child of the job supervisor)."""
    table = _processes()
    found = {pid for pid, (_, sid) in table.items() if sid == session}
    while more := {pid for pid, (ppid, _) in table.items() if ppid in found} - found:
        found |= more
    return found


def stop_session(session: int, grace_s: float = 10.0) -> None:
    """SIGTERM the session's processes (and descendants); SIGKILL what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in session_processes(session):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while session_processes(session) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not session_processes(session):
            return


@pytest.fixture
def ray_head() -> Iterator[str]:
    """A Ray head of this test's own; yields its job server's address."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths have a length limit
    # every port of its own and distinct: the defaults (client server 10001, agent 52365) collide with any other
    # head here, and four one-at-a-time picks once gave the dashboard and its agent the same port
    gcs, dash, client, agent = free_ports(4)
    start = [str(VENV_BIN / "ray"), "start", "--head", f"--port={gcs}", f"--temp-dir={temp_dir}",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
             f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}",
             "--num-cpus=2", "--disable-usage-stats"]  # fmt: skip
    # a new session: `ray start` leads it, every process it starts inherits it, and its id stays reserved
    # (the kernel does not reuse a pid that still names a session) while any of them lives
    starter = subprocess.Popen(start, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        _, err = starter.communicate(timeout=180)
        if starter.returncode != 0:
            pytest.fail(f"ray start failed: {err[-2000:]}")
        yield f"http://127.0.0.1:{dash}"
    finally:
        starter.kill()  # (if ray start itself hung)
        starter.wait()
        stop_session(starter.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_submit_to_a_cluster(ray_head, tmp_path):
    out = tmp_path / "out"
    cmd = [*LAUNCH, "--address", ray_head, "--python", sys.executable,
           "configs/demo.yaml", "--set", f"model={tokenizer_dir('qwen2.5-7b-instruct')}",
           "--set", "engine.backend=replay",
           "--set", "engine.options={synthetic: true, vocab_size: 151665, max_model_len: 4096}",
           "--set", "tasks.count=2", "--set", "group_size=2", "--set", f"output.dir={out}"]  # fmt: skip
    env = dict(os.environ, RAY_AUTH_MODE="disabled", HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert json.loads((out / "_summary.json").read_text())["rollouts"] == 4
    assert list(out.glob("data/*.arrow"))
    # where the job's `tito_renderers` came from: the staged py_module Ray unpacked, not this checkout
    plan = subprocess.run([*LAUNCH, "--address", ray_head, "--dry-run", "configs/demo.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    submit = shlex.split(plan.stdout)[: shlex.split(plan.stdout).index("--")]
    probe = [*submit, "--", sys.executable, "-c", "import tito_renderers; print('FROM', tito_renderers.__file__)"]
    done = subprocess.run(probe, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    origin = next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("FROM "))
    assert "runtime_resources" in origin and origin.endswith("tito_renderers/__init__.py"), origin


def test_a_bad_config_is_refused_before_submitting():
    done = subprocess.run([*LAUNCH, "--address", "http://127.0.0.1:1", "configs/demo.yaml", "--set", "group_sise=2"],
                          cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "group_sise: unknown key" in done.stderr


# -- a job server whose job agent is not there yet -----------------------------------------------------------
# A stand-in for Ray's job head, on real HTTP: what `ray job submit --no-wait` asks of it, and Ray's own answer
# while the head node's job agent has not registered (dashboard/modules/job/job_head.py, submit_job: HTTP 500
# "No available agent to submit job, please try again later."). A real head cannot be held in that state on
# demand; what the stand-in cannot show is how long a real agent takes to come up.

NO_AGENT = "No available agent to submit job, please try again later."


class JobHeadStandIn(ThreadingHTTPServer):
    def __init__(self, refusals: int, refusal: str = NO_AGENT) -> None:
        super().__init__(("127.0.0.1", 0), _JobHeadHandler)
        self.refusals, self.refusal, self.submissions, self.refused = refusals, refusal, 0, 0

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _JobHeadHandler(BaseHTTPRequestHandler):
    server: JobHeadStandIn

    def _answer(self, status: int, body: str | dict) -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/api/version":
            import ray

            self._answer(200, {"version": "4", "ray_version": ray.__version__, "ray_commit": "", "session_name": "x"})
        else:  # /api/packages/...: the working directory is already uploaded
            self._answer(200, "")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/api/jobs/":
            self._answer(404, "")
        elif self.server.refused < self.server.refusals:
            self.server.refused += 1
            self._answer(500, self.server.refusal)
        else:
            self.server.submissions += 1
            self._answer(200, {"job_id": "raysubmit_1", "submission_id": "raysubmit_1"})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def job_head_stand_in(request) -> Iterator[JobHeadStandIn]:
    server = JobHeadStandIn(*request.param)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _submit_no_wait(address: str, agent_wait_s: float) -> subprocess.CompletedProcess:
    cmd = [*LAUNCH, "--address", address, "--agent-wait", str(agent_wait_s), "--no-wait", "configs/demo.yaml"]
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("job_head_stand_in", [(1,)], indirect=True)
def test_waits_for_the_job_agent_then_submits_once(job_head_stand_in):
    done = _submit_no_wait(job_head_stand_in.address, 60)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (job_head_stand_in.refused, job_head_stand_in.submissions) == (1, 1)
    assert done.stderr.count("has no job agent yet; nothing was submitted, trying again") == 1
    assert "raysubmit_1" in done.stdout + done.stderr


@pytest.mark.parametrize("job_head_stand_in", [(1000,)], indirect=True)
def test_gives_up_on_the_job_agent_with_a_clear_message(job_head_stand_in):
    done = _submit_no_wait(job_head_stand_in.address, 0)  # (each try costs a `ray job submit` start: keep it to one)
    assert done.returncode != 0 and (job_head_stand_in.refused, job_head_stand_in.submissions) == (1, 0)
    assert "still had no job agent after 0 s" in done.stderr and "--agent-wait" in done.stderr


@pytest.mark.parametrize("job_head_stand_in", [(1, "Failed to submit job: disk full")], indirect=True)
def test_other_submission_errors_are_not_retried(job_head_stand_in):
    done = _submit_no_wait(job_head_stand_in.address, 60)
    assert done.returncode != 0 and job_head_stand_in.refused == 1 and job_head_stand_in.submissions == 0
    assert "disk full" in done.stdout + done.stderr and "trying again" not in done.stderr
