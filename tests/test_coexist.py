"""tito next to the PyPI distribution ``renderers`` (0.1.12; verifiers depends on it), installed for real.

Each case is a fresh virtual environment where pip installs tito (a wheel built from this tree, or an editable
install of a copy of it) and the PyPI ``renderers`` wheel into one site-packages, in a given order. What they
need besides (transformers, tokenizers, ...; PyPI renderers' openai 2.x, openai-harmony, ...) comes from a cached
venv (tests/_support.cached_venv) and this interpreter's site-packages through a ``.pth`` file, the way
``--system-site-packages`` inherits a base interpreter's. In every case both libraries are imported and used on a
real fixture tokenizer and checked against transformers' ``apply_chat_template``, and ``tito doctor``'s exit
status is checked. The merged-folder case is built the way an old tito made it: a tito wheel that installs the
same source directory as top-level ``renderers`` (this tree with the old packaging; that code is never run).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ._support import REPO, cached_venv, reference, tokenizer_dir, venv_site

RENDERERS_PYPI = "0.1.12"
# openai 3.x depends on httpx2, while renderers 0.1.12's client imports httpx (undeclared): pin openai 2.x
DEPS_REQUIREMENTS = [f"renderers=={RENDERERS_PYPI}", "openai>=1.108.1,<3"]
FIXTURE = "qwen3-0.6b"  # a template both libraries render with a hand-coded renderer
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And times 4?"},
]
# Run inside a case venv: both libraries, each rendering MESSAGES with its own tokenizer loader.
PROBE = """
import json, sys, warnings
messages, tokenizer = json.loads(sys.argv[1]), sys.argv[2]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import tito_renderers
    import renderers
    from renderers.base import load_tokenizer
ours = tito_renderers.create_renderer(tito_renderers.load_tokenizer(tokenizer))
theirs = renderers.create_renderer(load_tokenizer(tokenizer), renderers.Qwen3RendererConfig())
print(json.dumps({
    "tito": ours.render(messages, add_generation_prompt=True).token_ids, "tito_file": tito_renderers.__file__,
    "pypi": theirs.render_ids(messages, add_generation_prompt=True), "pypi_file": renderers.__file__,
    "pypi_version": renderers.__version__, "pypi_renderer": type(theirs).__name__,
    "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
}))
"""


def _python_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _deps_venv() -> Path:
    """PyPI renderers' dependencies without renderers itself (each case installs it in its own order), and its wheel."""

    def prepare(root: Path) -> None:
        pip = [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python")]
        subprocess.run([*pip, "uninstall", "-q", "-y", "renderers"], check=True, capture_output=True)
        subprocess.run([*pip, "download", "-q", "--no-deps", f"renderers=={RENDERERS_PYPI}", "-d", str(root / "wheels")],
                       check=True, capture_output=True)

    # the venv's .pth names this interpreter's site-packages: a cache per interpreter
    key = f"coexist-renderers-{RENDERERS_PYPI}-{hashlib.sha256(repr(_site_dirs()).encode()).hexdigest()[:12]}"
    return cached_venv(key, DEPS_REQUIREMENTS, inherit=_site_dirs(), prepare=prepare)


def _site_dirs() -> list[Path]:
    """This interpreter's site-packages directories (its venv's, and any that one inherits)."""
    return [Path(p) for p in sys.path if Path(p).name == "site-packages"]


class Venv:
    """A fresh venv whose own site-packages pip fills; it sees ``inherit`` after its own."""

    def __init__(self, root: Path, inherit: list[Path]):
        self.root, self.python = root, root / "bin" / "python"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
        self.site = venv_site(root)
        (self.site / "_inherit.pth").write_text("".join(f"{p}\n" for p in inherit))

    def pip(self, *args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.python), *args, "-q", "--no-index",
                               "--no-deps", "--no-compile"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout + done.stderr

    def probe(self, cwd: Path, *, isolated: bool = True) -> dict:
        # -I: neither the working directory nor PYTHON* variables put anything on sys.path; without it, `-c`
        # puts the working directory first (a checkout's renderers/ directory then comes before site-packages)
        flags = ["-I"] if isolated else []
        done = subprocess.run([str(self.python), *flags, "-c", PROBE, json.dumps(MESSAGES), str(tokenizer_dir(FIXTURE))],
                              capture_output=True, text=True, timeout=300, cwd=cwd, env=_python_env())
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def doctor(self, cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.root / "bin" / "tito"), "doctor"], capture_output=True, text=True, timeout=300,
                              cwd=cwd, env=_python_env())


