"""Stop strings over a token stream (rollout/serve/stops.py) with a real tokenizer (Qwen2.5): text that
could begin a stop string is held back until decided, half a UTF-8 character is never released, the
completion is cut at the first token whose text completes the stop string, and the streamed pieces always
concatenate to the whole text."""

from __future__ import annotations

import pytest

from rollout.serve.stops import TextStream

from ._support import ours, reference

QWEN = "qwen2.5-7b-instruct"


def _stream(ids, stops, include=False):
    tok = ours(QWEN)
    t = TextStream(lambda x: tok.decode(x), stops, include)
    pieces = []
    for i in ids:
        t.feed([i])
        pieces.append(t.take())
    t.finish()
    pieces.append(t.take())
    return t, pieces


def test_a_possible_stop_prefix_is_held_back_until_decided():
    hf = reference(QWEN)
    text = "alpha beta gamma END delta"
    ids = hf(text, add_special_tokens=False)["input_ids"]
    t, pieces = _stream(ids, ["END"])
    assert "".join(pieces) == "alpha beta gamma " and t.stop == "END"
    assert hf.decode(ids[: t.cut]).endswith("END") and "END" not in hf.decode(ids[: t.cut - 1])
    # "gamma E" was never released: after feeding " E..." the released text stops before it
    acc = ""
    for p in pieces:
        acc += p
        assert "alpha beta gamma ".startswith(acc)
    # a prefix of a stop string that turns out not to be one is released once decided
    t, pieces = _stream(hf("an ENDLESS story", add_special_tokens=False)["input_ids"], ["END!"])
    assert "".join(pieces) == "an ENDLESS story" and not t.stopped
    t, pieces = _stream(ids, ["END"], include=True)
    assert "".join(pieces) == "alpha beta gamma END"


@pytest.mark.parametrize("text", ["naïve café — 東京 🙂 ok 𓀀𓀁 𓂀", "𓀀𓀁 𓂀"])
def test_multibyte_characters_are_released_whole(text):
    hf = reference(QWEN)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    t, pieces = _stream(ids, ["zz"])
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    # hieroglyphs take two or three tokens each: the tokens carrying half a character released nothing
    assert len(ids) > len([p for p in pieces if p])
