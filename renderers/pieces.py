"""Pieces: what a hand-coded renderer emits, and how pieces become exactly the reference's token ids.

A renderer describes a conversation as a flat list of pieces: special tokens, scaffold text (the
template's own strings) and message text, each tagged with the message it belongs to, whether it is
message content and whether the model would have sampled it.

Token parity with transformers rests on one property of Hugging Face tokenizers: the text is first
split on added-token strings, and each run of text between two added tokens is normalised,
pre-tokenised and BPE-encoded on its own. So encoding each run between special tokens as a whole
reproduces the reference exactly, however many pieces the run was built from; attribution inside a
run comes from the encoder's character offsets. Scaffold text is split on added-token strings (the
template's ``<tool_call>`` in a tool preamble is the added token, as in the reference); message text
never is, so a message quoting ``<|im_end|>`` stays ordinary text.
"""

from __future__ import annotations

import itertools
import unicodedata
import weakref
from bisect import bisect_right

import numpy as np

from .tokenizer import Tokenizer
from .types import RenderedTokens

# A piece: (text or token id, message index, is content, sampled)
Piece = tuple[str | int, int, bool, bool]


class Pieces:
    """An append-only list of pieces bound to a tokenizer.

    Pieces are not kept one by one: each call adds straight to what encoding needs, so that encoding
    never walks the pieces again. Text goes into the current run (the text between two special
    tokens); adjacent text of one run with the same attribution is one "span" (a token inside it gets
    that attribution whichever piece its characters came from). Specials are kept apart, each with
    the number of runs before it.
    """

    __slots__ = ("tok", "tok_key", "added", "splits", "runs", "parts", "run_span", "run_template", "message_text",
                 "sp_ids", "sp_msg", "sp_sampled", "sp_run", "span_end", "span_msg", "span_content", "span_sampled",
                 "last", "pos")

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.tok_key = tokenizer_key(tok)  # once per render: the caches are keyed by it
        self.added = tok.added_tokens
        self.splits = _splits_for(tok, self.tok_key)
        self.runs: list[str] = []  # finished runs
        self.parts: list[str] = []  # the current run's text
        self.run_span: list[int] = []  # the first span of each run
        self.run_template: list[bool] = []  # each run is the template's own text only (no message text)
        self.message_text = False  # the current run holds message text
        self.sp_ids: list[int] = []
        self.sp_msg: list[int] = []
        self.sp_sampled: list[bool] = []
        self.sp_run: list[int] = []  # runs before each special
        self.span_end: list[int] = []  # character end of each span, in all runs' text concatenated
        self.span_msg: list[int] = []
        self.span_content: list[bool] = []
        self.span_sampled: list[bool] = []
        self.last: tuple[int, bool, bool] | None = None  # the last span's attribution
        self.pos = 0

    def special(self, token: str | int, message: int = -1, sampled: bool = False) -> None:
        tid = token if token.__class__ is int else self.added.get(token)  # type: ignore[arg-type]
        if tid is None:
            tid = self.tok.token_id(token)  # type: ignore[arg-type]  # raises, naming the token
        self._special(tid, message, sampled)  # type: ignore[arg-type]

    def scaffold(self, text: str, message: int = -1, sampled: bool = False) -> None:
        """Template text: added-token strings inside it become their ids, as in the reference."""
        parts = self.splits.get(text)
        if parts is None:
            parts = _split(self.tok, self.splits, text)
        for part in parts:
            if part.__class__ is int:
                self._special(part, message, sampled)  # type: ignore[arg-type]
            else:
                self._text(part, message, False, sampled)  # type: ignore[arg-type]

    def text(self, text: str, message: int, sampled: bool = False, content: bool = True) -> None:
        """Text from a message: always ordinary text."""
        if text:
            self.message_text = True
            self._text(text, message, content, sampled)

    def _special(self, tid: int, message: int, sampled: bool) -> None:
        if self.parts:
            self._end_run()
        self.last = None  # a span never crosses a special: runs are encoded apart
        self.sp_ids.append(tid)
        self.sp_msg.append(message)
        self.sp_sampled.append(sampled)
        self.sp_run.append(len(self.runs))

    def _text(self, text: str, message: int, content: bool, sampled: bool) -> None:
        # called once per piece of every render: locals, no attribute looked up twice
        parts = self.parts
        if not parts:
            self.run_span.append(len(self.span_end))
        parts.append(text)
        pos = self.pos = self.pos + len(text)
        attr = (message, content, sampled)
        if attr == self.last:
            self.span_end[-1] = pos
        else:
            self.last = attr
            self.span_end.append(pos)
            self.span_msg.append(message)
            self.span_content.append(content)
            self.span_sampled.append(sampled)

    def _end_run(self) -> None:
        self.runs.append("".join(self.parts))
        self.parts = []
        self.run_template.append(not self.message_text)
        self.message_text = False

    def _finish(self) -> None:
        if self.parts:
            self._end_run()
            self.last = None

    @classmethod
    def from_items(cls, tok: Tokenizer, items: list[Piece]) -> Pieces:
        p = cls(tok)
        for value, message, content, sampled in items:
            if value.__class__ is int:
                p._special(value, message, sampled)  # type: ignore[arg-type]
            else:  # an empty text too: a token over it counts its attribution (as _attribute does)
                p._text(value, message, content, sampled)  # type: ignore[arg-type]
        p._finish()
        p.run_template = [False] * len(p.runs)  # which text is the template's own is not known here
        return p

    def encode(self) -> RenderedTokens:
        """Each run of text between special tokens encoded as a whole. Long renders go through the
        vectorised path (one fastokens call, attribution with numpy); short ones, and anything that path
        declines, run by run (same result: tests/test_pieces.py holds both to a reference)."""
        self._finish()
        if len(self.span_end) + len(self.sp_ids) >= _VECTOR_MIN_PIECES:
            fast = self.tok.fast_encoder
            if fast is not None:
                # the whole render's result by everything it depends on: a group of rollouts renders
                # one prompt several times (the run cache does this for the run-by-run path)
                key = (self.tok_key, tuple(self.runs), tuple(self.sp_ids), tuple(self.sp_msg), tuple(self.sp_sampled),
                       tuple(self.sp_run), tuple(self.span_end), tuple(self.span_msg), tuple(self.span_content),
                       tuple(self.span_sampled))
                out = _RENDER_CACHE.get(key)
                if out is None:
                    out = _encode_vectorised(fast, self)
                    if out is not None and out[0].size <= _RENDER_CACHE_TOKENS:
                        if len(_RENDER_CACHE) >= _RENDER_CACHE_LIMIT:
                            _RENDER_CACHE.clear()
                        _RENDER_CACHE[key] = out  # arrays no caller sees: each call gets its own lists
                if out is not None:
                    ids, msg, sampled, content = out
                    return RenderedTokens(token_ids=ids.tolist(), message_indices=msg.tolist(),
                                          sampled_mask=sampled.tolist(), is_content=content.tolist())
        return _encode_runs(self.tok, self)


