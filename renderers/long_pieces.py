"""LongPieces: a long render's pieces collected, then encoded in one fastokens call with numpy attribution.

Run by run (:class:`~tito_renderers.pieces.Pieces`), every run costs a fastokens call and some Python;
from about fifty Qwen3 tool turns on, collecting the runs and encoding them together is cheaper: one
call for all of them, each token's character end from byte lengths over the whole text at once, and
its attribution from the span that holds it (``searchsorted``). Where this path cannot decide (text
fastokens refuses, NFC would change, byte lengths that do not add up, an unknown token), the pieces
are replayed through ``Pieces``, whose result is the same by construction (tests/test_pieces.py
holds both to one reference).
"""

from __future__ import annotations

import unicodedata

import numpy as np

from .pieces import _RENDER_CACHE, _RENDER_CACHE_LIMIT, _RENDER_CACHE_TOKENS, Piece, Pieces, PieceWriter
from .tokenizer import Tokenizer
from .types import RenderedTokens

# A render of this many messages (~50 Qwen3 tool turns, ~10,000 tokens: the crossover measured on the
# Qwen3 bench, run by run 1.1x faster at 30 turns, 0.8-0.9x at 100), or a generic render of this many
# pieces, goes to LongPieces
_LONG_MESSAGES = 100
_LONG_ITEMS = 300
# Up to this many characters the runs are encoded joined in this thread (FastEncoder.joined); beyond, the
# thread pool of one fastokens batch call pays for its wake-up (crossover measured at ~17 Qwen3 tool turns)
_JOINED_MAX_CHARS = 12000


def new_pieces(tok: Tokenizer, messages: int) -> PieceWriter:
    """The implementation for a render of ``messages`` messages: from ``_LONG_MESSAGES`` on, one
    fastokens call and numpy attribution beat encoding run by run."""
    if messages >= _LONG_MESSAGES and tok.fast_encoder is not None:
        return LongPieces(tok)
    return Pieces(tok)


def encode_pieces(tok: Tokenizer, items: list[Piece]) -> RenderedTokens:
    """Encode a list of pieces (the generic renderer builds its own). An empty text counts too: a token
    over it counts its attribution."""
    if len(items) >= _LONG_ITEMS and tok.fast_encoder is not None:
        p: PieceWriter = LongPieces(tok)
    else:
        p = Pieces(tok)
    for value, message, content, sampled in items:
        if value.__class__ is int:
            p._special(value, message, sampled)  # type: ignore[arg-type]
        else:
            p.message_text = True  # which text is the template's own is not known here
            p._text(value, message, content, sampled)  # type: ignore[arg-type]
    return p.encode()  # type: ignore[attr-defined]


class LongPieces(PieceWriter):
    """Pieces kept in the form the vectorised encoding needs: text goes into the current run (the text
    between two special tokens); adjacent text of one run with the same attribution is one "span";
    special tokens (and blocks of the template's own tokens) are kept apart, each with the number of
    runs before it."""

    __slots__ = ("runs", "parts", "run_span", "run_template", "sp_ids", "sp_msg", "sp_sampled", "sp_run",
                 "span_end", "span_msg", "span_content", "span_sampled", "last", "pos")

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__(tok)
        self.runs: list[str] = []  # finished runs
        self.parts: list[str] = []  # the current run's text
        self.run_span: list[int] = []  # the first span of each run
        self.run_template: list[bool] = []  # each run is the template's own text only (no message text)
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

    def _special(self, tid: int, message: int, sampled: bool) -> None:
        if self.parts:
            self._end_run()
        self.last = None  # a span never crosses a special: runs are encoded apart
        self.sp_ids.append(tid)
        self.sp_msg.append(message)
        self.sp_sampled.append(sampled)
        self.sp_run.append(len(self.runs))

    def _block(self, ids: tuple[int, ...], message: int, sampled: bool) -> None:
        if self.parts:
            self._end_run()
        self.last = None
        n = len(ids)
        self.sp_ids += ids
        self.sp_msg += [message] * n
        self.sp_sampled += [sampled] * n
        self.sp_run += [len(self.runs)] * n

    def _text(self, text: str, message: int, content: bool, sampled: bool) -> None:
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

    def finish(self) -> None:
        """End the last run (``encode`` does it; tests and benchmarks look at the runs before)."""
        if self.parts:
            self._end_run()
            self.last = None

    def encode(self) -> RenderedTokens:
        self.finish()
        # the whole render's result by everything it depends on
        key = (self.tok_key, tuple(self.runs), tuple(self.sp_ids), tuple(self.sp_msg), tuple(self.sp_sampled),
               tuple(self.sp_run), tuple(self.span_end), tuple(self.span_msg), tuple(self.span_content),
               tuple(self.span_sampled))
        out = _RENDER_CACHE.get(key)
        if out is None:
            out = encode_vectorised(self.tok.fast_encoder, self)
            if out is None:
                return self.replay().encode()
            if out[0].size <= _RENDER_CACHE_TOKENS:
                if len(_RENDER_CACHE) >= _RENDER_CACHE_LIMIT:
                    _RENDER_CACHE.clear()
                _RENDER_CACHE[key] = out  # arrays no caller sees: each call gets its own lists
        ids, msg, sampled, content = out
        return RenderedTokens(token_ids=ids.tolist(), message_indices=msg.tolist(),
                              sampled_mask=sampled.tolist(), is_content=content.tolist())

    def replay(self) -> Pieces:
        """The same pieces in a ``Pieces``, run by run (where the vectorised path declines)."""
        self.finish()
        p = Pieces(self.tok)
        bounds = [*self.run_span, len(self.span_end)]
        k, nsp = 0, len(self.sp_ids)
        start = 0
        for r, text in enumerate(self.runs):
            while k < nsp and self.sp_run[k] <= r:
                p._special(self.sp_ids[k], self.sp_msg[k], self.sp_sampled[k])
                k += 1
            s = start
            for i in range(bounds[r], bounds[r + 1]):
                e = self.span_end[i]
                p.message_text = not self.run_template[r]
                p._text(text[s - start : e - start], self.span_msg[i], self.span_content[i], self.span_sampled[i])
                s = e
            start += len(text)
        for j in range(k, nsp):
            p._special(self.sp_ids[j], self.sp_msg[j], self.sp_sampled[j])
        return p


def encode_vectorised(fast, p: LongPieces) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Ids, message indices, sampled and content masks of ``p`` as arrays, without per-token Python:
    every run in one fastokens call, each token's character end from byte lengths, its attribution
    from the span that holds it; a token over several spans is attributed as ``pieces._attribute``
    does. Returns None where the run-by-run path must decide: text fastokens refuses, NFC would change,
    or whose byte lengths do not add up (it goes to the tokenizers library there), or an unknown token."""
    if fast is None:
        return None
    runs = p.runs
    whole = "".join(runs)
    ascii_text = whole.isascii()
    # NFC text cut at any point gives NFC parts: one check of the whole text is enough when it passes
    if (fast.nfc and not ascii_text and not unicodedata.is_normalized("NFC", whole)
            and not all(t.isascii() or unicodedata.is_normalized("NFC", t) for t in runs)):
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
