"""What ``import renderers`` does when Python finds this source directory under its old top-level name.

tito's renderer package is installed as ``tito_renderers``; the top-level name ``renderers`` belongs to the
PyPI distribution of that name. The source directory is still ``renderers/`` at the repository root, so the
old name reaches it whenever that root is on ``sys.path``: Python started in a checkout (``''`` comes first),
or pytest's rootdir insertion. Neither case may hide the PyPI library or create a second copy of tito's
classes (``renderers.Break`` is not ``tito_renderers.Break``: isinstance checks would fail), so:

- PyPI ``renderers`` installed: it is loaded in this module's place. ``import renderers`` (verifiers) means the
  PyPI library even inside a tito checkout.
- otherwise: ``renderers`` becomes an alias of the installed ``tito_renderers`` (the same module objects, and
  ``renderers.X`` submodules the same as ``tito_renderers.X``) with a FutureWarning, so code written against the
  old name keeps working in this repository while it moves to ``tito_renderers``
  (tests/test_coexist.py fails on any import of the old name left in the repository).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

OLD, NEW = "renderers", "tito_renderers"
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.realpath(os.path.dirname(_HERE))


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``renderers.X`` -> the module ``tito_renderers.X`` itself, while ``renderers`` is the alias."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(OLD + ".") or sys.modules.get(OLD) is not sys.modules.get(NEW):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(NEW + spec.name[len(OLD):])

    def exec_module(self, module) -> None:
        pass  # already executed under its own name


def _pypi_spec() -> importlib.machinery.ModuleSpec | None:
    """Where ``renderers`` would come from if this checkout were not on ``sys.path``."""
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _ROOT]
    spec = importlib.machinery.PathFinder.find_spec(OLD, elsewhere)
    if spec is None or spec.origin is None or os.path.dirname(os.path.realpath(spec.origin)) == os.path.realpath(_HERE):
        return None
    return spec


def hand_over() -> None:
    """Replace the module being imported as ``renderers`` (this directory) by PyPI renderers or the alias."""
    sys.modules.pop(f"{OLD}._toplevel", None)  # this helper must not stay visible as a submodule of either
    spec = _pypi_spec()
    if spec is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[OLD] = module  # the import system returns whatever sys.modules holds when __init__ ends
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(OLD, None)
            raise
        return
    try:
        target = importlib.import_module(NEW)
    except ModuleNotFoundError as exc:
        if exc.name != NEW:
            raise
        raise ImportError(f"`import renderers` found tito's source directory {_HERE}, but tito is not installed; "
                          f"tito's renderer package is imported as `{NEW}` once installed: pip install -e {_ROOT}"
                          ) from None
    warnings.warn(f"`{OLD}` found tito's source directory {_HERE}: it is an alias of `{NEW}` here, and "
                  f"`import {OLD}` means the PyPI library wherever that is installed; import `{NEW}`",
                  FutureWarning, stacklevel=3)
    sys.modules[OLD] = target
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
