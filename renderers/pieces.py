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
_RUN_CACHE: dict[tuple[int, str], list[int]] = {}
_CACHE_LIMIT = 4096


def _split_cached(tok: Tokenizer, text: str) -> list[str | int]:
    key = (id(tok), text)
    parts = _SPLIT_CACHE.get(key)
    if parts is None:
        parts = tok.split_added(text)
        if len(_SPLIT_CACHE) < _CACHE_LIMIT and len(text) < 512:
            _SPLIT_CACHE[key] = parts
    return parts


def encode_pieces(tok: Tokenizer, items: list[Piece]) -> RenderedTokens:
    ids: list[int] = []
    msg: list[int] = []
    sampled: list[bool] = []
    content: list[bool] = []
    run: list[Piece] = []

    def flush() -> None:
        if not run:
            return
        text = "".join(p[0] for p in run)  # type: ignore[misc]
        first = run[0]
        uniform = all(p[1] == first[1] and p[2] == first[2] and p[3] == first[3] for p in run)
        if uniform:
            if first[2]:
                run_ids = tok.encode_plain(text)
            else:
                key = (id(tok), text)
                run_ids = _RUN_CACHE.get(key)
                if run_ids is None:
                    run_ids = tok.encode_plain(text)
                    if len(_RUN_CACHE) < _CACHE_LIMIT and len(text) < 512:
                        _RUN_CACHE[key] = run_ids
            n = len(run_ids)
            ids.extend(run_ids)
            msg.extend([first[1]] * n)
            content.extend([first[2]] * n)
            sampled.extend([first[3]] * n)
        else:
            _attribute(tok, text, run, ids, msg, content, sampled)
        run.clear()

    for piece in items:
        if isinstance(piece[0], int):
            flush()
            ids.append(piece[0])
            msg.append(piece[1])
            content.append(False)
            sampled.append(piece[3])
        else:
            run.append(piece)
    flush()
    return RenderedTokens(token_ids=ids, message_indices=msg, sampled_mask=sampled, is_content=content)


def _attribute(tok: Tokenizer, text: str, run: list[Piece], ids, msg, content, sampled) -> None:
    """Encode a mixed run once and attribute each token by the pieces its characters overlap.

    A token that spans pieces (BPE merged across a boundary) counts as content if any of its
    characters is content, belongs to the message of its first content character (else of its
    first character), and is sampled only if all of its characters were.
    """
    bounds = []
    pos = 0
    for p in run:
        end = pos + len(p[0])  # type: ignore[arg-type]
        bounds.append((pos, end, p))
        pos = end
    run_ids, offsets = tok.encode_plain_with_offsets(text)
    j = 0
    for tid, (start, end) in zip(run_ids, offsets):
        if end <= start:
            end = start + 1
        while bounds[j][1] <= start and j < len(bounds) - 1:
            j += 1
        k = j
        is_content = False
        all_sampled = True
        owner = bounds[j][2][1]
        content_owner = None
        while True:
            piece = bounds[k][2]
            if piece[2] and content_owner is None:
                content_owner = piece[1]
                is_content = True
            all_sampled = all_sampled and piece[3]
            if bounds[k][1] >= end or k == len(bounds) - 1:
                break
            k += 1
        ids.append(tid)
        msg.append(content_owner if content_owner is not None else owner)
        content.append(is_content)
        sampled.append(all_sampled)
