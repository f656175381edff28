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

from bisect import bisect_right

from .tokenizer import Tokenizer
from .types import RenderedTokens

# A piece: (text or token id, message index, is content, sampled)
Piece = tuple[str | int, int, bool, bool]


class Pieces:
    """An append-only list of pieces bound to a tokenizer."""

    __slots__ = ("tok", "items")

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.items: list[Piece] = []

    def special(self, token: str | int, message: int = -1, sampled: bool = False) -> None:
        tid = token if isinstance(token, int) else self.tok.token_id(token)
        self.items.append((tid, message, False, sampled))

    def scaffold(self, text: str, message: int = -1, sampled: bool = False) -> None:
        """Template text: added-token strings inside it become their ids, as in the reference."""
        for part in _split_cached(self.tok, text):
            self.items.append((part, message, False, sampled))

    def text(self, text: str, message: int, sampled: bool = False, content: bool = True) -> None:
        """Text from a message: always ordinary text."""
        if text:
            self.items.append((text, message, content, sampled))

    def encode(self) -> RenderedTokens:
        return encode_pieces(self.tok, self.items)


_SPLIT_CACHE: dict[tuple[int, str], list[str | int]] = {}
_CACHE_LIMIT = 8192  # entries per cache; the run cache holds runs up to _RUN_CACHE_CHARS characters
_RUN_CACHE_CHARS = 16384
# run text -> (ids, token end offsets or None where not needed yet). Repeated runs are the common case in RL: a group of rollouts shares its
# prompt, and system prompts and tool definitions repeat across tasks.
_RUN_CACHE: dict[tuple[int, str], tuple[list[int], list[int]]] = {}


def clear_caches() -> None:
    """Forget cached encodings (benchmarks use it to measure cold renders)."""
    _SPLIT_CACHE.clear()
    _RUN_CACHE.clear()


def _split_cached(tok: Tokenizer, text: str) -> list[str | int]:
    key = (id(tok), text)
    parts = _SPLIT_CACHE.get(key)
    if parts is None:
        parts = tok.split_added(text)
        if len(_SPLIT_CACHE) >= _CACHE_LIMIT:
            _SPLIT_CACHE.clear()
        if len(text) < 512:
            _SPLIT_CACHE[key] = parts
    return parts


def encode_pieces(tok: Tokenizer, items: list[Piece]) -> RenderedTokens:
    """Encode pieces: each run of text between special tokens is encoded as a whole, all uncached
    runs in one batch call (the tokenizer encodes them in parallel)."""
    # pass 1: group into runs; a run is (text, pieces); a special is an int
    groups: list[int | tuple[str, list[Piece]]] = []
    run: list[Piece] = []
    for piece in items:
        if isinstance(piece[0], int):
            if run:
                groups.append(("".join(p[0] for p in run), run))  # type: ignore[misc]
                run = []
            groups.append(piece)  # type: ignore[arg-type]
        else:
            run.append(piece)
    if run:
        groups.append(("".join(p[0] for p in run), run))  # type: ignore[misc]
    # pass 2: encode the runs the cache does not hold, in one call
    tid = id(tok)
    encoded = {}  # this render's runs: looked up before the cache may be cleared below
    for g in groups:
        if isinstance(g[0], str) and g[0] not in encoded and (tid, g[0]) in _RUN_CACHE:
            encoded[g[0]] = _RUN_CACHE[(tid, g[0])]
    # token end offsets only for runs whose pieces differ in attribution (most runs are one piece's)
    mixed = {g[0] for g in groups if isinstance(g[0], str) and not _uniform(g[1])}  # type: ignore[arg-type]
    pending = list({g[0] for g in groups if isinstance(g[0], str) and g[0] not in encoded})
    if pending:
        if len(_RUN_CACHE) + len(pending) > _CACHE_LIMIT:
            _RUN_CACHE.clear()
        with_ends = [t for t in pending if t in mixed]
        ids_only = [t for t in pending if t not in mixed]
        results = list(zip(with_ends, tok.encode_plain_batch(with_ends), strict=True))
        results += [(t, (run_ids, None)) for t, run_ids in zip(ids_only, tok.encode_plain_ids_batch(ids_only), strict=True)]
        for text, enc in results:
            encoded[text] = enc
            if len(text) <= _RUN_CACHE_CHARS:
                _RUN_CACHE[(tid, text)] = enc
    # pass 3: assemble with attribution
    ids: list[int] = []
    msg: list[int] = []
    sampled: list[bool] = []
    content: list[bool] = []
    for g in groups:
        if isinstance(g[0], int):
            ids.append(g[0])
            msg.append(g[1])
            content.append(False)
            sampled.append(g[3])
            continue
        text, pieces = g  # type: ignore[misc]
        run_ids, ends = encoded[text]
        first = pieces[0]
        if text not in mixed:
            n = len(run_ids)
            ids.extend(run_ids)
            msg.extend([first[1]] * n)
            content.extend([first[2]] * n)
            sampled.extend([first[3]] * n)
        else:
            if ends is None:  # cached from a render where this run was one piece's
                run_ids, ends = encoded[text] = tok.encode_plain_with_ends(text)
                if len(text) <= _RUN_CACHE_CHARS:
                    _RUN_CACHE[(tid, text)] = (run_ids, ends)
            _attribute(run_ids, ends, pieces, ids, msg, content, sampled)
    return RenderedTokens(token_ids=ids, message_indices=msg, sampled_mask=sampled, is_content=content)


def _uniform(run: list[Piece]) -> bool:
    first = run[0]
    return all(p[1] == first[1] and p[2] == first[2] and p[3] == first[3] for p in run)


def _attribute(run_ids, ends, run: list[Piece], ids, msg, content, sampled) -> None:
    """Attribute each token of a mixed run by the pieces its characters overlap.

    Token i covers characters [ends[i-1], ends[i]). Tokens inside one piece take its attributes in
    bulk; a token that spans pieces (BPE merged across a boundary) counts as content if any of its
    characters is content, belongs to the message of its first content character (else of its
    first character), and is sampled only if all of its characters were.
    """
    n = len(run_ids)
    ids.extend(run_ids)
    t = 0
    prev_end = 0
    pos = 0
    for j, piece in enumerate(run):
        start, end = pos, pos + len(piece[0])  # type: ignore[arg-type]
        pos = end
        if t >= n or prev_end >= end:
            continue  # an earlier spanning token covered this piece
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
