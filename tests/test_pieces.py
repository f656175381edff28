"""Every way pieces become tokens (run by run as they come, a long render collected and vectorised over
one fastokens call, and that render replayed run by run where the vectorised path declines) against an
independent reference: the tokenizers library's ids and character offsets for each run between special
tokens, attributed character by character."""

from __future__ import annotations

import random

import pytest

from tito_renderers import long_pieces as L
from tito_renderers import pieces as P
from tito_renderers.fast_encode import library_encode

from ._support import SMOLLM2

FIXTURES = ("qwen3-0.6b", "gemma-3-it", "llama-3.1-8b-instruct", SMOLLM2)
SPECIALS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<|eot_id|>", "<think>", "</think>")
TEXTS = (
    "Hello", " world", ", it's", "\n", "\n\n", "  ", "\t", "def f(x):\n    return x", '{"query": "q0"}', " {", '"',
    "数据", "模型训练", "Привет", " мир", "تجربة", "🙂", "👍🏽", "👨‍👩‍👧", "\u0301", "ﬁ",
    "<|im_end|>", "<think>", "<0x41>", "aaaaaaaaaaaa", "1234", " 56", "...", "\r\n",
)
# text the fast paths hand to the tokenizers library: NFC would change it (an NFC vocabulary), it holds
# SentencePiece's space, whose byte length is not the text's, or a byte fastokens has no token for
# (SmolLM2's GGUF conversion)
DECLINED = ("e\u0301", "\u212b", "▁x", "\x04")
LONG_TEXT = "def f(x):\n    return {'a': [1, 2, 3]}  # 数据 🙂 done\n" * 6  # a run long enough to be walked from both ends


def _split(tok, text: str) -> list[str | int]:
    """The reference's split of scaffold text on added-token strings: the longest one at the earliest place."""
    out: list[str | int] = []
    i = start = 0
    while i < len(text):
        hit = max((t for t in tok.added_tokens if text.startswith(t, i)), key=len, default=None)
        if hit is None:
            i += 1
            continue
        if i > start:
            out.append(text[start:i])
        out.append(tok.added_tokens[hit])
        i = start = i + len(hit)
    if start < len(text):
        out.append(text[start:])
    return out


def _reference(tok, ops) -> tuple[list[int], list[int], list[bool], list[bool]]:
    """Each run between added tokens encoded by the tokenizers library; a token's attribution from the
    characters it covers: content if any is, the message of its first content character (else of its
    first character), sampled only if all are. A token that completes a character split over tokens
    covers no character: it goes with the character it completes."""
    items: list[tuple[str | int, int, bool, bool]] = []
    for kind, value, message, sampled, content in ops:
        if kind in ("wrapped", "fields"):  # scaffold, message texts (scaffold between them), scaffold
            head, texts, separators, tail = (value[0], (value[1],), (), value[2]) if kind == "wrapped" else value
            extra, extra_message = value[3:] if kind == "wrapped" else ("", -1)
            items += [(part, message, False, sampled) for part in _split(tok, head)]
            for k, text in enumerate(texts):
                if k:
                    items += [(part, message, False, sampled) for part in _split(tok, separators[k - 1])]
                items += [(text, message, True, sampled)] if text else []
            if extra:  # another owner's text (not content), the tail then that owner's too
                items.append((extra, extra_message, False, sampled))
                message = extra_message
            items += [(part, message, False, sampled) for part in _split(tok, tail)]
        elif kind == "special":
            items.append((tok.added_tokens[value], message, False, sampled))
        elif kind == "scaffold":
            items += [(part, message, False, sampled) for part in _split(tok, value)]
        elif value:
            items.append((value, message, content, sampled))
    ids, msg, sampled, is_content = [], [], [], []
    run: list[tuple[str, int, bool, bool]] = []

    def flush() -> None:
        text = "".join(piece[0] for piece in run)
        char_attr = [piece[1:] for piece in run for _ in piece[0]]
        run_ids, ends = library_encode(tok._plain, text)
        prev = 0
        for tid, end in zip(run_ids, ends, strict=True):
            chars = range(prev, end) if end > prev else range(end - 1, end)
            attrs = [char_attr[c] for c in chars]
            firsts = [a for a in attrs if a[1]]
            ids.append(tid)
            msg.append(firsts[0][0] if firsts else attrs[0][0])
            is_content.append(bool(firsts))
            sampled.append(all(a[2] for a in attrs))
            prev = end
        run.clear()

    for value, message, content, was_sampled in items:
        if isinstance(value, int):
            if run:
                flush()
            ids.append(value)
            msg.append(message)
            sampled.append(was_sampled)
            is_content.append(False)
        else:
            run.append((value, message, content, was_sampled))
    if run:
        flush()
    return ids, msg, sampled, is_content


