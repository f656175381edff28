"""Pieces: what a hand-coded renderer emits, and how pieces become exactly the reference's token ids.

A renderer describes a conversation as a sequence of pieces: special tokens, scaffold text (the
template's own strings) and message text, each tagged with the message it belongs to, whether it is
message content and whether the model would have sampled it.

Token parity with transformers rests on one property of Hugging Face tokenizers: the text is first
split on added-token strings, and each run of text between two added tokens is normalised,
pre-tokenised and BPE-encoded on its own. So encoding each run between special tokens as a whole
reproduces the reference exactly, however many pieces the run was built from; attribution inside a
run comes from the encoder's character offsets. Scaffold text is split on added-token strings (the
template's ``<tool_call>`` in a tool preamble is the added token, as in the reference); message text
never is, so a message quoting ``<|im_end|>`` stays ordinary text.

Two implementations of one interface (:class:`PieceWriter`), held to the same independent reference
by tests/test_pieces.py: :class:`Pieces` encodes each run as soon as a special token ends it (renders
up to ~50 tool turns, and bridges), and :class:`~tito_renderers.long_pieces.LongPieces` collects a
long render and encodes it in one fastokens call with numpy attribution;
:func:`~tito_renderers.long_pieces.new_pieces` picks one by the number of messages.
"""

from __future__ import annotations

import itertools
import weakref
from bisect import bisect_right
from typing import NamedTuple

import numpy as np

from .fast_encode import library_encode
from .tokenizer import Tokenizer
from .types import RenderedTokens

# A piece, as the generic renderer assembles them: (text or token id, message index, is content, sampled).
# A plain tuple: built once per piece of every generic render (a NamedTuple takes ~9x as long to build:
# 386 against 42 ns, docs/benchmarks.md).
Piece = tuple[str | int, int, bool, bool]
# Added tokens a scaffold string holds: one id, or the ids from its first added token through its last
# one (the text between two added tokens is a whole run, encoded once).
Added = int | tuple[int, ...]


class Split(NamedTuple):
    """A scaffold string split on added tokens, computed once per string (cached in :data:`_SPLITS`).
    The ids of ``lead`` and ``trail`` are what a run holding nothing else encodes to (the common case:
    ``"\n"`` between turns)."""

    lead: str  # the text before the first added token: it joins the current run
    lead_ids: list[int]
    added: Added | None  # None: the string holds no added token (then it is all lead)
    trail: str  # the text after the last added token: it starts the next run
    trail_ids: list[int]


# Template text that starts the current run, not yet in it: (text, its ids as a whole run, message,
# sampled). A special token next makes it the whole run, whose ids are known; any other text makes it
# the run's first piece. A plain tuple: built for most scaffold strings of every render, where a
# NamedTuple takes 386 ns to build against a tuple's 42 ns.
Pending = tuple[str, list[int], int, bool]


