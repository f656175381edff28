"""The guard in tests/_ast_guard.py: a finalizer that raises while pytest parses a failed test's source must
not crash pytest (issue 23: INTERNALERROR "AST constructor recursion depth mismatch", 164 tests never ran).
Real pytest runs in subprocesses, on a test file that recreates the case: a failing test that leaves cyclic
garbage whose ``__del__`` raises, collected during pytest's ``ast.parse`` of that file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ._support import REPO

FAILING_TEST = """
import gc


class RaisesWhenCollected:
    def __del__(self):
        raise RuntimeError("raised by __del__")


def test_fails_and_leaves_garbage():
    gc.collect()
    garbage = RaisesWhenCollected()
    garbage.cycle = garbage  # only the cyclic collector frees it
    del garbage
    gc.set_threshold(700)  # reached by the nodes of the parse of this file below, not before
    assert False


def filler():
"""
FILLER = "".join(f"    x{i} = [{i}, ({i}, {i + 1}), {{'k': {i}}}]\n" for i in range(400))


def run_pytest(directory: Path, *options: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, "test_it.py"],
                          cwd=directory, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    return done.stdout + done.stderr


def test_a_raising_finalizer_during_the_failure_report_does_not_crash_pytest(tmp_path: Path) -> None:
    (tmp_path / "test_it.py").write_text(FAILING_TEST + FILLER)
    unguarded = run_pytest(tmp_path)
    if sys.version_info[:2] == (3, 11):  # the interpreter bug this guards against: the crash, reproduced
        assert "INTERNALERROR> SystemError: AST constructor recursion depth mismatch" in unguarded, unguarded
    guarded = run_pytest(tmp_path, "-p", "tests._ast_guard")
    assert "INTERNALERROR" not in guarded and "1 failed" in guarded, guarded
    # the finalizer's error is still reported, as the ordinary warning
    assert "PytestUnraisableExceptionWarning" in guarded and "raised by __del__" in guarded
