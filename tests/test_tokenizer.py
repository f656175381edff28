"""Loading tokenizers offline, and the two encoders a renderer relies on."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import renderers
from renderers.tokenizer import AsciiWordEncoder, TokenizerLoadError

from ._support import ours, reference, smollm2_gguf, tokenizer_dir

SAFE_ASCII = st.text(alphabet=st.sampled_from([chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n", "\r"]), max_size=80)
TRICKY = st.text(alphabet=st.sampled_from(list(" \t\n\r'sdlmtvreSDLM0123456789aZ.,{}[]\"!?-_/\\")), max_size=40)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.1-8b-instruct", "gpt-oss-20b", "smollm2"])
def test_word_encoder_matches_the_tokenizers_library(name):
    """The Python-regex split + cached word ids must equal the library's encode, ids and offsets."""
    tok = ours(name)
    assert tok._words is not None, "this tokenizer should take the fast path"

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.one_of(SAFE_ASCII, TRICKY))
    def check(text):
        ids, ends = tok._words.encode(text)
        enc = tok._plain.encode(text, add_special_tokens=False)
        assert ids == enc.ids
        assert ends == [end for _, end in enc.offsets]

    check()


def test_word_encoder_declines_what_it_cannot_split_exactly():
    assert not AsciiWordEncoder.accepts("café")
    assert not AsciiWordEncoder.accepts("a\x0bb")  # vertical tab: a whitespace class edge case
    assert not AsciiWordEncoder.accepts("\x1c")
    assert AsciiWordEncoder.accepts("def f(x):\n\treturn {'a': 1}\r\n")
    gemma = json.loads(ours("qwen3-0.6b")._plain.to_str())
    gemma["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    assert AsciiWordEncoder.for_config(gemma, None) is None


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