def _copy_tree(dest: Path) -> Path:
    """The installable part of this working tree (what `pip install .` reads)."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for name in ("renderers", "rollout", "actors"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def _old_packaging(tree: Path) -> Path:
    """The tree packaged as tito was before the rename: `renderers/` installed as top-level `renderers`."""
    text = (tree / "pyproject.toml").read_text()
    text = re.sub(r'^version = "', 'version = "0.0.1"  # was "', text, count=1, flags=re.M)  # an older release
    # drop today's [tool.setuptools] tables (the package list and its renaming) for the old packages.find
    text = re.sub(r"^\[tool\.setuptools(\.package-data)?\]\n(.*\n)*?(?=^\[|\Z)", "", text, flags=re.M)
    assert "package-dir" not in text and "[tool.setuptools]" not in text
    text += ('\n[tool.setuptools.packages.find]\ninclude = ["renderers*", "rollout*", "actors*"]\n'
             '\n[tool.setuptools.package-data]\nrenderers = ["templates/*.jinja"]\n')
    (tree / "pyproject.toml").write_text(text)
    return tree


def _build_wheel(tree: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                           str(tree), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("tito-*.whl")
    return wheel


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The cached dependencies, the PyPI renderers wheel, and tito wheels built from this tree (new and old packaging)."""
    deps = _deps_venv()
    (pypi_wheel,) = (deps / "wheels").glob(f"renderers-{RENDERERS_PYPI}-*.whl")
    tmp = tmp_path_factory.mktemp("coexist")
    tito_wheel = _build_wheel(_copy_tree(tmp / "tree"), tmp / "wheels")
    old_wheel = _build_wheel(_old_packaging(_copy_tree(tmp / "old-tree")), tmp / "old-wheels")
    inherit = [venv_site(deps), *_site_dirs()]
    return {"pypi": pypi_wheel, "tito": tito_wheel, "old": old_wheel, "inherit": inherit,
            "wheels": pypi_wheel.parent}


def hf_ids() -> list[int]:
    hf = reference(FIXTURE)
    return hf(hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]


def check_both_work(out: dict, site: Path | None = None) -> None:
    expected = hf_ids()
    assert out["tito"] == expected, "tito_renderers does not render as apply_chat_template"
    assert out["pypi"] == expected, "PyPI renderers does not render as apply_chat_template"
    assert out["pypi_version"] == RENDERERS_PYPI and out["pypi_renderer"] == "Qwen3Renderer"
    if site is not None:
        assert Path(out["pypi_file"]) == site / "renderers" / "__init__.py"
        assert Path(out["tito_file"]) == site / "tito_renderers" / "__init__.py"
    assert not out["warnings"], out["warnings"]


def owned(site: Path, dist: str, top: str) -> set[str]:
    """The files a distribution's RECORD lists under a top-level folder."""
    (record,) = site.glob(f"{dist}-*.dist-info/RECORD")
    return {line.split(",")[0] for line in record.read_text().splitlines() if line.startswith(top + "/")}


