"""Keep a finalizer from crashing pytest: ``ast.parse`` runs with the cyclic garbage collector paused.

On CPython 3.11 the AST constructor keeps its recursion count in per-interpreter state, so an ``ast.parse``
that starts while another one is building its tree corrupts the outer one's count, and the outer call raises
``SystemError: AST constructor recursion depth mismatch``. Pytest gets there on its own: its ``ast.parse`` of a
failed test's source (the failure report) or of a module it rewrites allocates many nodes, that triggers a
collection, the collection runs the ``__del__`` of some leftover (issue 23: a subprocess transport whose
event loop had closed) which raises, pytest's unraisable-exception hook formats that traceback, and on 3.11
formatting a traceback calls ``ast.parse`` (for the ``^^^`` markers). Pytest reports INTERNALERROR and stops:
the rest of the suite never runs (164 tests once).

With the collector paused during the parse, no finalizer can run inside it: tree building itself runs no
Python code. The garbage is collected at the next allocation after the parse, where its ``__del__`` errors are
reported as the ordinary PytestUnraisableExceptionWarning. Imported by ``tests/conftest.py``; also a plugin
(``-p tests._ast_guard``) for the test that checks it.
"""

from __future__ import annotations

import ast
import functools
import gc


def _install() -> None:
    if getattr(ast.parse, "tito_collector_paused", False):  # once, however often this module is imported
        return
    parse = ast.parse

    @functools.wraps(parse)
    def parse_with_the_collector_paused(*args, **kwargs):
        if not gc.isenabled():  # paused by someone else (or a parse in another thread): theirs to resume
            return parse(*args, **kwargs)
        gc.disable()
        try:
            return parse(*args, **kwargs)
        finally:
            gc.enable()

    parse_with_the_collector_paused.tito_collector_paused = True
    ast.parse = parse_with_the_collector_paused


_install()
