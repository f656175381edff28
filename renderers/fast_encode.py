"""Plain-text encoding with fastokens (PyPI), where its ids are the ``tokenizers`` library's ids.

fastokens is a Rust BPE encoder that reads the same tokenizer.json and measures 16-66x faster than
the tokenizers library on the fixture vocabularies. It gives ids only (no offsets), so each token's
end offset comes from the vocabulary: for each id, how many characters start in the bytes it
decodes to (the bytes that are not UTF-8 continuation bytes), summed over the tokens so far. A token
that ends inside a character thus ends where that character does, as the tokenizers library
reports it; the bytes each id decodes to, summed, must be the text's.

When it is used (:meth:`FastEncoder.for_backend`), by rule and by measurement:

* the rule: a BPE model without dropout; a byte-level vocabulary (every token character is one byte)
  or a SentencePiece one with byte fallback (``▁`` is a space, ``<0xAB>`` one byte); no normalizer,
  NFC, or SentencePiece's space replacement; no pre-tokenizer step that adds text (a prefix space);
* the measurement, at first use: ids and end offsets equal to the tokenizers library's on a fixed
  battery of texts (ASCII, code, whitespace runs, many scripts, emoji sequences, combining marks).

Otherwise the tokenizers library encodes. Per text, too: text that NFC would change (for an NFC
vocabulary), text fastokens refuses (a byte the vocabulary has no token for), an unknown-token id, or
byte lengths that do not add up to the text's is encoded by the tokenizers library instead.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence
from itertools import accumulate
from operator import itemgetter
from typing import Any

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer

# The parity battery a vocabulary must pass before fastokens encodes for it.
BATTERY = (
    "",
    "Hello, world! It's 2026-12-01; x=3.14, y=-42.",
    "def f(x):\n\treturn {'a': [1, 2, 3]}  # done\r\n",
    "   leading and trailing   \n\n\n  \t\t  \r\n\r\n      ",
    "I'm you're we'll they'd it's AREN'T 'quoted' \"double\"",
    "Ünïcödé naïve café façade Ångström ß ẞ İstanbul",
    "数据科学 東京タワー 서울 привет мир γειά σου مرحبا بالعالم שלום עולם हिन्दी ไทย",
    "🙂 👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇩🇪 ❤️ 🤖🤖🤖",
    "e\u0301 a\u0308 \u212b \ufb01 ｈｅｌｌｏ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ①②③ ½ ²",
    "\x00\x01\x1b[31m\x7f \u200b\u200d\u2028\u00a0\u3000 \ufeff",
    "1234567890 12,345.678 ٣٤٥ 一二三",
    "<|im_end|> <think> </s> [INST] <0x41> ▁▁ ▁x",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa " * 4 + "\n" * 9 + " " * 17,
    "mixed 数据 and emoji 🙂 then code `x += 1` and \t\ttabs\n",
)


def _steps(node: Any) -> list[dict]:
    """Every component of a pipeline part, Sequences flattened."""
    if not isinstance(node, dict):
        return []
    out = [node]
    for key in ("pretokenizers", "normalizers", "decoders"):
        for child in node.get(key) or []:
            out.extend(_steps(child))
    return out


def _kind(config: dict) -> str | None:
    """"byte_level", "sentencepiece" or None (fastokens is not used) for a tokenizer.json."""
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return None
    decoders = {s.get("type") for s in _steps(config.get("decoder"))}
    pre = _steps(config.get("pre_tokenizer"))
    if any(s.get("type") == "Metaspace" or s.get("add_prefix_space") for s in pre if s.get("type") != "Split"):
        return None  # adds text the input does not have
    normalizers = [s for s in _steps(config.get("normalizer")) if s.get("type") != "Sequence"]
    if "ByteLevel" in decoders and not model.get("byte_fallback"):
        kind = "byte_level"
    elif {"Replace", "ByteFallback"} <= decoders and model.get("byte_fallback"):
        kind = "sentencepiece"
    else:
        return None
    for n in normalizers:
        space = n.get("type") == "Replace" and n.get("pattern") == {"String": " "} and n.get("content") == "\u2581"
        if not (n.get("type") == "NFC" or (space and kind == "sentencepiece")):
            return None
    return kind


def _byte_to_unicode() -> dict[str, int]:
    """GPT-2's map from each byte to the character a byte-level vocabulary writes it as, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def _byte_lengths(config: dict, kind: str) -> tuple[np.ndarray, np.ndarray, int | None]:
    """Bytes of text each id stands for (-1: unknown), how many characters start in those bytes (the
    bytes that are not UTF-8 continuation bytes), and the unknown token's id."""
    vocab: dict[str, int] = config["model"]["vocab"]
    size = max([*vocab.values(), *(t["id"] for t in config.get("added_tokens") or [])], default=-1) + 1
    lengths = np.full(size, -1, dtype=np.int64)
    starts = np.zeros(size, dtype=np.int64)
    to_byte = _byte_to_unicode()
    for token, i in vocab.items():
        if kind == "byte_level":
            lengths[i] = len(token)  # one character per byte (GPT-2's byte-to-unicode map)
            starts[i] = sum(1 for ch in token if (to_byte.get(ch, 0) & 0xC0) != 0x80)
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            lengths[i] = 1
            starts[i] = (int(token[3:5], 16) & 0xC0) != 0x80
        else:
            text = token.replace("\u2581", " ")
            lengths[i] = len(text.encode("utf-8"))
            starts[i] = len(text)
    for t in config.get("added_tokens") or []:
        content = t["content"]
        if kind == "sentencepiece" and t.get("normalized", True):
            content = content.replace("\u2581", " ")
        lengths[t["id"]] = len(content.encode("utf-8"))
        starts[t["id"]] = len(content)
    unk = config["model"].get("unk_token")
    unk_id = vocab.get(unk) if unk else None
    if unk_id is not None:
        lengths[unk_id] = -1
    return lengths, starts, unk_id