class PieceWriter:
    """What a renderer writes a conversation to (``special``, ``scaffold``, ``text``, ``wrapped``), the
    half both implementations share; a subclass says what a special token, a block of the template's
    own tokens and a piece of text do, and how ``encode`` turns them into tokens."""

    __slots__ = ("tok", "tok_key", "added", "splits", "message_text")

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.tok_key = tokenizer_key(tok)  # once per render: the caches are keyed by it
        self.added = tok.added_tokens
        self.splits = _splits_for(tok, self.tok_key)
        self.message_text = False  # the current run holds message text

    def special(self, token: str | int, message: int = -1, sampled: bool = False) -> None:
        if isinstance(token, int):
            self._special(token, message, sampled)
            return
        tid = self.added.get(token)
        self._special(self.tok.token_id(token) if tid is None else tid, message, sampled)  # token_id raises, naming it

    def _split_of(self, text: str) -> Split:
        split = self.splits.get(text)
        return _split(self.tok, self.splits, text) if split is None else split

    def _added(self, added: Added, message: int, sampled: bool) -> None:
        if isinstance(added, int):
            self._special(added, message, sampled)
        else:
            self._block(added, message, sampled)

    def scaffold(self, text: str, message: int = -1, sampled: bool = False) -> None:
        """Template text: added-token strings inside it become their ids, as in the reference. Writing
        a turn's fixed tokens as one scaffold string (``"<|im_end|>\\n<|im_start|>user\\n"``) is the
        cheap way to emit them: its split, with the ids of the runs inside it, is computed once."""
        lead, _, added, trail, _ = self._split_of(text)
        if lead:
            self._text(lead, message, False, sampled)
        if added is not None:
            self._added(added, message, sampled)
            if trail:
                self._text(trail, message, False, sampled)

    def text(self, text: str, message: int, sampled: bool = False, content: bool = True) -> None:
        """Text from a message: always ordinary text."""
        if text:
            self.message_text = True
            self._text(text, message, content, sampled)

    def wrapped(self, head: str, text: str, tail: str, message: int, sampled: bool = False, extra: str = "",
                extra_message: int = -1) -> None:
        """``scaffold(head)``, ``text(text)`` and ``scaffold(tail)``, all of one message and one sampled
        flag: a message's text between two pieces of its turn's scaffold, the common shape. With
        ``extra``: that text (not content) between the text and the tail, it and the tail belonging to
        ``extra_message``: a system message's text, then the template's tool definitions."""
        self.scaffold(head, message, sampled)
        self.text(text, message, sampled)
        if extra:
            self.text(extra, extra_message, sampled, content=False)
            message = extra_message
        self.scaffold(tail, message, sampled)

    def fields(self, head: str, texts: tuple[str, ...], separators: tuple[str, ...], tail: str, message: int,
               sampled: bool = False) -> None:
        """``scaffold(head)``, then the message's ``texts`` with ``separators[k]`` (scaffold) between
        ``texts[k]`` and ``texts[k + 1]``, then ``scaffold(tail)``, all of one message and one sampled
        flag: a tool call's name and arguments inside the template's JSON, say."""
        self.scaffold(head, message, sampled)
        for k, text in enumerate(texts):
            if k:
                self.scaffold(separators[k - 1], message, sampled)
            self.text(text, message, sampled)
        self.scaffold(tail, message, sampled)

    def _special(self, tid: int, message: int, sampled: bool) -> None:
        raise NotImplementedError

    def _block(self, ids: tuple[int, ...], message: int, sampled: bool) -> None:
        raise NotImplementedError

    def _text(self, text: str, message: int, content: bool, sampled: bool) -> None:
        raise NotImplementedError


