"""SIGPIPE: `tito template ... | head` ends quietly, and main() called in-process leaves the caller's handler.

A CI run died of this: an in-process `tito status` left SIGPIPE at its default action in pytest's process, and a
later test's write to a closed socket ended the whole suite with "Broken pipe" and no traceback.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from rollout.cli.main import main as tito

from ._support import REPO, tokenizer_dir


def test_in_process_main_leaves_sigpipe_as_it_found_it(tmp_path, capsys):
    before = signal.getsignal(signal.SIGPIPE)
    assert before == signal.SIG_IGN  # Python's own default: a closed socket raises BrokenPipeError
    assert tito(["template", str(tokenizer_dir("qwen3-0.6b"))]) == 0
    assert tito(["status", str(tmp_path / "no-run")]) != 0  # a command that fails, too
    capsys.readouterr()
    assert signal.getsignal(signal.SIGPIPE) == before


def test_a_reader_that_leaves_ends_template_quietly():
    # `head -c 1` leaves after one byte; the template report is written in several lines after it
    script = (f"{sys.executable} -m rollout.cli template {tokenizer_dir('qwen3-0.6b')} | head -c 1 >/dev/null;"
              " echo rc=${PIPESTATUS[0]}")
    done = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.stdout.strip() in {"rc=0", "rc=141"}, done.stdout  # 141: ended by SIGPIPE, as `yes | head` is