# At fewer pieces (a bridge: a handful; a 1-turn render: ~50) numpy's fixed cost per call outweighs the
# per-token Python work it saves (measured on the Qwen3 bench). One fastokens call for a short render's
# runs, attributed span by span in Python, measured slower in place than the run cache's path (0.85x at 1
# tool turn, same process, interleaved rounds), so there is no third path.
_VECTOR_MIN_PIECES = 80
# Up to this many characters the vectorised path encodes in this thread (FastEncoder.joined); beyond, the
# thread pool of one fastokens batch call pays for its wake-up (crossover measured at ~17 Qwen3 tool turns)
_JOINED_MAX_CHARS = 12000


def encode_pieces(tok: Tokenizer, items: list[Piece]) -> RenderedTokens:
    """Encode a list of pieces (the generic renderer builds its own)."""
    return Pieces.from_items(tok, items).encode()


# tokenizer key -> scaffold text -> its split on added tokens. The template's own strings: what a render
# of never-seen content finds here is the compiled template, not an encoding of that content.
_SPLITS: dict[int, dict[str, list[str | int]]] = {}
_CACHE_LIMIT = 8192  # entries per cache; the run cache holds runs up to _RUN_CACHE_CHARS characters
_RUN_CACHE_CHARS = 16384
# run text -> (ids, token end offsets or None where not needed yet). Repeated runs are the common case in RL: a group of rollouts shares its
# prompt, and system prompts and tool definitions repeat across tasks.
_RUN_CACHE: dict[tuple[int, str], tuple[list[int], list[int] | None]] = {}
# the same for runs of the template's own text only (no message text in them): kept with the splits
_TEMPLATE_RUNS: dict[tuple[int, str], tuple[list[int], list[int] | None]] = {}
# whole vectorised renders (Pieces.encode): at most this many, of at most this many tokens each (~18 bytes a token)
_RENDER_CACHE: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
_RENDER_CACHE_LIMIT = 128
_RENDER_CACHE_TOKENS = 32768


