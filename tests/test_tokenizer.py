"""Loading tokenizers offline, and the two encoders a renderer relies on."""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tito_renderers as renderers
from tito_renderers.tokenizer import TokenizerLoadError

from ._support import ours, reference, smollm2_gguf, tokenizer_dir

SAFE_ASCII = st.text(alphabet=st.sampled_from([chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n", "\r"]), max_size=80)
TRICKY = st.text(alphabet=st.sampled_from(list(" \t\n\r'sdlmtvreSDLM0123456789aZ.,{}[]\"!?-_/\\")), max_size=40)
# non-ASCII: scripts, emoji (ZWJ sequences, skin tones, flags), combining marks, whitespace runs
# (including non-ASCII spaces), and any code point Python can encode (surrogates excluded)
MULTILINGUAL = st.lists(
    st.sampled_from(
        list("数据東京タワー서울привет γειά مرحبا שלום हिन्दी ไทย éüßİıÅ ½²①")
        + ["👨\u200d👩\u200d👧", "👍🏽", "🇩🇪", "❤️", "🙂", "e\u0301", "\u00a0", "\u3000", "\u2028", "\u200b", "\ufeff",
           "\x0b", "\x1c", " ", "  ", "\n\n", "\t", "word", "'ll", "42"]
    ),
    max_size=40,
).map("".join)
ANY_TEXT = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=60)
RUNS = st.lists(st.sampled_from([" ", "\n", "\t", "\r\n", "\u00a0", "x", "数", "🙂", "'s", "12345"]), max_size=30).map("".join)
FIXTURES = ["qwen3-0.6b", "qwen2.5-7b-instruct", "qwen3-coder-30b-a3b-instruct", "deepseek-r1-distill-qwen-32b",
            "llama-3.1-8b-instruct", "llama-3.2-3b-instruct", "llama-3.3-nemotron-super-49b-v1.5", "gpt-oss-20b",
            "gemma-3-it", "deepseek-v3", "deepseek-r1", "smollm2"]


@pytest.mark.slow
@pytest.mark.parametrize("name", FIXTURES)
def test_fastokens_encoding_matches_the_tokenizers_library(name):
    """fastokens ids with end offsets from vocabulary byte lengths must equal the tokenizers library's
    ids and offsets on every fixture tokenizer (the message-text view, as renderers encode), for
    ASCII, multilingual, emoji, combining-mark, whitespace-run and arbitrary Unicode text; every
    fixture vocabulary passes the load-time battery and takes the fastokens path."""
    from tito_renderers.fast_encode import library_encode

    tok = ours(name).text_view
    assert tok.fast_encoder is not None, "every fixture vocabulary should be encoded by fastokens"

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.one_of(SAFE_ASCII, TRICKY, MULTILINGUAL, ANY_TEXT, RUNS))
    def check(text):
        expected = library_encode(tok._plain, text)
        assert tok.encode_plain_with_ends(text) == expected
        assert tok.encode_plain_ids(text) == expected[0]
        ids = tok.fast_encoder.try_ids(text)
        if ids is None:  # NFC would change it, or fastokens refuses it: the library encodes
            return
        assert ids == expected[0]
        # span ends at a third and two thirds of the text: every bisect on them, and the end of each
        # token next to them, as the library's offsets say (a token ending strictly inside the longest
        # span may get another value strictly inside it)
        span_ends = sorted({len(text) // 3, 2 * len(text) // 3, len(text)} - {0})
        got = tok.fast_encoder.ends_at(ids, text, span_ends)
        if got is None:  # byte lengths that do not add up (SentencePiece's own space, Gemma's whitespace
            return  # tokens): the library's offsets are used (tests/test_pieces.py covers that path)
        if not text:
            return
        starts = [0, *span_ends[:-1]]
        start_l, end_l = max(zip(starts, span_ends, strict=True), key=lambda span: span[1] - span[0])
        for b in span_ends:
            at = bisect_right(expected[1], b)
            assert bisect_right(got, b) == at
            for k in (at - 1, at):  # the tokens each side of the span end, unless wholly inside the longest span
                if 0 <= k < len(got) and not start_l < expected[1][k] < end_l:
                    assert got[k] == expected[1][k]

    check()
    for text in ["数据 🙂", "plain", "", "e\u0301 not NFC", "  \n\n  "]:
        assert tok.encode_plain_ids(text) == library_encode(tok._plain, text)[0]


def _small_byte_level_bpe():
    """A real byte-level BPE tokenizer, trained here on a few lines (quick to build, unlike a fixture's)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Hello world, hello tokens.", "数据 科学 🙂", "def f(x): return x"] * 10, trainer)
    return tok


def test_fastokens_is_not_used_where_the_rule_or_the_battery_says_no(monkeypatch):
    from tokenizers import Tokenizer as Backend

    from tito_renderers import fast_encode

    plain = _small_byte_level_bpe()
    config = json.loads(plain.to_str())
    assert fast_encode._kind(config) == "byte_level"
    assert fast_encode._kind({**config, "normalizer": {"type": "NFKC"}}) is None  # changes lengths
    prefix = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    assert fast_encode._kind({**config, "pre_tokenizer": prefix}) is None  # adds a space the text lacks
    assert fast_encode._kind({**config, "model": {**config["model"], "dropout": 0.1}}) is None
    assert fast_encode._kind({**config, "model": {**config["model"], "type": "WordPiece"}}) is None
    encoder = fast_encode.FastEncoder.for_backend(plain)
    assert encoder is not None and encoder.encode("Hello 数据 🙂") == fast_encode.library_encode(plain, "Hello 数据 🙂")
    # a vocabulary that passes the rule but where the library disagrees: the battery catches it
    monkeypatch.setattr(fast_encode, "library_encode", lambda _p, text: ([0], [len(text)]))
    assert fast_encode.FastEncoder.for_backend(Backend.from_str(plain.to_str())) is None


def test_text_nfc_would_change_is_encoded_by_the_library():
    """Qwen's normalizer is NFC: byte lengths of normalized tokens do not measure the original text,
    so such text goes to the tokenizers library (offsets in the text as given)."""
    from tito_renderers.fast_encode import library_encode

    tok = ours("qwen3-0.6b")
    text = "cafe\u0301 \u212b"
    assert tok.encode_plain_with_ends(text) == library_encode(tok._plain, text)
    assert library_encode(tok._plain, text)[1][-1] == len(text)


def test_plain_encoding_never_produces_added_tokens():
    tok = ours("qwen3-0.6b")
    text = "<|im_end|>\n<|im_start|>user\n<think><tool_call>"
    assert not set(tok.encode_plain(text)) & tok.special_ids
    assert tok.decode(tok.encode_plain(text)) == text
    assert set(tok.encode(text)) & tok.special_ids  # the reference behaviour, for scaffold text


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2.5-7b-instruct", "deepseek-r1-distill-qwen-32b"])
def test_load_directory(name):
    path = tokenizer_dir(name)
    tok = renderers.load_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert tok.chat_template == config["chat_template"]
    assert tok.template_sha256 == hashlib.sha256(config["chat_template"].encode()).hexdigest()
    assert tok.vocab_size == len(reference(name))
    sample = "Hello, wörld! 数据 <|im_end|>"
    assert tok.encode(sample) == reference(name)(sample, add_special_tokens=False)["input_ids"]


def test_load_gguf_reads_template_and_caches_the_conversion(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("TITO_CACHE", str(tmp_path))
    path = smollm2_gguf()
    tok = renderers.load_tokenizer(path)
    field = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"]
    assert tok.chat_template == bytes(field.parts[field.data[0]]).decode("utf-8")
    assert tok.template_sha256.startswith("872be49dbb638044")
    assert list(tmp_path.glob("tokenizers/*/tokenizer.json")), "the conversion is cached"
    again = renderers.load_tokenizer(path)
    assert again.encode("Hi there") == tok.encode("Hi there")
    assert again.chat_template == tok.chat_template


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(TokenizerLoadError, match="no such file"):
        renderers.load_tokenizer(tmp_path / "absent")
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        renderers.load_tokenizer(tmp_path)
    bad = tmp_path / "x.txt"
    bad.write_text("hi")
    with pytest.raises(TokenizerLoadError, match="expected a tokenizer directory"):
        renderers.load_tokenizer(bad)


def test_create_renderer_errors():
    tok = ours("qwen3-0.6b")
    with pytest.raises(ValueError, match="unknown renderer 'nope'"):
        renderers.create_renderer(tok, name="nope")
    with pytest.raises(ValueError, match="no template kwarg 'enable_thinkin'"):
        renderers.create_renderer(tok, enable_thinkin=False)
    with pytest.raises(ValueError, match="must be bool"):
        renderers.create_renderer(tok, enable_thinking="no")
    with pytest.raises(ValueError, match="thinking_retention"):
        renderers.create_renderer(tok, thinking_retention="sometimes")


def test_markers_and_text_view_of_a_vocabulary_without_text_level_added_tokens():
    from ._support import ours

    tok = ours("qwen3-0.6b")
    assert tok.markers == tok.added_tokens and "<think>" in tok.markers  # <think> is not flagged special
    assert tok.text_view is tok
    other = tok.with_chat_template("{{ messages }}")
    assert other.text_view is other and other.markers == tok.markers


def test_encoding_caches_never_serve_a_freed_tokenizers_ids(qwen3_tok):
    """The encoding caches are keyed per tokenizer object. ``id()`` was that key, but a freed tokenizer's
    address is reused by the next object allocated, which then read the dead one's cached ids (another
    vocabulary's). A copy made at a reused address gets a fresh key."""
    import copy
    import gc

    from tito_renderers.pieces import tokenizer_key

    seen: dict[int, int] = {}
    reused = False
    for _ in range(200):
        other = copy.copy(qwen3_tok.ours)
        address, key = id(other), tokenizer_key(other)
        if address in seen:
            reused = True
            assert key != seen[address]
        seen[address] = key
        del other
        gc.collect()
        if reused:
            break
    assert reused, "CPython reuses a freed object's address for the next one of its size"
    assert tokenizer_key(qwen3_tok.ours) == tokenizer_key(qwen3_tok.ours)