# below this many tokens a run's end offsets are all computed (a walk from both ends saves nothing)
_EXACT_BELOW = 24


def library_encode(plain: BackendTokenizer, text: str) -> tuple[list[int], list[int]]:
    """The tokenizers library's ids and token end offsets (the reference)."""
    enc = plain.encode(text, add_special_tokens=False)
    return enc.ids, [end for _, end in enc.offsets]


class FastEncoder:
    """fastokens ids, with end offsets from byte lengths (see the module docstring)."""

    def __init__(self, plain: BackendTokenizer, source: str, config: dict, kind: str) -> None:
        import fastokens

        self._plain = plain
        self._fast = fastokens.Tokenizer.from_json_str(source)
        self._nfc = any(s.get("type") == "NFC" for s in _steps(config.get("normalizer")))
        self._byte_level = kind == "byte_level"
        lengths, starts, self._unk = _byte_lengths(config, kind)
        self._lengths_np = lengths
        self._lengths = lengths.tolist()
        self._starts_np = starts
        self._starts = starts.tolist()

    @property
    def plain(self) -> BackendTokenizer:
        """The tokenizers library's plain backend this encoder stands for (the fallback)."""
        return self._plain

    @property
    def nfc(self) -> bool:
        """The vocabulary normalizes to NFC: text NFC would change is the tokenizers library's to encode."""
        return self._nfc

    @property
    def lengths_np(self) -> np.ndarray:
        """Bytes of text each id stands for, -1 for the unknown token (and ids no token has)."""
        return self._lengths_np

    @property
    def starts_np(self) -> np.ndarray:
        """How many characters start in the bytes each id stands for: summed over a text's tokens up to
        token i, the characters before token i's end, a character split over tokens ending with the
        token that holds its first byte (the tokenizers library's offsets)."""
        return self._starts_np

    def flat(self, texts: list[str]) -> tuple[bytes, bytes]:
        """Each text's fastokens ids, as :meth:`ids` without its fallbacks, in one call: the ids of all
        texts as little-endian uint32 bytes and ``len(texts) + 1`` uint64 token offsets. Raises
        ``ValueError`` where fastokens refuses a text. One call with no per-token Python objects is
        what makes a long render's encoding cheap; the caller checks the byte lengths add up."""
        return self._fast.encode_batch_flat(texts)

    def joined(self, texts: list[str]) -> list[int]:
        """The ids of :meth:`flat`, all texts' concatenated, from one call that encodes them in this
        thread. ``encode_batch_flat`` hands a batch to a thread pool: waking it cost 10-60 us a call
        here (2 busy cores; it varies with load, scripts/bench_render_stages.py), as much as encoding a
        10-turn render's runs takes; the caller finds where each text's ids end from their byte lengths."""
        return self._fast.encode_segments([(text, False) for text in texts]).ids

    @classmethod
    def for_backend(cls, plain: BackendTokenizer) -> FastEncoder | None:
        """The encoder for this plain backend, or None where the rule or the battery says no."""
        try:
            import fastokens  # noqa: F401
        except ImportError:  # a dependency, but an encoder must never be what breaks loading
            return None
        source = plain.to_str()
        config = json.loads(source)
        kind = _kind(config)
        if kind is None:
            return None
        try:
            encoder = cls(plain, source, config, kind)
        except Exception:  # fastokens rejects this tokenizer.json: the library encodes
            return None
        if any(encoder.encode(text) != library_encode(plain, text) for text in BATTERY):
            return None
        return encoder

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """Ids and each token's end offset, as ``Tokenizer.encode_plain_with_ends``."""
        ids = self.try_ids(text)
        ends = None if ids is None else self.ends_at(ids, text, ())  # no spans: every end exact
        if ends is None:
            return library_encode(self._plain, text)
        return ids, ends  # type: ignore[return-value]

    def ids(self, text: str) -> list[int]:
        """The ids of :meth:`encode`, without computing the end offsets."""
        ids = self.try_ids(text)
        return ids if ids is not None else self._plain.encode(text, add_special_tokens=False).ids

    def ends_at(self, ids: list[int], text: str, span_ends: Sequence[int]) -> list[int] | None:
        """End offsets of ``text``'s tokens ``ids`` (fastokens' own, from :meth:`try_ids`) good for
        attributing them to spans that end at ``span_ends`` (characters, increasing, the last one
        ``len(text)``), or None where the ids' byte lengths do not add up to the text's (the tokenizers
        library must encode it).

        Exact for every token that ends in a span other than the longest one, or crosses into or out of
        it. In a long run, the tokens wholly inside its longest span (a message's text between two
        scaffold strings) all get one value strictly inside that span instead: every ``bisect`` on the
        other spans' ends stays exact, and no Python runs per token there. A byte-level vocabulary's
        ids from fastokens are a segmentation of the text's bytes, so a long run's ends are found from
        both ends of it; a SentencePiece vocabulary's are checked against the text's length first (its
        ``▁`` stands for a space: text holding ``▁`` itself does not add up)."""
        n = len(ids)
        if not n:
            return [] if not text else None
        if self._unk is not None and self._unk in ids:
            return None  # the unknown token's length is not its text's
        ascii_text = text.isascii()
        table = self._lengths if ascii_text else self._starts  # characters per token (see starts_np)
        total = len(text)
        exact = n < _EXACT_BELOW or len(span_ends) < 2
        if exact or not self._byte_level:
            per = self._counts(ids, text, table, ascii_text)
            if per is None:
                return None
            if exact:
                return list(accumulate(per))
        longest, start_l, end_l, prev = 0, 0, 0, 0
        for end in span_ends:
            if end - prev > longest:
                longest, start_l, end_l = end - prev, prev, end
            prev = end
        ends = [0] * n
        f, cum = 0, 0  # exact from the front, through the first token that ends past the longest span's start
        while f < n:
            cum += table[ids[f]]
            ends[f] = cum
            f += 1
            if cum > start_l:
                break
        g, cum = n - 1, total  # exact from the back, down to the last token that ends at or past its end
        while g >= f and cum >= end_l:
            ends[g] = cum
            cum -= table[ids[g]]
            g -= 1
        if g >= f:  # tokens f..g end strictly inside the longest span
            fill = ends[f - 1]
            if not start_l < fill < end_l:  # ids that do not segment the text: the library decides
                return None
            ends[f : g + 1] = [fill] * (g + 1 - f)
        return ends

    def edges(self, ids: list[int], text: str, head: int, tail: int) -> tuple[int, int] | None:
        """For ``text`` made of a head (its first ``head`` characters), a middle and a tail (from
        character ``tail`` on, ``head < tail``): how many of its tokens ``ids`` (fastokens' own) cover
        head characters only and how many tail characters only, or None where the byte lengths do not
        add up. A token that completes a character split over tokens counts with the character it
        completes. Walks the tokens from both ends of the text, never the middle; as in :meth:`ends_at`,
        a byte-level vocabulary's ids are taken to segment the text's bytes (whatever their number) and a
        SentencePiece one's are checked against the text's length first."""
        n = len(ids)
        if not n or (self._unk is not None and self._unk in ids):
            return None
        ascii_text = text.isascii()
        table = self._lengths if ascii_text else self._starts
        total = len(text)
        if not self._byte_level and self._counts(ids, text, table, ascii_text) is None:
            return None
        a, cum = 0, 0
        while a < n:
            cum += table[ids[a]]
            if cum > head:
                break
            a += 1  # token a ends at or before the head's end
        b, cum = 0, total
        while b < n - a:
            width = table[ids[n - 1 - b]]
            if cum - width < tail or cum == tail:  # starts before the tail, or completes its last character before it
                break
            cum -= width
            b += 1
        return a, b

    def try_ids(self, text: str) -> list[int] | None:
        """fastokens' ids for ``text``, or None where the tokenizers library must encode it: NFC would
        change the text (an NFC vocabulary), or fastokens refuses it (a byte with no token)."""
        if self._nfc and not text.isascii() and not unicodedata.is_normalized("NFC", text):
            return None
        try:
            return self._fast.encode(text).ids
        except ValueError:
            return None

    def _counts(self, ids: list[int], text: str, table: list[int], ascii_text: bool) -> tuple[int, ...] | None:
        """Each token's characters (``table``: byte lengths for ASCII text, character starts otherwise),
        or None where they do not add up to the text's length, or the byte lengths to its UTF-8 length."""
        get = itemgetter(*ids) if len(ids) > 1 else None  # one C call for every id's count
        per: tuple[int, ...] = get(table) if get else (table[ids[0]],)
        if sum(per) != len(text):
            return None
        if not ascii_text and (sum(get(self._lengths)) if get else self._lengths[ids[0]]) != len(text.encode("utf-8")):
            return None
        return per
