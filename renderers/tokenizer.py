"""Loading a tokenizer and its chat template from local files, with the two encodings a renderer needs.

``load_tokenizer(path)`` accepts a Hugging Face tokenizer directory (tokenizer.json, or vocab.json +
merges.txt; the template from chat_template.jinja, tokenizer_config.json or chat_template.json) or a
GGUF file (template from the ``tokenizer.chat_template`` metadata). Nothing is fetched from a hub.

Loading goes through transformers so that tito tokenizes exactly like the reference it is tested
against; the result keeps only the fast ``tokenizers`` backend. A GGUF file's tokenizer is converted
once (several seconds) and cached under ``$TITO_CACHE`` (default ``~/.cache/tito``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import tempfile
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer

from .fast_encode import FastEncoder, library_encode


class TokenizerLoadError(ValueError):
    """The path holds no usable tokenizer; the text says what is missing."""


def cache_dir() -> Path:
    return Path(os.environ.get("TITO_CACHE") or Path.home() / ".cache" / "tito")


class Tokenizer:
    """A fast tokenizer plus what rendering needs: the chat template, added tokens and stop tokens.

    ``encode`` behaves like transformers with ``add_special_tokens=False``: added-token strings in the
    text become their ids. ``encode_plain`` never produces an added-token id: text that came from a
    message is encoded with it, so a message that quotes ``<|im_end|>`` cannot forge a turn.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None,
        name_or_path: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self.bos_token = bos_token
        self.eos_token = eos_token
        decoder = backend.get_added_tokens_decoder()
        self.added_tokens: dict[str, int] = {tok.content: idx for idx, tok in decoder.items()}
        self.added_token_flags = {tok.content: (tok.lstrip, tok.rstrip) for tok in decoder.values()}
        self.special_ids = frozenset(self.added_tokens.values())
        eos_id = self.added_tokens.get(eos_token) if eos_token else None
        self.eos_token_ids = tuple(dict.fromkeys([*([eos_id] if eos_id is not None else []), *eos_token_ids]))
        plain = json.loads(backend.to_str())
        plain["added_tokens"] = []
        _untrim_offsets(plain)  # offsets cover a token's whole text, in both encode paths
        self._plain = BackendTokenizer.from_str(json.dumps(plain))
        pattern = "|".join(re.escape(t) for t in sorted(self.added_tokens, key=len, reverse=True))
        self._added_re = re.compile(pattern) if pattern else None

    def with_chat_template(self, chat_template: str, name_or_path: str | None = None) -> Tokenizer:
        """The same tokenizer (shared, not rebuilt) with another chat template: for a template file
        shipped apart from its tokenizer, or a local variant of a model's template."""
        other = copy.copy(self)
        other.__dict__.pop("template_sha256", None)
        other.__dict__.pop("text_view", None)
        other.chat_template = chat_template
        other.name_or_path = name_or_path or self.name_or_path
        return other

    @cached_property
    def template_sha256(self) -> str | None:
        if self.chat_template is None:
            return None
        return hashlib.sha256(self.chat_template.encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int:
        """The id of an added (special) token; raises ``KeyError`` naming it when the vocabulary lacks it."""
        try:
            return self.added_tokens[token]
        except KeyError:
            raise KeyError(f"{self.name_or_path}: the vocabulary has no added token {token!r}") from None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        return self.encode_plain_with_ends(text)[0]

    def encode_plain_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """Ids, and for each token the character offset where it ends (non-decreasing; a token
        spans from the previous token's end to its own). fastokens encodes where its ids are the
        tokenizers library's (renderers/fast_encode.py), the library itself otherwise."""
        fast = self.fast_encoder
        if fast is not None:
            return fast.encode(text)
        return library_encode(self._plain, text)

    def encode_plain_ids(self, text: str) -> list[int]:
        """The ids of ``encode_plain_with_ends``, without the end offsets."""
        fast = self.fast_encoder
        if fast is not None:
            return fast.ids(text)
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def fast_encoder(self) -> FastEncoder | None:
        """The fastokens encoder for this tokenizer's plain text, built at first use (a few seconds for a
        large vocabulary) and shared by its copies; None where it does not reproduce the library's ids."""
        entry = _FAST.get(id(self._plain))
        if entry is None or entry[0] is not self._plain:
            entry = _FAST[id(self._plain)] = (self._plain, FastEncoder.for_backend(self._plain))
        return entry[1]

    @cached_property
    def markers(self) -> dict[str, int]:
        """The added tokens that structure a conversation, which message text must never produce: all of
        them, except in a vocabulary that also has added tokens for ordinary text (SentencePiece
        user-defined symbols made of whitespace or ``▁`` only, as in Gemma's newline and space runs,
        next to its HTML tags); there, only the control tokens (flagged ``special``)."""
        decoder = self.backend.get_added_tokens_decoder()
        text_level = any(not t.special and t.content and not t.content.replace("▁", " ").strip() for t in decoder.values())
        if not text_level:
            return dict(self.added_tokens)
        return {t.content: i for i, t in decoder.items() if t.special}

    @cached_property
    def text_view(self) -> Tokenizer:
        """This tokenizer with "message text" meaning what it means to the model: where some added tokens
        are ordinary text (see :attr:`markers`), plain text is split on them exactly as transformers does,
        and only the markers are refused; elsewhere ``self``. The view shares ids, decoding and the chat
        template. Plain runs are encoded by a backend that keeps the non-marker added tokens, and scaffold
        text is split on markers only, so a template's ``"\n"`` and the message text next to it form one
        run, as in the reference (``"\n" + "\n..."`` is Gemma's added token ``"\n\n"``)."""
        markers = self.markers
        if len(markers) == len(self.added_tokens):
            return self
        config = json.loads(self.backend.to_str())
        config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] not in markers]
        view = copy.copy(self)
        view.__dict__.pop("text_view", None)
        view._plain = _text_backend(self.backend, config)
        ordered = sorted(markers, key=len, reverse=True)  # longest first, as the tokenizer matches
        view._added_re = re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None
        view.text_view = view
        return view

    def split_added(self, text: str) -> list[str | int]:
        """Split scaffold text on added-token strings: text runs stay str, added tokens become ids."""
        if self._added_re is None:
            return [text] if text else []
        out: list[str | int] = []
        pos = 0
        for m in self._added_re.finditer(text):
            if m.start() > pos:
                out.append(text[pos : m.start()])
            out.append(self.added_tokens[m.group()])
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_runs(self, ids: list[int]) -> str:
        """``ids`` decoded one run between added tokens at a time, the added tokens kept. Equal to
        :meth:`decode` except where the decoder takes off a prefix the encoder puts on each run: a
        SentencePiece tokenizer whose dummy prefix ("▁") starts every text between added tokens
        (Mistral's and Llama 2's ``legacy`` tokenizers) reads ``[INST]▁▁What`` as ``[INST]  What`` in
        one decode, the text of other ids than these; run by run it reads ``[INST] What``."""
        out, run = [], []
        for i in ids:
            if i in self.special_ids:
                if run:
                    out.append(self.backend.decode(run, skip_special_tokens=False))
                    run = []
                out.append(self.backend.decode([i], skip_special_tokens=False))
            else:
                run.append(i)
        if run:
            out.append(self.backend.decode(run, skip_special_tokens=False))
        return "".join(out)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab={self.vocab_size}, template={self.template_sha256 and self.template_sha256[:16]})"


