"""Both ways pieces become tokens (run by run, and long renders vectorised over one fastokens call)
against an independent reference: the tokenizers library's ids and character offsets for each run
between special tokens, attributed character by character."""

from __future__ import annotations

import random

import pytest

from tito_renderers import pieces as P
from tito_renderers.fast_encode import library_encode

from ._support import SMOLLM2

FIXTURES = ("qwen3-0.6b", "gemma-3-it", "llama-3.1-8b-instruct", SMOLLM2)
TEXTS = (
    "Hello", " world", ", it's", "\n", "\n\n", "  ", "\t", "def f(x):\n    return x", '{"query": "q0"}', " {", '"',
    "数据", "模型训练", "Привет", " мир", "تجربة", "🙂", "👍🏽", "👨‍👩‍👧", "\u0301", "ﬁ",
    "<|im_end|>", "<think>", "<0x41>", "aaaaaaaaaaaa", "1234", " 56", "...", "\r\n",
)
# text the fast paths hand to the tokenizers library: NFC would change it (an NFC vocabulary), it holds
# SentencePiece's space, whose byte length is not the text's, or a byte fastokens has no token for
# (SmolLM2's GGUF conversion)
DECLINED = ("e\u0301", "\u212b", "▁x", "\x04")


def _reference(tok, p: P.Pieces) -> tuple[list[int], list[int], list[bool], list[bool]]:
    """Each run encoded by the tokenizers library; a token's attribution from the characters it covers:
    content if any is, the message of its first content character (else of its first character),
    sampled only if all are. A token that completes a character split over tokens covers no character:
    it goes with the character it completes."""
    ids, msg, sampled, content = [], [], [], []
    starts = [0, *p.span_end][: len(p.span_end)]
    char_span = [k for k, (a, b) in enumerate(zip(starts, p.span_end, strict=True)) for _ in range(b - a)]
    pos = 0
    k = 0
    for r, run in enumerate(p.runs):
        while k < len(p.sp_ids) and p.sp_run[k] <= r:
            ids.append(p.sp_ids[k])
            msg.append(p.sp_msg[k])
            sampled.append(p.sp_sampled[k])
            content.append(False)
            k += 1
        run_ids, ends = library_encode(tok._plain, run)
        prev = 0
        for tid, end in zip(run_ids, ends, strict=True):
            chars = range(pos + prev, pos + end) if end > prev else range(pos + end - 1, pos + end)
            spans = [char_span[c] for c in chars]
            firsts = [s for s in spans if p.span_content[s]]
            ids.append(tid)
            msg.append(p.span_msg[firsts[0]] if firsts else p.span_msg[spans[0]])
            content.append(bool(firsts))
            sampled.append(all(p.span_sampled[s] for s in spans))
            prev = end
        pos += len(run)
    for j in range(k, len(p.sp_ids)):
        ids.append(p.sp_ids[j])
        msg.append(p.sp_msg[j])
        sampled.append(p.sp_sampled[j])
        content.append(False)
    return ids, msg, sampled, content


def _random_pieces(tok, rng: random.Random, n: int) -> P.Pieces:
    specials = [t for t in ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<|eot_id|>") if t in tok.added_tokens]
    p = P.Pieces(tok)
    for _ in range(n):
        kind = rng.random()
        message = rng.randrange(-1, 4)
        if kind < 0.15:
            p.special(rng.choice(specials), message, rng.random() < 0.5)
        elif kind < 0.35:
            p.scaffold(rng.choice(TEXTS), message, rng.random() < 0.5)
        else:
            text = "".join(rng.choice(DECLINED if rng.random() < 0.002 else TEXTS) for _ in range(rng.randrange(1, 4)))
            p.text(text, message, sampled=rng.random() < 0.5, content=rng.random() < 0.7)
    p._finish()
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
        p = _random_pieces(tok, rng, rng.choice((3, 12, 40, 120)))
        want = _reference(tok, p)
        P.clear_caches()
        assert _lists(P._encode_runs(tok, p)) == want, f"run by run, case {case}"
        for joined_max in (0, 10**9):  # one fastokens batch call, or the runs encoded joined in this thread
            monkeypatch.setattr(P, "_JOINED_MAX_CHARS", joined_max)
            vec = P._encode_vectorised(fast, p)
            if vec is not None:
                took += 1
                assert tuple(a.tolist() for a in vec) == want, f"vectorised, case {case}, joined up to {joined_max}"
        monkeypatch.undo()
        assert _lists(p.encode()) == want, f"Pieces.encode, case {case}"
    # the vectorised path declines only the rare DECLINED texts: most cases take it
    assert took > 200, took


def test_text_fastokens_refuses_goes_to_the_library(tokenizers):
    """SmolLM2's GGUF vocabulary has no token for byte 0x04: fastokens refuses the text, the vectorised
    path declines the render and the run-by-run path encodes it with the tokenizers library."""
    tok = tokenizers.get(SMOLLM2).ours
    p = P.Pieces(tok)
    for k in range(50):  # enough pieces for the vectorised path
        p.special("<|im_start|>", k)
        p.text(f"turn {k} \x04 of 50" if k == 7 else f"turn {k}", k, sampled=k % 2 == 1)
    p._finish()
    assert P._encode_vectorised(tok.fast_encoder, p) is None
    P.clear_caches()
    assert _lists(p.encode()) == _reference(tok, p)