def _random_ops(tok, rng: random.Random, n: int) -> list[tuple]:
    specials = [t for t in SPECIALS if t in tok.added_tokens]
    ops = []
    for _ in range(n):
        kind = rng.random()
        message = rng.randrange(-1, 4)
        sampled = rng.random() < 0.5
        if kind < 0.12:
            ops.append(("special", rng.choice(specials), message, sampled, False))
        elif kind < 0.2:  # a message's text between two scaffold strings, mostly each with an added token
            head, tail = (rng.choice(("\n", "", "user\n")) + (rng.choice(specials) if rng.random() < 0.8 else "")
                          + rng.choice(("\n", "", "user\n", " ")) for _ in range(2))
            pool = DECLINED if rng.random() < 0.01 else (LONG_TEXT,) if rng.random() < 0.2 else TEXTS
            text = "".join(rng.choice(pool) for _ in range(rng.randrange(0, 4)))
            if rng.random() < 0.5:  # now and then with another owner's text before the tail (tool definitions)
                extra = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 3))) if rng.random() < 0.3 else ""
                ops.append(("wrapped", (head, text, tail, extra, rng.randrange(-1, 4)), message, sampled, True))
            else:  # several texts, scaffold between them (a separator holding an added token now and then)
                texts = tuple("".join(rng.choice(pool) for _ in range(rng.randrange(0, 3))) for _ in range(rng.randrange(1, 4)))
                separators = tuple(rng.choice(('", "arguments": ', " ", "", "\n", f"{rng.choice(specials)}" if rng.random() < 0.1 else ","))
                                   for _ in texts[1:])
                ops.append(("fields", (head, texts, separators, tail), message, sampled, True))
        elif kind < 0.3:  # a turn's fixed tokens as one scaffold string: a block of tokens inside it
            a, b = rng.choice(specials), rng.choice(specials)
            ops.append(("scaffold", rng.choice(("", "\n")) + f"{a}\n{b}user" + rng.choice(("", "\n", f"{a}")), message, sampled, False))
        elif kind < 0.42:
            ops.append(("scaffold", rng.choice(TEXTS), message, sampled, False))
        else:
            pool = DECLINED if rng.random() < 0.002 else (LONG_TEXT,) if rng.random() < 0.03 else TEXTS
            text = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 4)))
            ops.append(("text", text, message, sampled, rng.random() < 0.7))
    return ops


def _apply(p, ops):
    for kind, value, message, sampled, content in ops:
        if kind == "wrapped":
            head, text, tail, extra, extra_message = value
            p.wrapped(head, text, tail, message, sampled, extra, extra_message)
        elif kind == "fields":
            p.fields(*value, message, sampled)
        elif kind == "special":
            p.special(value, message, sampled)
        elif kind == "scaffold":
            p.scaffold(value, message, sampled)
        else:
            p.text(value, message, sampled=sampled, content=content)
    return p


def _lists(out) -> tuple:
    return out.token_ids, out.message_indices, out.sampled_mask, out.is_content