@pytest.mark.slow
@pytest.mark.parametrize("order", [("pypi", "tito"), ("tito", "pypi")], ids=["renderers-then-tito", "tito-then-renderers"])
def test_both_install_orders_coexist(env, order, tmp_path):
    venv = Venv(tmp_path / "venv", env["inherit"])
    for what in order:
        venv.pip("install", str(env[what]))
    assert not owned(venv.site, "tito", "renderers"), "tito installs files into PyPI renderers' folder"
    assert owned(venv.site, "tito", "tito_renderers") and owned(venv.site, "renderers", "renderers")
    check_both_work(venv.probe(tmp_path), venv.site)
    if order[0] == "pypi":  # one doctor run is enough for the no-conflict report (the other order is the same code)
        doctor = venv.doctor(tmp_path)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert f"renderers (PyPI)  {RENDERERS_PYPI} importable from {venv.site / 'renderers'}" in doctor.stdout
        assert f"tito_renderers    {venv.site / 'tito_renderers'}" in doctor.stdout


@pytest.mark.slow
def test_editable_checkout_next_to_pypi_renderers(env, tmp_path):
    """`pip install -e .` (what the Makefile does) into a venv that has PyPI renderers, used from inside the
    checkout, where the working directory's renderers/ comes first on sys.path: it hands over to PyPI renderers."""
    checkout = _copy_tree(tmp_path / "checkout")
    venv = Venv(tmp_path / "venv", env["inherit"])
    venv.pip("install", str(env["pypi"]))
    venv.pip("install", "--no-build-isolation", "-e", str(checkout))
    out = venv.probe(checkout, isolated=False)
    check_both_work(out)
    assert Path(out["tito_file"]) == checkout / "renderers" / "__init__.py"
    assert Path(out["pypi_file"]) == venv.site / "renderers" / "__init__.py"
    doctor = venv.doctor(checkout)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr


@pytest.mark.slow
def test_a_merged_install_is_refused_then_repaired(env, tmp_path):
    # an old tito and PyPI renderers in one folder: the last install overwrote __init__.py, base.py, deepseek_v3.py
    merged = Venv(tmp_path / "merged", env["inherit"])
    merged.pip("install", str(env["old"]))
    merged.pip("install", str(env["pypi"]))
    shared = owned(merged.site, "tito", "renderers") & owned(merged.site, "renderers", "renderers")
    assert "renderers/__init__.py" in shared

    # a new tito that sees that folder (a venv on top of it) imports from its own folder, silently (the import
    # scans no RECORD files); `tito doctor` names both distributions, the folder and the fix
    above = Venv(tmp_path / "above", [merged.site, *env["inherit"]])
    above.pip("install", str(env["tito"]))
    probe = "import tito_renderers; print(tito_renderers.__file__)"
    done = subprocess.run([str(above.python), "-I", "-W", "error::RuntimeWarning", "-c", probe], capture_output=True,
                          text=True, cwd=tmp_path, env=_python_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()) == above.site / "tito_renderers" / "__init__.py"
    doctor = above.doctor(tmp_path)
    assert doctor.returncode == 1 and "CONFLICT: tito 0.0.1" in doctor.stdout, doctor.stdout + doctor.stderr
    assert f"PyPI renderers {RENDERERS_PYPI} share the folder {merged.site / 'renderers'}" in doctor.stdout
    assert f"Fix: pip uninstall -y tito renderers && pip install tito renderers=={RENDERERS_PYPI}" in doctor.stdout

    # upgrading tito in the merged venv: pip removes the old tito's files, the shared ones included
    merged.pip("install", str(env["tito"]))
    assert not (merged.site / "renderers" / "__init__.py").exists()
    doctor = merged.doctor(tmp_path)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    (conflict,) = [line for line in doctor.stdout.splitlines() if line.startswith("CONFLICT: ")]
    assert "renderers/__init__.py" in conflict and f"PyPI renderers {RENDERERS_PYPI} at" in conflict
    fix = conflict.split(" Fix: ")[1]
    assert fix == f"pip install --force-reinstall --no-deps renderers=={RENDERERS_PYPI}"

    # the printed fix (from the cached wheel instead of the index) repairs it
    merged.pip(*fix.split()[1:], "--find-links", str(env["wheels"]))
    doctor = merged.doctor(tmp_path)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    check_both_work(merged.probe(tmp_path), merged.site)