_TOKENIZER_KEYS: weakref.WeakKeyDictionary[Tokenizer, int] = weakref.WeakKeyDictionary()
_NEXT_KEY = itertools.count()


def tokenizer_key(tok: Tokenizer) -> int:
    """A cache key for ``tok`` that no other tokenizer ever gets. ``id(tok)`` is not one: once a tokenizer
    is freed, the next one may be allocated at the same address and would read the dead one's cached ids
    (another vocabulary's). Copies (``text_view``, ``with_chat_template``) are other objects: other keys."""
    key = _TOKENIZER_KEYS.get(tok)
    if key is None:
        key = _TOKENIZER_KEYS[tok] = next(_NEXT_KEY)
    return key


def clear_caches(template: bool = False) -> None:
    """Forget cached encodings of text (benchmarks use it to measure renders of never-seen content);
    with ``template``, also what is cached of the template's own strings: their splits on added tokens
    and the encodings of runs made of them only (transformers keeps its compiled template the same
    way)."""
    _RUN_CACHE.clear()
    _RENDER_CACHE.clear()
    if template:
        _SPLITS.clear()
        _TEMPLATE_RUNS.clear()


def _splits_for(tok: Tokenizer, tok_key: int) -> dict[str, list[str | int]]:
    splits = _SPLITS.get(tok_key)
    if splits is None:
        if len(_SPLITS) >= 64:  # tokenizers, not texts: a process holds a handful
            _SPLITS.clear()
        splits = _SPLITS[tok_key] = {}
    return splits


def _split(tok: Tokenizer, splits: dict[str, list[str | int]], text: str) -> list[str | int]:
    parts = tok.split_added(text)
    if len(splits) >= _CACHE_LIMIT:
        splits.clear()
    if len(text) < 512:
        splits[text] = parts
    return parts


def _encode_runs(tok: Tokenizer, p: Pieces) -> RenderedTokens:
    """Run by run: the ids of one-span runs (most of them) without end offsets, in bulk; runs of several
    spans with end offsets, attributed by ``_attribute``. Uncached runs are encoded in one batch call."""
    runs = p.runs
    nspans = len(p.span_end)
    bounds = [*p.run_span, nspans]
    tid = p.tok_key
    encoded: dict[str, tuple[list[int], list[int] | None]] = {}  # this render's runs
    with_ends: list[str] = []
    ids_only: list[str] = []
    template = p.run_template
    for r, text in enumerate(runs):
        if text in encoded:
            continue
        hit = (_TEMPLATE_RUNS if template[r] else _RUN_CACHE).get((tid, text))
        mixed = bounds[r + 1] - bounds[r] > 1
        if hit is not None and (hit[1] is not None or not mixed):
            encoded[text] = hit
        elif mixed:
            encoded[text] = hit or ([], None)  # placeholder, so that a repeated run is encoded once
            with_ends.append(text)
        else:
            encoded[text] = ([], None)
            ids_only.append(text)
    if with_ends or ids_only:
        for cache in (_RUN_CACHE, _TEMPLATE_RUNS):
            if len(cache) + len(with_ends) + len(ids_only) > _CACHE_LIMIT:
                cache.clear()
        from_template = {text for text, own in zip(runs, template, strict=True) if own}
        results = list(zip(with_ends, tok.encode_plain_batch(with_ends), strict=True))
        results += [(t, (run_ids, None)) for t, run_ids in zip(ids_only, tok.encode_plain_ids_batch(ids_only), strict=True)]
        for text, enc in results:
            encoded[text] = enc
            if len(text) <= _RUN_CACHE_CHARS:
                (_TEMPLATE_RUNS if text in from_template else _RUN_CACHE)[(tid, text)] = enc
    ids: list[int] = []
    msg: list[int] = []
    sampled: list[bool] = []
    content: list[bool] = []
    sp_ids, sp_run = p.sp_ids, p.sp_run
    k, nsp = 0, len(sp_ids)
    start = 0  # the run's first character, in the concatenated runs
    for r, text in enumerate(runs):
        while k < nsp and sp_run[k] <= r:
            ids.append(sp_ids[k])
            msg.append(p.sp_msg[k])
            content.append(False)
            sampled.append(p.sp_sampled[k])
            k += 1
        run_ids, ends = encoded[text]
        a, b = bounds[r], bounds[r + 1]
        if b - a == 1:
            n = len(run_ids)
            ids.extend(run_ids)
            msg.extend([p.span_msg[a]] * n)
            content.extend([p.span_content[a]] * n)
            sampled.extend([p.span_sampled[a]] * n)
        else:
            if ends is None:  # mixed twice in this render, or cached ids of another render: needs ends
                run_ids, ends = tok.encode_plain_with_ends(text)
                if len(text) <= _RUN_CACHE_CHARS:
                    (_TEMPLATE_RUNS if template[r] else _RUN_CACHE)[(tid, text)] = (run_ids, ends)
            spans = []
            s = start
            for i in range(a, b):
                e = p.span_end[i]
                spans.append((text[s - start : e - start], p.span_msg[i], p.span_content[i], p.span_sampled[i]))
                s = e
            _attribute(run_ids, ends, spans, ids, msg, content, sampled)
        start += len(text)
    while k < nsp:
        ids.append(sp_ids[k])
        msg.append(p.sp_msg[k])
        content.append(False)
        sampled.append(p.sp_sampled[k])
        k += 1
    return RenderedTokens(token_ids=ids, message_indices=msg, sampled_mask=sampled, is_content=content)


