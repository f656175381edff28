"""``tito doctor``: what this environment holds, where tito's packages are imported from, and whether tito and
the PyPI distribution ``renderers`` (verifiers depends on it) live side by side. Exits 1 on a conflict, printing
a one-line fix for each."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import warnings
from importlib import metadata
from pathlib import Path

from . import coexist

OK, CONFLICT = 0, 1


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _pypi_renderers(tito_dir: Path | None) -> tuple[str, list[str]]:
    """One line on PyPI ``renderers`` (installed? importable? which version?) and the problems found importing it."""
    dists = list(metadata.distributions(name="renderers"))
    if not dists:
        return "not installed", []
    version = dists[0].version
    fix = f"pip install --force-reinstall --no-deps renderers=={version}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            renderers = importlib.import_module("renderers")  # the PyPI library, never tito's
    except Exception as exc:  # whatever a damaged install raises, the report says so
        return f"{version} installed, NOT importable", [f"PyPI renderers {version} is installed but `import renderers` "
                                                        f"fails ({type(exc).__name__}: {exc}). Fix: {fix}"]
    if getattr(renderers, "__file__", None) is None:  # its __init__.py is gone: only a namespace package is left
        return f"{version} installed, NOT importable", [f"PyPI renderers {version} is installed but its "
                                                        f"renderers/__init__.py is missing. Fix: {fix}"]
    where = Path(renderers.__file__).parent
    if tito_dir is not None and where.resolve() == tito_dir.resolve():
        return f"{version} installed, shadowed", [f"`import renderers` gives tito's renderer package at {where} instead "
                                                  f"of PyPI renderers {version}. Fix: {fix}"]
    return f"{getattr(renderers, '__version__', version)} importable from {where}", []


def _fixtures() -> str:
    """The test fixtures directory as tests/_support.py finds it: $TITO_FIXTURES, else beside a checkout."""
    env = os.environ.get("TITO_FIXTURES")
    root = Path(__file__).resolve().parent.parent
    if not env and not (root / "pyproject.toml").is_file():
        return "$TITO_FIXTURES not set (only the tests use them)"
    path = Path(env).expanduser() if env else root.parent / "shared" / "fixtures"
    found = "found" if (path / "tokenizers").is_dir() else "not found (tests that need them skip; set TITO_FIXTURES)"
    return f"{path} ({'$TITO_FIXTURES' if env else 'default'}): {found}"


def _default_model() -> str:
    try:
        from ..models import ModelNotFound, resolve_model
    except ImportError as exc:  # tito_renderers does not import: reported above
        return f"not checked ({type(exc).__name__})"
    try:
        return str(resolve_model("smollm2-135m"))
    except ModelNotFound as exc:
        return f"not found: {exc}"


def cmd_doctor(args: argparse.Namespace) -> int:
    problems: list[str] = []
    tito_dir: Path | None = None
    try:
        import tito_renderers

        tito_dir = Path(tito_renderers.__file__).parent
        where = str(tito_dir)
    except ImportError as exc:  # a broken install: the message names what is missing
        where = "NOT importable"
        problems.append(str(exc).removeprefix("tito_renderers: "))
    problems += [str(p) for p in coexist.problems(hashes=True) if str(p) not in problems]
    pypi, import_problems = _pypi_renderers(tito_dir)
    problems += [] if problems else import_problems  # a damaged install is already reported, with its fix
    rows = [
        ("tito", f"{_version('tito')} ({Path(__file__).resolve().parent.parent})"),
        ("tito_renderers", where),
        ("renderers (PyPI)", pypi),
        *((name, _version(name)) for name in ("torch", "transformers", "tokenizers", "ray")),
        ("fixtures", _fixtures()),
        ("default model", _default_model()),
    ]
    for key, value in rows:
        print(f"{key:<17} {value}")
    for problem in problems:
        print(f"CONFLICT: {problem}")
    print("ok: tito and PyPI renderers coexist" if not problems else
          f"{len(problems)} conflict{'s' if len(problems) > 1 else ''} (docs/renderers.md, 'Installing next to PyPI renderers')")
    return CONFLICT if problems else OK


def register(sub) -> None:
    doctor = sub.add_parser("doctor", help="report versions and import locations; exit 1 on a conflict with PyPI renderers")
    doctor.set_defaults(func=cmd_doctor)
