"""Mistral's own shipped tokenizers as Hugging Face fast tokenizers, built at test time into a cache.

mistral-common (a PyPI package, installed in the dev environment) ships the tokenizer files of its
models in ``mistral_common/data/``: SentencePiece models (v1, v2, v3, v7) and Tekken vocabularies
(``tekken_240718``: Mistral NeMo; ``tekken_240911``: Pixtral; both tokenizer version v3). Unlike
tests/reconstructed.py these are the models' real vocabularies, control tokens and ids.

:func:`build` converts one file into a directory transformers and tito both load (tokenizer.json,
tokenizer_config.json, generation_config.json), cached under ``$TITO_CACHE`` (else ``~/.cache/tito``)
in ``mistral-common/<name>-<sha256 of the file>``; nothing here is ever committed.

- SentencePiece: transformers' ``SpmConverter.build_tokenizer_from_spm_proto`` (the model's own
  normalizer spec, merges ranked by piece score), ``legacy=True`` (a dummy prefix on every chunk
  between control tokens, as Mistral's published HF tokenizer.json files do); every CONTROL piece
  (``<s>``, ``</s>``, ``[INST]``, ...) an added special token at its own id.
- Tekken: transformers' ``MistralConverter`` (transformers.integrations.mistral).

:func:`mismatches` checks a conversion: the converted tokenizer must encode every text exactly as
mistral-common's own tokenizer does (``encode(text, bos=False, eos=False)``). Control-token names are
excluded from those texts (mistral-common never reads them from text; a chat template writes them, and
the converted tokenizer reads them as the control tokens, whose ids :func:`mismatches` checks too).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path

from ._support import building, built_tokenizer_dir, tokenizer_pair

# name -> (file in mistral_common/data, kind, the mistral-common template version it belongs to)
FILES = {
    "spm-v1": ("tokenizer.model.v1", "spm", "v1"),
    "spm-v2": ("mistral_instruct_tokenizer_240216.model.v2", "spm", "v2"),
    "spm-v3": ("mistral_instruct_tokenizer_240323.model.v3", "spm", "v3"),
    "spm-v7": ("mistral_instruct_tokenizer_241114.model.v7", "spm", "v7"),
    "tekken-240718": ("tekken_240718.json", "tekken", "v3"),
    "tekken-240911": ("tekken_240911.json", "tekken", "v3"),
}


def data_file(name: str) -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / FILES[name][0]


def _spm_tokenizer(path: Path):
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    proto = import_protobuf().ModelProto()
    proto.ParseFromString(path.read_bytes())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    controls = [p.piece for p in proto.pieces if p.type == 3]  # CONTROL: <s>, </s>, [INST], ...
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in controls])
    return tok, controls


def _tekken_tokenizer(path: Path):
    from transformers.integrations.mistral.tokenizer import MistralConverter

    converter = MistralConverter(str(path))
    return converter.converted(), [t.content for t in converter.additional_special_tokens]


def build(name: str) -> Path:
    """The directory of converted tokenizer ``name`` (a key of :data:`FILES`), built once into the cache."""
    path = data_file(name)
    key = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    out = built_tokenizer_dir("mistral-common", name, key)
    if (out / "tokenizer_config.json").is_file():
        return out
    tok, specials = (_spm_tokenizer if FILES[name][1] == "spm" else _tekken_tokenizer)(path)
    tok.post_processor = None  # the template writes BOS itself
    ids = {s: tok.token_to_id(s) for s in specials}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "added_tokens_decoder": {
            str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for s, i in sorted(ids.items(), key=lambda kv: kv[1])
        },
    }
    with building(out) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["</s>"]]}), encoding="utf-8")
        (tmp / "PROVENANCE.txt").write_text(
            f"Converted from mistral-common's shipped {path.name} (sha256 {key}...) by tests/shipped_mistral.py.\n",
            encoding="utf-8")
    return out


@functools.cache
def load(name: str):
    """``(ours, reference)``: tito's Tokenizer and transformers' for converted tokenizer ``name``."""
    return tokenizer_pair(build(name))


@functools.cache
def mistral_common_tokenizer(name: str):
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    return MistralTokenizer.from_file(str(data_file(name))).instruct_tokenizer.tokenizer


PIECES = ("hello", "world", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "数据", "🙂", "Zürich", "résumé", "x = 1",
          "def f(a):", "    return a", "123", "3.14", "1,000,000", "don't", "C++", "e.g.", "<b>", "{\"q\": 1}", "▁",
          "\u200b", "ǅ", "ß", "İ", "﷽", "ａｂｃ", "\r\n", "...", "--", "@", "#", "\\", "'", '"', "Ω", "الف", "क्ष")


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` seeded varied texts (unicode, whitespace runs, digits, code), leading/trailing spaces included."""
    r = random.Random(seed)
    return ["".join(r.choice(PIECES) for _ in range(r.randint(1, 12))) for _ in range(n)]


def mismatches(name: str, sample: list[str]) -> list[str]:
    """The texts of ``sample`` the converted tokenizer encodes unlike mistral-common, plus any control token
    whose id differs (``"control:NAME"``)."""
    mc = mistral_common_tokenizer(name)
    _, hf = load(name)
    bad = [t for t in sample if list(hf(t, add_special_tokens=False)["input_ids"]) != mc.encode(t, bos=False, eos=False)]
    for token, i in hf.get_added_vocab().items():
        if token.startswith("<SPECIAL_"):
            continue  # Tekken's unnamed fillers
        if mc.id_to_piece(i) != token:
            bad.append(f"control:{token}")
    return bad