# plain backend id -> (plain backend, its fastokens encoder or None); the entry holds its backend so that
# the id is never reused
_FAST: dict[int, tuple[BackendTokenizer, FastEncoder | None]] = {}

# backend id -> (backend, plain backend keeping the text-level added tokens): building one takes seconds
# (Gemma), and a template variant (with_chat_template) shares its backend. The entry holds its backend so
# that the id is never reused.
_TEXT_BACKENDS: dict[int, tuple[BackendTokenizer, BackendTokenizer]] = {}


def _text_backend(backend: BackendTokenizer, config: dict) -> BackendTokenizer:
    entry = _TEXT_BACKENDS.get(id(backend))
    if entry is None or entry[0] is not backend:
        entry = _TEXT_BACKENDS[id(backend)] = (backend, BackendTokenizer.from_str(json.dumps(config)))
    return entry[1]


def _from_transformers(hf, name_or_path: str, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    template = hf.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    return Tokenizer(
        hf.backend_tokenizer,
        chat_template=template,
        name_or_path=name_or_path,
        bos_token=hf.bos_token,
        eos_token=hf.eos_token,
        eos_token_ids=eos_token_ids,
    )


def _generation_eos_ids(directory: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def _load_directory(directory: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    if not any((directory / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer.model")):
        raise TokenizerLoadError(f"{directory}: no tokenizer.json, vocab.json + merges.txt or tokenizer.model found")
    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many types; name the path and the cause
        raise TokenizerLoadError(f"{directory}: transformers could not load the tokenizer: {exc}") from exc
    if getattr(hf, "backend_tokenizer", None) is None:
        raise TokenizerLoadError(f"{directory}: no fast (tokenizers) backend could be built")
    return _from_transformers(hf, str(directory), _generation_eos_ids(directory))


def gguf_tokenizer_dir(path: Path) -> Path:
    """The directory a GGUF file's tokenizer is converted into (transformers' conversion, once, in the cache):
    tokenizer.json, its config and the GGUF's chat template byte-exact."""
    from transformers import AutoTokenizer

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = cache_dir() / "tokenizers" / key
    if not (cached / "tokenizer.json").is_file():
        try:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        except Exception as exc:
            raise TokenizerLoadError(f"{path}: transformers could not read the GGUF tokenizer: {exc}") from exc
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f".{key}-"))
        hf.save_pretrained(str(tmp))
        if isinstance(hf.chat_template, str):  # keep the GGUF's template byte-exact next to the conversion
            (tmp / "chat_template.jinja").write_text(hf.chat_template, encoding="utf-8")
        try:
            tmp.rename(cached)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    return cached


def _load_gguf(path: Path) -> Tokenizer:
    tok = _load_directory(gguf_tokenizer_dir(path))
    tok.name_or_path = str(path)
    return tok


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer and its chat template from a local directory or GGUF file (never a hub)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p)
    if p.is_dir():
        return _load_directory(p)
    if p.exists():
        raise TokenizerLoadError(f"{p}: expected a tokenizer directory or a .gguf file")
    raise TokenizerLoadError(f"{p}: no such file or directory")


def _untrim_offsets(config: dict) -> None:
    for key in ("pre_tokenizer", "post_processor", "decoder"):
        stack = [config.get(key)]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if node.get("type") == "ByteLevel":
                    node["trim_offsets"] = False
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
