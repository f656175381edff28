"""tito's rollout runtime: configs, engines, environments, the loop, shards, serving and the ``tito`` command."""

import importlib.abc as _abc
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

# The renderer library is installed as `tito_renderers` from the `renderers/` directory (pyproject.toml). A source tree
# that is used without being installed -- a Ray job's uploaded working_dir -- has no directory of that name, so the
# name is mapped to the sibling directory here, as a last resort after every installed package.
_SOURCE = _Path(__file__).resolve().parent.parent / "renderers"


class _SourceTreeRenderers(_abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "tito_renderers":
            return None
        return _util.spec_from_file_location(name, _SOURCE / "__init__.py", submodule_search_locations=[str(_SOURCE)])


if (_SOURCE / "_toplevel.py").is_file() and not any(isinstance(f, _SourceTreeRenderers) for f in _sys.meta_path):
    _sys.meta_path.append(_SourceTreeRenderers())  # `_toplevel.py` is tito's: never PyPI renderers' folder