@pytest.mark.parametrize("name", FIXTURES)
def test_every_encoding_path_attributes_as_the_reference(name, tokenizers, monkeypatch):
    tok = tokenizers.get(name).ours
    fast = tok.fast_encoder
    assert fast is not None
    rng = random.Random(name)
    took = 0
    for case in range(150):
        ops = _random_ops(tok, rng, rng.choice((3, 12, 40, 120)))
        want = _reference(tok, ops)
        for cached in (False, True):  # never-seen runs, then the same runs from the run cache
            if not cached:
                P.clear_caches(template=True)
            assert _lists(_apply(P.Pieces(tok), ops).encode()) == want, f"run by run, case {case}, cached {cached}"
        long = _apply(L.LongPieces(tok), ops)
        long.finish()
        for joined_max in (0, 10**9):  # one fastokens batch call, or the runs encoded joined in this thread
            monkeypatch.setattr(L, "_JOINED_MAX_CHARS", joined_max)
            vec = L.encode_vectorised(fast, long)
            if vec is not None:
                took += 1
                assert tuple(a.tolist() for a in vec) == want, f"vectorised, case {case}, joined up to {joined_max}"
        monkeypatch.undo()
        assert _lists(long.replay().encode()) == want, f"replayed, case {case}"
        P.clear_caches()
        assert _lists(long.encode()) == want, f"LongPieces.encode, case {case}"
    # the vectorised path declines only the rare DECLINED texts: most cases take it
    assert took > 200, took


def test_a_scaffold_string_equals_its_pieces(tokenizers):
    """A turn's fixed tokens written as one scaffold string (its runs between added tokens encoded once,
    with the split) give what the same tokens written piece by piece give."""
    tok = tokenizers.get("qwen3-0.6b").ours
    P.clear_caches(template=True)
    one = P.Pieces(tok)
    one.text("result", 2)
    one.scaffold("\n</tool_response><|im_end|>\n<|im_start|>user\n<tool_response>\n", 2)
    one.text("next", 2)
    apart = P.Pieces(tok)
    apart.text("result", 2)
    apart.scaffold("\n", 2)
    for token, text in (("</tool_response>", ""), ("<|im_end|>", "\n"), ("<|im_start|>", "user\n"), ("<tool_response>", "\n")):
        apart.special(token, 2)
        if text:
            apart.scaffold(text, 2)
    apart.text("next", 2)
    got = _lists(one.encode())
    assert got == _lists(apart.encode())
    assert tok.decode(got[0]) == "result\n</tool_response><|im_end|>\n<|im_start|>user\n<tool_response>\nnext"


def test_text_fastokens_refuses_goes_to_the_library(tokenizers):
    """SmolLM2's GGUF vocabulary has no token for byte 0x04: fastokens refuses the text, the vectorised
    path declines the render and the pieces are encoded run by run, that text by the tokenizers library."""
    tok = tokenizers.get(SMOLLM2).ours
    ops = []
    for k in range(50):
        ops.append(("special", "<|im_start|>", k, False, False))
        ops.append(("scaffold", "user\n", k, False, False))  # a run of several spans: it needs offsets
        ops.append(("text", f"turn {k} \x04 of 50 " * (8 if k == 7 else 1), k, k % 2 == 1, True))
    long = _apply(L.LongPieces(tok), ops)
    long.finish()
    assert L.encode_vectorised(tok.fast_encoder, long) is None
    P.clear_caches()
    want = _reference(tok, ops)
    assert _lists(long.encode()) == want
    P.clear_caches()
    assert _lists(_apply(P.Pieces(tok), ops).encode()) == want


def test_long_renders_are_collected(tokenizers):
    """Renders of many messages go through LongPieces, shorter ones run by run (the test above holds both
    to one reference; the parity suites hold the renders to transformers')."""
    tok = tokenizers.get("qwen3-0.6b").ours
    assert isinstance(L.new_pieces(tok, L._LONG_MESSAGES), L.LongPieces)
    assert isinstance(L.new_pieces(tok, L._LONG_MESSAGES - 1), P.Pieces)