class Pieces(PieceWriter):
    """Pieces encoded run by run, as they come: a special token ends the current run, which is encoded
    (or found in the run cache) and attributed straight into the four output lists. Only the current
    run's text and its spans (adjacent text with one attribution) are kept."""

    __slots__ = ("fast", "ids", "msg", "sampled", "content", "parts", "ends", "attrs", "last", "pos", "pending")

    def __init__(self, tok: Tokenizer) -> None:
        super().__init__(tok)
        self.fast = tok.fast_encoder
        self.ids: list[int] = []
        self.msg: list[int] = []
        self.sampled: list[bool] = []
        self.content: list[bool] = []
        self.parts: list[str] = []  # the current run's text
        self.ends: list[int] = []  # the end of each of its spans, from the run's start
        self.attrs: list[tuple[int, bool, bool]] = []  # (message, content, sampled) of each span
        self.last: tuple[int, bool, bool] | None = None
        self.pos = 0
        self.pending: Pending | None = None  # never both pending and parts

    def scaffold(self, text: str, message: int = -1, sampled: bool = False) -> None:
        split = self.splits.get(text)  # (the commonest call of a render: _split_of and _added inlined)
        lead, lead_ids, added, trail, trail_ids = _split(self.tok, self.splits, text) if split is None else split
        if lead:
            if self.parts or self.pending is not None:
                self._text(lead, message, False, sampled)
            elif added is None:
                self.pending = (lead, lead_ids, message, sampled)
            else:  # the added tokens end the run right away: the run is the lead alone
                self._known(lead_ids, message, sampled)
        if isinstance(added, int):
            self._special(added, message, sampled)
        elif added is not None:
            self._block(added, message, sampled)
        if added is not None and trail:
            self.pending = (trail, trail_ids, message, sampled)

    def _known(self, ids: list[int], message: int, sampled: bool) -> None:
        """A whole run of the template's own text, its ids known."""
        n = len(ids)
        self.ids += ids
        self.msg += [message] * n
        self.sampled += [sampled] * n
        self.content += [False] * n

    def _end_run(self) -> None:
        pending = self.pending
        if pending is not None:
            self.pending = None
            _, ids, message, sampled = pending
            self._known(ids, message, sampled)
        elif self.parts:
            self._flush()

    def _special(self, tid: int, message: int, sampled: bool) -> None:
        pending = self.pending
        if pending is not None:  # _end_run and _known inlined: a special token after a turn's "\n" is
            self.pending = None  # the commonest step of a render
            _, run_ids, run_message, run_sampled = pending
            n = len(run_ids)
            self.ids += run_ids
            self.msg += [run_message] * n
            self.sampled += [run_sampled] * n
            self.content += [False] * n
        elif self.parts:
            self._flush()
        self.ids.append(tid)
        self.msg.append(message)
        self.sampled.append(sampled)
        self.content.append(False)

    def _block(self, ids: tuple[int, ...], message: int, sampled: bool) -> None:
        if self.parts or self.pending is not None:
            self._end_run()
        n = len(ids)
        self.ids += ids
        self.msg += [message] * n
        self.sampled += [sampled] * n
        self.content += [False] * n

    def _text(self, text: str, message: int, content: bool, sampled: bool) -> None:
        # once per piece of every render: no attribute looked up twice
        if self.pending is not None:  # text joins the pending template text: it is the run's first piece
            pending_text, _, pending_message, pending_sampled = self.pending
            self.pending = None
            self._text(pending_text, pending_message, False, pending_sampled)
        self.parts.append(text)
        pos = self.pos = self.pos + len(text)
        attr = (message, content, sampled)
        if attr == self.last:
            self.ends[-1] = pos
        else:
            self.last = attr
            self.ends.append(pos)
            self.attrs.append(attr)

    def wrapped(self, head: str, text: str, tail: str, message: int, sampled: bool = False, extra: str = "",
                extra_message: int = -1) -> None:
        # where head and tail both hold an added token, the run between them is exactly the head's
        # trailing text, the message text, the extra text and the tail's leading text, and its tokens'
        # attribution is known from two counts: no spans kept, no end offsets.
        # The fast path, written out here and in fields: the head's lead and added tokens, the run's
        # lookup and the tail's added tokens as methods shared by the two (one head/tail routine)
        # measured 0.68-0.95x on cold Qwen3 renders (bench_render_ab.py --base 8a07a14 --timing-only,
        # 9 rounds), so each keeps its own copy; tests/test_pieces.py holds both to one reference.
        splits = self.splits
        hs = splits.get(head) or _split(self.tok, splits, head)
        ts = splits.get(tail) or _split(self.tok, splits, tail)
        fast = self.fast
        if hs.added is None or ts.added is None or not text or fast is None:
            PieceWriter.wrapped(self, head, text, tail, message, sampled, extra, extra_message)
            return
        lead, lead_ids, block, before, _ = hs
        after, _, tail_block, trail, trail_ids = ts
        if lead:
            if self.parts or self.pending is not None:
                self._text(lead, message, False, sampled)
            else:
                self._known(lead_ids, message, sampled)
        if isinstance(block, int):
            self._special(block, message, sampled)
        elif block is not None:  # (never None: checked above)
            self._block(block, message, sampled)
        run = before + text + extra + after
        key = (self.tok_key, run)
        hit = _RUN_CACHE.get(key)
        run_ids = fast.try_ids(run) if hit is None else hit[0] if hit[1] is None else None
        counts = None if run_ids is None else fast.edges(run_ids, run, len(before), len(before) + len(text))
        owner = extra_message if extra else message  # of the extra text, the tail and what follows it
        if run_ids is None or counts is None:  # not fastokens' to encode, or byte lengths that do not add up: the general path
            self.message_text = True
            if before:
                self._text(before, message, False, sampled)
            self._text(text, message, True, sampled)
            if extra:
                self._text(extra, owner, False, sampled)
            if after:
                self._text(after, owner, False, sampled)
            message = owner
        else:
            if hit is None:
                _remember(_RUN_CACHE, key, (run_ids, None))
            a, b = counts  # tokens of the head's text only, and of the extra and tail texts only
            n = len(run_ids)
            ids = self.ids
            ids += run_ids
            if isinstance(tail_block, int):  # the tail's added tokens go with the run
                ids.append(tail_block)
                m = n + 1
            else:
                tail_ids = tail_block or ()  # (never None: checked above)
                ids += tail_ids
                m = n + len(tail_ids)
            if owner == message:
                self.msg += [message] * m
            else:
                self.msg += [message] * (n - b)
                self.msg += [owner] * (m - n + b)
            self.sampled += [sampled] * m
            content = self.content
            content += [False] * a
            content += [True] * (n - a - b)
            content += [False] * (m - n + b)
            if trail:
                self.pending = (trail, trail_ids, owner, sampled)
            return
        if isinstance(tail_block, int):
            self._special(tail_block, message, sampled)
        elif tail_block is not None:
            self._block(tail_block, message, sampled)
        if trail:
            self.pending = (trail, trail_ids, message, sampled)

    def fields(self, head: str, texts: tuple[str, ...], separators: tuple[str, ...], tail: str, message: int,
               sampled: bool = False) -> None:
        # as wrapped: where head and tail hold an added token and no separator does, the run between
        # them is known whole, and with one owner only the content flag varies: a token is content if
        # it overlaps a text (no spans kept, no per-span attribution). The head and tail are handled as
        # in wrapped, written out again (see the note above wrapped).
        splits = self.splits
        hs = splits.get(head) or _split(self.tok, splits, head)
        ts = splits.get(tail) or _split(self.tok, splits, tail)
        fast = self.fast
        plain = hs.added is not None and ts.added is not None and fast is not None
        for sep in separators:
            if (splits.get(sep) or _split(self.tok, splits, sep)).added is not None:
                plain = False  # an added token in a separator would end the run there
        if not plain:
            PieceWriter.fields(self, head, texts, separators, tail, message, sampled)
            return
        lead, lead_ids, block, before, _ = hs
        after, _, tail_block, trail, trail_ids = ts
        if lead:
            if self.parts or self.pending is not None:
                self._text(lead, message, False, sampled)
            else:
                self._known(lead_ids, message, sampled)
        if isinstance(block, int):
            self._special(block, message, sampled)
        elif block is not None:  # (never None: checked above)
            self._block(block, message, sampled)
        pieces = [before]
        span_ends = [len(before)]
        for k, text in enumerate(texts):
            if k:
                pieces.append(separators[k - 1])
                span_ends.append(span_ends[-1] + len(separators[k - 1]))
            pieces.append(text)
            span_ends.append(span_ends[-1] + len(text))
        pieces.append(after)
        run = "".join(pieces)
        span_ends.append(len(run))
        key = (self.tok_key, run)
        hit = _RUN_CACHE.get(key)
        run_ids = fast.try_ids(run) if hit is None else hit[0] if hit[1] is None else None
        ends = None if run_ids is None else fast.ends_at(run_ids, run, span_ends)
        if run_ids is None or ends is None:  # not fastokens' to encode, or byte lengths that do not add up: the general path
            self.message_text = True
            for k, piece in enumerate(pieces):
                if piece:
                    self._text(piece, message, k % 2 == 1, sampled)  # texts sit at the odd places
        else:
            if hit is None:
                _remember(_RUN_CACHE, key, (run_ids, None))
            n = len(run_ids)
            ids = self.ids
            ids += run_ids
            if isinstance(tail_block, int):  # the tail's added tokens go with the run, as in wrapped
                ids.append(tail_block)
                m = n + 1
            else:
                tail_ids = tail_block or ()  # (never None: checked above)
                ids += tail_ids
                m = n + len(tail_ids)
            self.msg += [message] * m
            self.sampled += [sampled] * m
            content = self.content
            t = 0  # tokens flagged so far
            for j in range(1, len(span_ends), 2):  # the texts' spans: [span_ends[j - 1], span_ends[j])
                start, end = span_ends[j - 1], span_ends[j]
                if end > start:
                    first = max(bisect_right(ends, start), t)  # the first token that ends inside the text
                    k = bisect_right(ends, end, first)  # past the tokens that end inside it ...
                    hi = k + 1 if k < n and (k == 0 or ends[k - 1] < end) else k  # ... and one crossing its end
                    if hi > first:
                        content += [False] * (first - t)
                        content += [True] * (hi - first)
                        t = hi
            content += [False] * (m - t)
            if trail:
                self.pending = (trail, trail_ids, message, sampled)
            return
        if isinstance(tail_block, int):
            self._special(tail_block, message, sampled)
        elif tail_block is not None:
            self._block(tail_block, message, sampled)
        if trail:
            self.pending = (trail, trail_ids, message, sampled)

    def _flush(self) -> None:
        """Encode the current run and attribute its tokens."""
        parts = self.parts
        text = parts[0] if len(parts) == 1 else "".join(parts)
        cache = _RUN_CACHE if self.message_text else _TEMPLATE_RUNS
        key = (self.tok_key, text)
        hit = cache.get(key)
        attrs = self.attrs
        if hit is None:
            fast = self.fast
            run_ids = fast.try_ids(text) if fast is not None else None
            if run_ids is None:  # no fastokens here, or not for this text: the library's ids and offsets
                hit = self.tok.encode_plain_with_ends(text) if fast is None else library_encode(fast.plain, text)
                run_ids = hit[0]
            else:  # an entry without ends holds fastokens' own ids (FastEncoder.ends_at relies on it)
                hit = (run_ids, None)
            _remember(cache, key, hit)
        else:
            run_ids = hit[0]
        if len(attrs) == 1:  # one attribution (most runs): the ids are enough
            n = len(run_ids)
            message, content, sampled = attrs[0]
            self.ids += run_ids
            self.msg += [message] * n
            self.content += [content] * n
            self.sampled += [sampled] * n
        else:
            ends = hit[1]
            if ends is None:
                fast = self.fast
                assert fast is not None  # an entry without ends holds fastokens' ids
                ends = fast.ends_at(run_ids, text, self.ends)
                if ends is None:  # the byte lengths do not add up: the library's ids and offsets
                    hit = library_encode(fast.plain, text)
                    _remember(cache, key, hit)
                    run_ids, ends = hit
            self.ids += run_ids
            _attribute(run_ids, ends, self.ends, attrs, self.msg, self.content, self.sampled)
        self.parts = []
        self.ends = []
        self.attrs = []
        self.last = None
        self.pos = 0
        self.message_text = False

    def encode(self) -> RenderedTokens:
        self._end_run()
        return RenderedTokens(token_ids=self.ids, message_indices=self.msg, sampled_mask=self.sampled, is_content=self.content)


