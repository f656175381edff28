"""Recipes: a generic render or bridge tail made once with a sentinel for each message text, reused
with the real texts put in.

A recipe holds the render's text as literal parts and text slots, its pieces as *segments* (the runs
without a text already encoded, the runs holding a text as pieces with slots), and the trace of what
the template does with the texts (renderers/tracked.py). It applies to texts that are plain (no
added-token string, no private-use character), for which every test the template made gives the same
answer, and whose edges do not touch a letter or digit of the template (there the annotation would
not count the text as content, as BPE merges it with the template's text):

    segments = split_segments(tok, pieces)        # once, when the recipe is built
    if applies(parts, texts): rendered = fill(tok, segments, texts)
"""

from __future__ import annotations

import re
from typing import Any

from .annotate import glued
from .long_pieces import encode_pieces
from .pieces import Piece
from .tokenizer import Tokenizer
from .types import RenderedTokens

# A text slot in a recipe's pieces: SLOT + its index (special token ids are far below it).
SLOT = 1 << 40
SENTINEL_BASE = 0xF8300  # text i's sentinel is chr(SENTINEL_BASE + i), above the probe's and the marks'
UNSAFE = re.compile("[\U000f0000-\U0010ffff]")  # supplementary private use: the sentinels' planes


def sentinel(i: int) -> str:
    return chr(SENTINEL_BASE + i)


def plain(texts: list[Any], added: re.Pattern | None) -> bool:
    """Every text is a string with some non-space character and neither a private-use character nor
    an added-token string (those take the annotation's defusing path)."""
    if not all(t.__class__ is str and t.strip() and not UNSAFE.search(t) for t in texts):
        return False
    return added is None or not any(added.search(t) for t in texts)


def split_parts(full: str, count: int) -> list[str | int] | None:
    """``full`` as literal strings and text indices, where each of ``count`` sentinels occurs exactly
    once; None otherwise."""
    found = [full.find(sentinel(i)) for i in range(count)]
    if any(at < 0 or full.count(sentinel(i)) != 1 for i, at in enumerate(found)):
        return None
    parts: list[str | int] = []
    pos = 0
    for at, i in sorted((at, i) for i, at in enumerate(found)):
        parts += [full[pos:at], i] if at > pos else [i]
        pos = at + 1
    parts.append(full[pos:])
    return parts


def with_slots(pieces: list[Piece], count: int) -> list[Piece] | None:
    """``pieces`` with each sentinel piece as its slot; None where a sentinel is not one content piece
    of its own (the annotation did not find it as the message's text)."""
    by_text = {sentinel(i): i for i in range(count)}
    out: list[Piece] = []
    for value, k, is_content, sampled in pieces:
        if value.__class__ is str and UNSAFE.search(value):
            if value not in by_text or not is_content:
                return None
            value = SLOT + by_text[value]
        out.append((value, k, is_content, sampled))
    return out


def split_segments(tok: Tokenizer, pieces: list[Piece]) -> list[RenderedTokens | list[Piece]]:
    """``pieces`` (with slots) as segments: encoded tokens where no text goes (special tokens and the
    runs between them), the pieces of each run that holds a slot. A run ends at a special token, which
    tokenization never crosses, so encoding the segments apart gives the same tokens as the whole."""
    runs: list[list[Piece]] = [[]]
    for piece in pieces:
        value = piece[0]
        if value.__class__ is int and value < SLOT:
            runs += [[piece], []]
        else:
            runs[-1].append(piece)
    segments: list[RenderedTokens | list[Piece]] = []
    fixed: list[Piece] = []
    for run in runs:
        if any(v.__class__ is int and v >= SLOT for v, *_ in run):
            if fixed:
                segments.append(encode_pieces(tok, fixed))
                fixed = []
            segments.append(run)
        else:
            fixed += run
    if fixed:
        segments.append(encode_pieces(tok, fixed))
    return segments


def applies(parts: list[str | int], texts: list[str]) -> str | None:
    """The render's text with ``texts`` put in, or None where a text's stripped core touches a letter
    or digit of the template (the annotation's rule: then it is not content, and the recipe's pieces
    would say it is)."""
    expected = [part if part.__class__ is str else texts[part] for part in parts]
    full = "".join(expected)
    pos = 0
    for part, text in zip(parts, expected):
        if part.__class__ is not str:
            lead = len(text) - len(text.lstrip())
            if glued(full, pos + lead, pos + lead + len(text.strip())):
                return None
        pos += len(text)
    return full


def fill(tok: Tokenizer, segments: list[RenderedTokens | list[Piece]], texts: list[str]) -> RenderedTokens:
    """The recipe's tokens with ``texts`` in their slots: each run holding a text encoded with it (kept
    verbatim, edge whitespace included: its content span is the whole text, as the annotation finds)."""
    ids: list[int] = []
    message_indices: list[int] = []
    sampled: list[bool] = []
    content: list[bool] = []
    for segment in segments:
        if segment.__class__ is not RenderedTokens:
            segment = encode_pieces(tok, [
                (texts[v - SLOT], k, True, s) if v.__class__ is int and v >= SLOT else (v, k, c, s)
                for v, k, c, s in segment])
        ids += segment.token_ids
        message_indices += segment.message_indices
        sampled += segment.sampled_mask
        content += segment.is_content
    return RenderedTokens(ids, message_indices, sampled, content)
