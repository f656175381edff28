"""What `tito run` / `tito serve` print: the progress display on a terminal (a real pty) and into a
pipe or log (no ANSI, no carriage returns), NO_COLOR, the start-up and ready lines of real runs, and
`tito --version`."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import threading
import time
import tomllib
import urllib.request

import pytest

import tito_renderers as renderers
from rollout.cli.progress import Progress
from rollout.config import RunConfig
from rollout.engines.replay import ReplayEngine
from rollout.envs.calculator import CalculatorEnv
from rollout.handles import LocalEngine
from rollout.loop import RolloutDriver, RolloutOutcome

from ._support import REPO, interrupt, ours, sigint_default, tokenizer_dir

QWEN = "qwen2.5-7b-instruct"
VOCAB = 151665  # the Qwen2.5 fixture's vocabulary
SGR = re.compile(r"\x1b\[([0-9;]*)m")


def _colours(text: str) -> list[str]:
    """SGR sequences that set a foreground or background colour (bold, dim, reset do not count)."""
    out = []
    for m in SGR.finditer(text):
        params = [int(p) for p in m.group(1).split(";") if p]
        if any(30 <= p <= 38 or 40 <= p <= 48 or 90 <= p <= 97 or 100 <= p <= 107 for p in params):
            out.append(m.group(0))
    return out


def _driver(breaks: int) -> RolloutDriver:
    tok = ours(QWEN)
    engine = ReplayEngine(synthetic=True, vocab_size=tok.vocab_size)
    driver = RolloutDriver(RunConfig(), CalculatorEnv(), [LocalEngine(engine)], [], engine.info(), renderers.create_renderer(tok))
    driver.breaks = breaks
    return driver


def _feed(bar: Progress, n: int, delay_s: float = 0.0) -> None:
    for i in range(n):
        bar(RolloutOutcome(f"r{i}", "t", "t", "env_done", reward=float(i % 2), turns=2, completion_tokens=10,
                           error="boom" if i == 0 else None))
        time.sleep(delay_s)


def test_plain_lines_without_a_terminal():
    out = io.StringIO()
    bar = Progress(4, stream=out, interval_s=60, percent_step=25)
    bar.note("starting 4 rollouts")
    bar.start()
    bar.driver = _driver(breaks=2)
    _feed(bar, 4)
    bar.finish()
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "tito run: starting 4 rollouts"
    # one line per 25 %, each with the counts, elapsed time and ETA; the last one at ETA zero
    assert [re.search(r"rollouts (\d)/4 \((\d+)%\)", ln).groups() for ln in lines[1:]] == [
        ("1", "25"), ("2", "50"), ("3", "75"), ("4", "100")]
    assert all("ETA " in ln and " tok/s" in ln for ln in lines[1:])
    last = lines[-1]
    assert "ETA 0:00:00" in last and "break rate 0.250" in last and "mean reward 0.500" in last and "errors 1" in last


def test_plain_lines_come_on_time_even_without_finished_rollouts():
    out = io.StringIO()
    bar = Progress(10, stream=out, interval_s=0.2, percent_step=50)
    bar.start()
    time.sleep(1.3)  # a long first rollout: the log must still show the run is alive
    bar.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3, lines
    assert all("rollouts 0/10 (0%)" in ln and "ETA ?" in ln for ln in lines)
    assert "\x1b" not in out.getvalue()


def _on_pty(fn) -> str:
    """Run ``fn(stream)`` with ``stream`` the slave end of a real pty; returns what reached the master."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a 160-column terminal
    stream = os.fdopen(slave, "w", encoding="utf-8")
    assert stream.isatty()
    chunks: list[bytes] = []
    done = threading.Event()

    def read() -> None:  # drain concurrently: a full pty buffer would block the writer
        while True:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunks.append(os.read(master, 65536))
                except OSError:
                    return
            elif done.is_set():
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        fn(stream)
        stream.flush()
    finally:
        done.set()
        reader.join(timeout=5)
        stream.close()
        os.close(master)
    return b"".join(chunks).decode("utf-8", "replace")


def _bar_run(stream) -> None:
    bar = Progress(4, stream=stream)
    bar.note("starting 4 rollouts")
    bar.start()
    bar.driver = _driver(breaks=0)
    _feed(bar, 4, delay_s=0.15)
    bar.finish()