# ---- caches -----------------------------------------------------------------------------------------
# Every cache of encoded text lives here, module-wide (renders of one tokenizer share them), keyed by
# tokenizer_key so that no two tokenizers ever share an entry. Each is bounded and simply cleared when
# full; clear_caches() empties them for benchmarks of never-seen content.
#
# _SPLITS          tokenizer key -> scaffold text -> its Split: the template's own strings (a render of
#                  never-seen content finds the compiled template here, not an encoding of that content)
# _TEMPLATE_RUNS   (key, run text) -> (ids, token end offsets or None): runs of template text only
# _RUN_CACHE       the same for runs holding message text. Repeated runs are the common case in RL: a
#                  group of rollouts shares its prompt; system prompts and tool definitions repeat.
#                  Ends None: fastokens' own ids, the ends recomputed from them (FastEncoder.ends_at)
# _RENDER_CACHE    whole long renders (long_pieces.LongPieces) as four arrays, ~18 bytes a token
# _TOKENIZER_KEYS  tokenizer -> its key (see tokenizer_key)
_CACHE_LIMIT = 8192  # entries per text cache
_RUN_CACHE_CHARS = 16384  # longer runs are not cached
_SPLITS: dict[int, dict[str, Split]] = {}
_TEMPLATE_RUNS: dict[tuple[int, str], tuple[list[int], list[int] | None]] = {}
_RUN_CACHE: dict[tuple[int, str], tuple[list[int], list[int] | None]] = {}
_RENDER_CACHE: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
_RENDER_CACHE_LIMIT = 128  # renders (a group of rollouts renders one prompt several times)
_RENDER_CACHE_TOKENS = 32768  # tokens per cached render at most
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


