"""The signal tests hold however pytest was started. A background job (``make test &`` in a script, ``nohup``
under a non-interactive shell, many CI wrappers) inherits SIGINT ignored: POSIX has the shell ignore it so that a
Ctrl-C at the terminal does not reach the job, and Python then installs no KeyboardInterrupt handler. The signal
helpers' tests run again here in a pytest started that way, and the children that tests stop with SIGINT start
with it at its default (``_support.sigint_default``) whatever their parent had."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from ._support import REPO, sigint_default

# the tests that send real signals to the pytest process itself
SIGNAL_TESTS = ["tests/test_config.py::test_only_the_first_signal_interrupts",
                "tests/test_config.py::test_a_signal_while_ray_starts_is_raised_once_it_is_up",
                "tests/test_startup.py::test_a_signal_while_ray_starts_goes_to_the_handler_in_place_once_it_is_up",
                "tests/test_signal_dispositions.py::test_a_child_to_interrupt_gets_sigint_even_where_its_parent_ignores_it"]

# pytest as a background job starts it: SIGINT ignored from the start, so Python installed no handler for it
CHILD = """import signal, sys
assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN, signal.getsignal(signal.SIGINT)
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _sigint_in_child(**popen) -> str:
    """The name of the SIGINT handler a Python child of this process starts with."""
    script = "import signal; h = signal.getsignal(signal.SIGINT); print(getattr(h, 'name', None) or h.__name__)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, **popen)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.slow
def test_the_signal_tests_pass_in_a_pytest_started_with_sigint_ignored():
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled")
    done = subprocess.run([sys.executable, "-c", CHILD, *SIGNAL_TESTS], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=_ignore_sigint)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"^\d+ passed in ", out, re.MULTILINE), out[-4000:]  # none failed, skipped or deselected


def test_a_child_to_interrupt_gets_sigint_even_where_its_parent_ignores_it():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert _sigint_in_child() == "SIG_IGN"  # inherited: Python installs no handler
        assert _sigint_in_child(restore_signals=True) == "SIG_IGN"  # not one of the signals it restores
        assert _sigint_in_child(preexec_fn=sigint_default) == "default_int_handler"
    finally:
        signal.signal(signal.SIGINT, before)
