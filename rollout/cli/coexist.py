"""What ``tito doctor`` checks: tito next to the PyPI distribution ``renderers`` (verifiers depends on it).

tito's renderer package is installed as ``tito_renderers`` (from the ``renderers/`` source directory), so
``pip install tito renderers`` gives two packages in two folders. Releases before the rename installed a
top-level ``renderers`` package into PyPI renderers' folder. :func:`problems` reads the distributions'
RECORD files and names what such an install left behind:

- ``shared-folder``: a tito distribution and PyPI ``renderers`` own files in one ``renderers/`` folder
  (an old tito is still installed).
- ``damaged``: files PyPI ``renderers`` installed are missing or changed (what upgrading or uninstalling
  an old tito leaves).

Only ``tito doctor`` runs this: importing ``tito_renderers`` scans nothing (it never shares a folder).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PYPI_NAME = "renderers"  # the PyPI distribution and the import name it owns


@dataclass(frozen=True)
class Problem:
    kind: str  # "shared-folder" | "damaged"
    message: str
    fix: str  # one shell line

    def __str__(self) -> str:
        return f"{self.message}. Fix: {self.fix}"


def _owned(dist: metadata.Distribution, top: str) -> list[tuple[metadata.PackagePath, Path]]:
    """The files ``dist``'s RECORD lists under the top-level folder ``top``, with their absolute paths."""
    return [(f, Path(dist.locate_file(f))) for f in (dist.files or ()) if f.parts and f.parts[0] == top]


def _folder(owned: list[tuple[metadata.PackagePath, Path]]) -> Path | None:
    for f, path in owned:
        if len(f.parts) == 2:  # renderers/<file>: its parent is the package folder itself
            return path.parent.resolve()
    return None


def _changed(f: metadata.PackagePath, path: Path, hashes: bool) -> bool:
    """Whether an installed file is gone or differs from what its RECORD says (bytecode caches are skipped)."""
    if f.suffix == ".pyc" or f.size is None:
        return False  # pip records compiled files without a size or hash; a missing cache is harmless
    try:
        if path.stat().st_size != f.size:
            return True
        if hashes and f.hash is not None:
            digest = hashlib.new(f.hash.mode, path.read_bytes()).digest()
            return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != f.hash.value
    except OSError:
        return True
    return False


def problems(hashes: bool = False) -> list[Problem]:
    """What is wrong with PyPI ``renderers`` and tito in this environment (empty: they coexist)."""
    found: list[Problem] = []
    seen: set[Path] = set()
    for pypi in metadata.distributions(name=PYPI_NAME):
        owned = _owned(pypi, PYPI_NAME)
        folder = _folder(owned)
        if folder is None or folder in seen:  # a directory twice on sys.path yields its distributions twice
            continue
        seen.add(folder)
        version = pypi.version
        for tito in metadata.distributions(name="tito"):
            theirs = _owned(tito, PYPI_NAME)
            if _folder(theirs) == folder:
                found.append(Problem(
                    "shared-folder",
                    f"tito {tito.version} (a release that installed itself as top-level `renderers`) and PyPI "
                    f"renderers {version} share the folder {folder}: the last install overwrote the files both ship, "
                    "breaking the other library, and uninstalling either deletes them",
                    f"pip uninstall -y tito renderers && pip install tito renderers=={version}"))
                break
        changed = sorted(str(f) for f, path in owned if _changed(f, path, hashes))
        if changed and not any(p.kind == "shared-folder" for p in found):
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            found.append(Problem(
                "damaged",
                f"PyPI renderers {version} at {folder} is damaged: {shown} "
                f"{'is' if len(changed) == 1 else 'are'} missing or changed (what upgrading or uninstalling a tito "
                "release that installed into the same folder leaves behind)",
                f"pip install --force-reinstall --no-deps renderers=={version}"))
    return found