def test_a_terminal_gets_a_rich_bar_in_colour(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    text = _on_pty(_bar_run)
    assert "4/4" in text and "ETA" in text and "tok/s" in text and "errors 1" in text
    assert "tito run:" in text and "starting 4 rollouts" in text
    assert _colours(text), "a terminal without NO_COLOR gets colour"


@pytest.mark.parametrize("value", ["1", "yes"])
def test_no_color_turns_colour_off_on_a_terminal(monkeypatch, value):
    monkeypatch.setenv("NO_COLOR", value)
    monkeypatch.setenv("TERM", "xterm-256color")
    text = _on_pty(_bar_run)
    assert "4/4" in text and "ETA" in text
    assert not _colours(text), _colours(text)[:5]


def test_use_color_only_on_a_terminal_without_no_color(monkeypatch):
    from rollout.cli.progress import use_color

    seen = []
    monkeypatch.delenv("NO_COLOR", raising=False)
    _on_pty(lambda stream: seen.append(use_color(stream)))
    monkeypatch.setenv("NO_COLOR", "1")
    _on_pty(lambda stream: seen.append(use_color(stream)))
    monkeypatch.setenv("NO_COLOR", "")  # empty: not set (no-color.org)
    _on_pty(lambda stream: seen.append(use_color(stream)))
    assert seen == [True, False, True] and not use_color(io.StringIO())


def test_version_is_the_package_version():
    done = subprocess.run([sys.executable, "-m", "actors.cli", "--version"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    expected = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert done.returncode == 0 and done.stdout == f"tito {expected}\n", (done.stdout, done.stderr)


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    env.pop("NO_COLOR", None)  # into a pipe there must be no ANSI even when colour is not switched off
    return env


@pytest.mark.slow
def test_run_into_a_pipe_has_startup_ready_and_progress_lines(tmp_path):
    out = tmp_path / "out"
    sets = [f"model={tokenizer_dir(QWEN)}", "engine.backend=replay", "engine.count=1",
            f"engine.options={{synthetic: true, vocab_size: {VOCAB}, max_model_len: 4096, token_delay_s: 0.002}}",
            "env.name=try_again", "tasks.count=3", "group_size=2", "max_turns=2", "max_tokens_per_turn=16",
            "max_tokens_per_rollout=32", "renderer.actors=1", "ray.num_cpus=2"]
    cmd = [sys.executable, "-m", "actors.cli", "run", "configs/demo.yaml", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    both = done.stdout + done.stderr
    assert "\x1b" not in both and "\r" not in both, repr(both[:2000])
    lines = done.stderr.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("tito run: starting 6 rollouts of try_again"))
    assert "1 x replay engine" in lines[start] and str(out) in lines[start]
    ready = next(i for i, ln in enumerate(lines) if re.match(r"tito run: ready in \d+\.\d s: 1 engine up", ln))
    final = [i for i, ln in enumerate(lines) if "rollouts 6/6 (100%)" in ln]
    assert start < ready < final[0], lines
    assert "renderer qwen2.5" in lines[ready]


@pytest.mark.slow
def test_serve_prints_a_ready_line_with_the_bound_url(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {tokenizer_dir(QWEN)}\nengine:\n  backend: replay\n"
                      f"  options: {{synthetic: true, vocab_size: {VOCAB}, max_model_len: 256}}\nengine_in_process: true\n"
                      "ray:\n  num_cpus: 1\n")
    err = (tmp_path / "stderr").open("w+")  # a file, not a pipe nobody reads: the server must never block on it
    proc = subprocess.Popen([sys.executable, "-m", "actors.cli", "serve", str(config), "--port", "0"], cwd=REPO,
                            env=_env(), stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=sigint_default)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("ready in" in ln for ln in lines):
            assert proc.poll() is None and time.monotonic() < deadline, (lines, (tmp_path / "stderr").read_text()[-3000:])
            lines.append(proc.stdout.readline())
        assert lines[0].startswith("tito serve: ") and "starting model" in lines[0] and "1 x replay engine" in lines[0]
        url = re.search(r"ready in \d+\.\d s on (http://127\.0\.0\.1:(\d+))$", lines[-1].strip())
        assert url and int(url.group(2)) > 0, lines  # the port actually bound, not the 0 of the config
        with urllib.request.urlopen(url.group(1) + "/health", timeout=10) as r:
            assert r.status == 200
    finally:
        rest = interrupt(proc)
    assert "\x1b" not in "".join(lines) + rest + (tmp_path / "stderr").read_text()