def _remember(cache: dict, key: tuple[int, str], value: tuple[list[int], list[int] | None]) -> None:
    if len(key[1]) <= _RUN_CACHE_CHARS:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = value


def _splits_for(tok: Tokenizer, tok_key: int) -> dict[str, Split]:
    splits = _SPLITS.get(tok_key)
    if splits is None:
        if len(_SPLITS) >= 64:  # tokenizers, not texts: a process holds a handful
            _SPLITS.clear()
        splits = _SPLITS[tok_key] = {}
    return splits


def _split(tok: Tokenizer, splits: dict[str, Split], text: str) -> Split:
    parts = tok.split_added(text)
    at = [k for k, part in enumerate(parts) if isinstance(part, int)]
    if not at:
        split = Split(text, tok.encode_plain_ids(text), None, "", [])
    else:
        first, last = at[0], at[-1]
        lead = "".join(p for p in parts[:first] if isinstance(p, str))  # (all of them are)
        trail = "".join(p for p in parts[last + 1 :] if isinstance(p, str))
        ids: list[int] = []
        for part in parts[first : last + 1]:  # the text between two added tokens is a whole run: encoded once
            if isinstance(part, int):
                ids.append(part)
            else:
                ids += tok.encode_plain_ids(part)
        added: Added = ids[0] if first == last else tuple(ids)
        split = Split(lead, tok.encode_plain_ids(lead), added, trail, tok.encode_plain_ids(trail))
    if len(splits) >= _CACHE_LIMIT:
        splits.clear()
    if len(text) < 512:
        splits[text] = split
    return split