def _encode_vectorised(fast, p: Pieces) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``_encode_runs``' result without per-token Python: every run in one fastokens call, each token's
    character end from byte lengths over the whole text at once, and its attribution from the span
    that holds it (``searchsorted``); a token over several spans is attributed as ``_attribute`` does.
    Returns None where the run-by-run path must decide: text fastokens refuses, NFC would change, or
    whose byte lengths do not add up (it goes to the tokenizers library there), or an unknown token."""
    runs = p.runs
    whole = "".join(runs)
    ascii_text = whole.isascii()
    if fast.nfc and not ascii_text and not all(t.isascii() or unicodedata.is_normalized("NFC", t) for t in runs):
        return None
    joined = len(whole) < _JOINED_MAX_CHARS
    try:
        if joined:
            ids_np = np.fromiter(fast.joined(runs), dtype=np.int64)
        else:
            flat, offsets = fast.flat(runs)
            ids_np = np.frombuffer(flat, dtype=np.uint32)
        lengths = fast.lengths_np[ids_np]
    except (ValueError, IndexError):  # refused by fastokens, or an id beyond the vocabulary
        return None
    if ids_np.size and int(lengths.min()) <= 0:
        return None  # an unknown token (or an empty one)
    byte_cum = np.zeros(ids_np.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=byte_cum[1:])
    if ascii_text:
        run_bytes = list(map(len, runs))
        char_ends = byte_cum[1:]
    else:
        run_bytes = [len(t.encode("utf-8")) for t in runs]
        char_ends = np.cumsum(fast.starts_np[ids_np])  # characters that start before each token's end byte
    run_cum = np.zeros(len(runs) + 1, dtype=np.int64)
    np.cumsum(run_bytes, out=run_cum[1:])
    if byte_cum[-1] != run_cum[-1]:
        return None  # the ids' byte lengths do not add up to the text's
    # where each run's tokens start: the token that starts at the run's first byte
    off = np.searchsorted(byte_cum, run_cum) if joined else np.frombuffer(offsets, dtype=np.uint64).astype(np.int64)
    if not np.array_equal(byte_cum[off], run_cum):
        return None  # a token over two runs, or a run's byte lengths do not add up to its text's
    span_end = p.span_end
    nspans = len(span_end)
    # the span of every character (a zero-length span holds none), and a sentinel past the last
    span_len = np.diff(np.array([0, *span_end], dtype=np.int64))
    span_of = np.empty(span_end[-1] + 1 if nspans else 1, dtype=np.int64)
    span_of[:-1] = np.repeat(np.arange(nspans, dtype=np.int64), span_len)
    span_of[-1] = nspans
    j = span_of[char_ends - 1]  # the span of each token's last character ...
    js = np.empty_like(j)  # ... and of its first (a token starts where the one before it ends)
    js[:1] = span_of[0]
    js[1:] = span_of[char_ends[:-1]]
    span_msg = np.array(p.span_msg, dtype=np.int64)
    span_content = np.array(p.span_content, dtype=bool)
    span_sampled = np.array(p.span_sampled, dtype=bool)
    msg = span_msg[j]
    content = span_content[j]
    sampled = span_sampled[j]
    # a token over several spans; one that completes a character split over tokens (no character of its
    # own: it starts where it ends, js > j) stays with the span of the character it completes
    across = np.flatnonzero(js < j)
    if across.size:
        a, b = js[across], j[across]
        # a token over spans a..b (as _attribute): content if any of them is, owned by the first content
        # span (else by span a), sampled only if all of them are
        n_content = np.concatenate(([0], np.cumsum(span_content)))
        n_unsampled = np.concatenate(([0], np.cumsum(~span_sampled)))
        first_content = np.where(span_content, np.arange(nspans), nspans)
        first_content = np.minimum.accumulate(first_content[::-1])[::-1]  # first content span at or after each
        any_content = n_content[b + 1] > n_content[a]
        owner = span_msg[np.minimum(first_content[a], nspans - 1)]
        msg[across] = np.where(any_content, owner, span_msg[a])
        content[across] = any_content
        sampled[across] = n_unsampled[b + 1] == n_unsampled[a]
    if p.sp_ids:
        n_sp = len(p.sp_ids)
        at = off[p.sp_run] + np.arange(n_sp)  # each special's position in the output
        is_run = np.ones(ids_np.size + n_sp, dtype=bool)
        is_run[at] = False
        out_ids = np.empty(is_run.size, dtype=np.int64)
        out_ids[at] = p.sp_ids
        out_ids[is_run] = ids_np
        out_msg = np.empty(is_run.size, dtype=np.int64)
        out_msg[at] = p.sp_msg
        out_msg[is_run] = msg
        out_content = np.zeros(is_run.size, dtype=bool)
        out_content[is_run] = content
        out_sampled = np.empty(is_run.size, dtype=bool)
        out_sampled[at] = p.sp_sampled
        out_sampled[is_run] = sampled
        ids_np, msg, content, sampled = out_ids, out_msg, out_content, out_sampled
    return ids_np, msg, sampled, content


def _attribute(run_ids, ends, run: list[Piece], ids, msg, content, sampled) -> None:
    """Attribute each token of a mixed run by the pieces its characters overlap.

    Token i covers characters [ends[i-1], ends[i]). Tokens inside one piece take its attributes in
    bulk; a token that spans pieces (BPE merged across a boundary) counts as content if any of its
    characters is content, belongs to the message of its first content character (else of its
    first character), and is sampled only if all of its characters were. A token that completes a
    character split over tokens covers no character of its own: it goes with the one it completes.
    """
    n = len(run_ids)
    ids.extend(run_ids)
    t = 0
    prev_end = 0
    pos = 0
    for j, piece in enumerate(run):
        start, end = pos, pos + len(piece[0])  # type: ignore[arg-type]
        pos = end
        if t >= n or (prev_end >= end and (ends[t] != end or start == end)):
            continue  # an earlier spanning token covered this piece (but not what completes its last character)
        hi = bisect_right(ends, end, t)  # tokens t..hi-1 end inside this piece
        count = hi - t
        if count:
            msg.extend([piece[1]] * count)
            content.extend([piece[2]] * count)
            sampled.extend([piece[3]] * count)
            prev_end = ends[hi - 1]
            t = hi
        if t < n and prev_end < end:  # token t starts in this piece and ends in a later one
            token_end = ends[t]
            owner, content_owner, all_sampled = piece[1], None, True
            k, k_start = j, start
            while k < len(run) and k_start < token_end:
                other = run[k]
                if other[2] and content_owner is None:
                    content_owner = other[1]
                all_sampled = all_sampled and other[3]
                k_start += len(other[0])  # type: ignore[arg-type]
                k += 1
            msg.append(content_owner if content_owner is not None else owner)
            content.append(content_owner is not None)
            sampled.append(all_sampled)
            prev_end = token_end
            t += 1
