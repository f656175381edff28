"""What ``import renderers`` does when Python finds this source directory under its old top-level name.

The top-level name ``renderers`` belongs to the PyPI library (verifiers imports it); tito's package is
``tito_renderers``. Inside a checkout the repository root is on ``sys.path`` (Python started there, or
pytest's rootdir insertion), so ``import renderers`` reaches this directory first. It must not shadow PyPI
``renderers``, nor make a second copy of tito's classes (``renderers.Break`` would not be
``tito_renderers.Break``). So this module loads PyPI ``renderers`` in its place when it is installed,
and otherwise raises an ImportError that names ``tito_renderers``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.realpath(os.path.dirname(_HERE))


def hand_over() -> None:
    """Replace the module being imported as ``renderers`` (this directory) by PyPI renderers, or refuse."""
    sys.modules.pop("renderers._toplevel", None)  # this helper must not stay visible as a submodule
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _ROOT]
    spec = importlib.machinery.PathFinder.find_spec("renderers", elsewhere)
    if spec is None or spec.origin is None or os.path.dirname(os.path.realpath(spec.origin)) == os.path.realpath(_HERE):
        sys.modules.pop("renderers", None)
        raise ImportError(f"`import renderers` found tito's source directory {_HERE}: tito's renderer package is "
                          "imported as `tito_renderers`; `renderers` is the PyPI library (pip install renderers)",
                          name="renderers")
    module = importlib.util.module_from_spec(spec)
    sys.modules["renderers"] = module  # the import system returns whatever sys.modules holds when __init__ ends
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("renderers", None)
        raise