def _attribute(run_ids, ends, span_ends, attrs, msg, content, sampled) -> None:
    """Attribute each token of a run of several spans by the spans its characters overlap.

    Token i covers characters [ends[i-1], ends[i]); span j ends at ``span_ends[j]``. Tokens inside one
    span take its attributes in bulk; a token over several spans (BPE merged across a boundary) counts
    as content if any of them is, belongs to the message of its first content span (else of its first
    span), and is sampled only if all of them are. A token that completes a character split over
    tokens covers no character of its own: it goes with the one it completes.
    """
    n = len(run_ids)
    nspans = len(span_ends)
    t = 0
    prev_end = 0  # where the tokens attributed so far end
    start = 0
    for j in range(nspans):
        end = span_ends[j]
        if t >= n or (prev_end >= end and (ends[t] != end or start == end)):
            start = end
            continue  # an earlier spanning token covered this span (but not what completes its last character)
        hi = bisect_right(ends, end, t)  # tokens t..hi-1 end inside this span
        count = hi - t
        message, is_content, is_sampled = attrs[j]
        if count:
            msg += [message] * count
            content += [is_content] * count
            sampled += [is_sampled] * count
            prev_end = ends[hi - 1]
            t = hi
        if t < n and prev_end < end:  # token t starts in this span and ends in a later one
            token_end = ends[t]
            content_owner, all_sampled = None, True
            k, k_start = j, start
            while k < nspans and k_start < token_end:
                other_message, other_content, other_sampled = attrs[k]
                if other_content and content_owner is None:
                    content_owner = other_message
                all_sampled = all_sampled and other_sampled
                k_start = span_ends[k]
                k += 1
            msg.append(content_owner if content_owner is not None else message)
            content.append(content_owner is not None)
            sampled.append(all_sampled)
            prev_end = token_end
            t += 1
        start = end