def test_an_uninstalled_source_tree_runs_with_the_staged_renderer_package(env, tmp_path):
    """A copy of the tree that is not installed (a Ray job's working_dir) in a venv without tito: it has no
    `tito_renderers` of its own (no hidden fallback); with the copy scripts/launch_rollouts.py stages for
    the job's py_modules on PYTHONPATH, as Ray puts it there, rollout imports and uses that copy."""
    tree = _copy_tree(tmp_path / "working_dir")
    venv = Venv(tmp_path / "venv", env["inherit"])
    code = ("import tito_renderers, rollout.models\n"
            "print(tito_renderers.__file__, tito_renderers.create_renderer.__module__)\n")
    bare = subprocess.run([str(venv.python), "-c", code], capture_output=True, text=True, timeout=300, cwd=tree,
                          env=_python_env())
    assert bare.returncode == 1 and "No module named 'tito_renderers'" in bare.stderr, bare.stderr[-3000:]
    launch = runpy.run_path(str(REPO / "scripts" / "launch_rollouts.py"))
    staged = launch["stage_renderers"](tmp_path / "stage")
    assert staged.name == "tito_renderers"
    done = subprocess.run([str(venv.python), "-c", code], capture_output=True, text=True, timeout=300, cwd=tree,
                          env={**_python_env(), "PYTHONPATH": str(staged.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(staged / "__init__.py"), "tito_renderers.registry"]


def test_the_checkout_name_renderers_without_pypi_renderers_is_refused(tmp_path):
    """Inside this checkout `import renderers` reaches the source directory: without PyPI renderers it raises an
    ImportError naming `tito_renderers` (no second copy of tito's classes under another name), and leaves
    nothing behind in sys.modules, so `tito_renderers` still imports."""
    code = ("import json, sys\n"
            "try:\n"
            "    import renderers\n"
            "    error = None\n"
            "except ImportError as exc:\n"
            "    error = str(exc)\n"
            "left = sorted(m for m in sys.modules if m == 'renderers' or m.startswith('renderers.'))\n"
            "import tito_renderers\n"
            "print(json.dumps([error, left, tito_renderers.Break.__module__]))")
    from importlib import metadata

    if list(metadata.distributions(name="renderers")):
        pytest.skip("PyPI renderers is installed here: `import renderers` means it (test_editable_checkout_...)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=_python_env())
    assert done.returncode == 0, done.stderr[-2000:]
    error, left, break_module = json.loads(done.stdout)
    assert error and error.startswith(f"`import renderers` found tito's source directory {REPO / 'renderers'}"), error
    assert "imported as `tito_renderers`" in error
    assert left == [] and break_module == "tito_renderers.types"


def test_no_module_of_this_repository_imports_the_old_name():
    """tito's own code imports `tito_renderers`: the name `renderers` is the PyPI library's (strings, such as the
    PyPI client script in test_serve_embedded.py, are not imports)."""
    found = []
    for path in sorted(REPO.glob("*.py")) + sorted(p for d in ("renderers", "rollout", "actors", "scripts", "tests")
                                                   for p in (REPO / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            if any(n == "renderers" or n.startswith("renderers.") for n in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"import tito_renderers (not renderers) in: {', '.join(found)}"


def test_every_package_directory_is_installed():
    """pyproject.toml lists the packages by hand (``packages.find`` cannot install ``renderers/`` as
    ``tito_renderers``): every directory with an ``__init__.py`` under renderers/, rollout/ and actors/
    must be in that list under its installed name, or a wheel would silently leave it out."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    rename = {source: name for name, source in setuptools["package-dir"].items()}
    found = set()
    for top in ("renderers", "rollout", "actors"):
        for init in (REPO / top).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO).parts
            found.add(".".join([rename.get(parts[0], parts[0]), *parts[1:]]))
    assert found == set(setuptools["packages"])
