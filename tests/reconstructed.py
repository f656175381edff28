"""Reconstructed tokenizers for template-only fixtures, built at test time into a cache (never committed).

No official tokenizer file of these families is reachable offline (the shared fixtures hold only
their chat templates, and no public GitHub repository we could reach ships their tokenizer.json). A
reconstructed tokenizer is, and is only, **a real base vocabulary from the shared fixtures** (its BPE
model, pre-tokenizer and decoder, with the base's own added tokens removed) **plus the family's added
tokens by name**, appended after the base vocabulary in the family's order, all flagged special.

What that means for the tests:

- marker *names* are the family's (taken from its official chat template; the rest of each table is
  the family's added-token list as we know it from its published tokenizer_config, labelled
  ``inferred`` where not confirmed against a file we could read);
- marker *ids* are NOT the official ids (they follow the base vocabulary); nothing may hard-code them;
- ordinary text is tokenized by the base vocabulary, not the family's: fine for parsing and parity
  (both sides use the same tokenizer), meaningless for anything about the family's text statistics.

Each family is one :class:`Spec` in :data:`SPECS` (D1: GLM, Kimi K2, MiniMax M2; D2 adds theirs).
``load(name)`` returns ``(ours, reference)``: the tito :class:`renderers.Tokenizer` and transformers'
tokenizer, both loaded from the same built directory.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ._support import fixtures_dir, tokenizer_dir


@dataclass(frozen=True)
class Spec:
    """One reconstructed tokenizer. ``base``: the shared tokenizer fixture whose vocabulary is used;
    ``template``: the chat template file under shared/fixtures/templates; ``added``: the family's added
    tokens in its own order; ``eos``/``bos``: the tokenizer_config's tokens; ``generation_eos``: names
    of the generation_config's ``eos_token_id`` list (the model's stop tokens); ``why``: why that base;
    ``provenance``: where the names come from."""

    base: str
    template: str
    added: tuple[str, ...]
    eos: str
    bos: str | None = None
    generation_eos: tuple[str, ...] = ()
    why: str = ""
    provenance: str = ""
    extra_config: dict = field(default_factory=dict)


GLM_ADDED = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink",
    "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
)
_GLM = dict(
    base="qwen3-0.6b",
    added=GLM_ADDED,
    eos="<|endoftext|>",
    generation_eos=("<|endoftext|>", "<|user|>", "<|observation|>"),
    why="GLM-4.5+ ship a byte-level BPE of ~151k tokens grown from cl100k, as Qwen2/3's is; Qwen3's is the "
    "closest real vocabulary we have (GLM's own is not reachable). Qwen's added tokens are removed.",
    provenance="markers used by the template: [gMASK] <sop> <|system|> <|user|> <|assistant|> <|observation|> "
    "<think> </think> <tool_call> </tool_call> <tool_response> </tool_response> <arg_key> </arg_key> <arg_value> "
    "</arg_value> /nothink; the rest of the list and its order, and generation_config eos "
    "[<|endoftext|>, <|user|>, <|observation|>]: inferred from zai-org/GLM-4.5's published tokenizer_config "
    "(ids 151329-151364 there, not here)",
)

KIMI_ADDED = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>",
    "[EOT]", "<|im_system|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_middle|>", "<|media_start|>", "<|media_content|>",
    "<|media_end|>", "<|media_pad|>", "[UNK]", "[PAD]",
)
_KIMI = dict(
    base="llama-3.1-8b-instruct",
    added=KIMI_ADDED,
    eos="[EOS]",
    bos="[BOS]",
    generation_eos=("<|im_end|>",),
    why="Kimi K2's tokenizer is a tiktoken BPE (~160k) with a cl100k-style split pattern; Llama 3's is the real "
    "tiktoken-derived vocabulary we have. Llama's added tokens (and its BOS post-processor) are removed.",
    provenance="markers used by the templates: <|im_system|> <|im_user|> <|im_assistant|> <|im_middle|> <|im_end|> "
    "<|tool_calls_section_begin|> <|tool_calls_section_end|> <|tool_call_begin|> <|tool_call_argument_begin|> "
    "<|tool_call_end|> <|media_*|>; [BOS] [EOS] [EOT] [UNK] [PAD] <|start_header_id|> <|end_header_id|> and the "
    "order: inferred from moonshotai/Kimi-K2-Instruct's tokenizer_config (ids 163584+ there, not here)",
)

MINIMAX_ADDED = (
    "]~!b[", "]~b]", "[e~[", "]!d~[", "]!p~[", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>",
)
_MINIMAX = dict(
    base="gpt-oss-20b",
    added=MINIMAX_ADDED,
    eos="[e~[",
    bos="]~!b[",
    generation_eos=("[e~[",),
    why="MiniMax M2's tokenizer is a byte-level BPE of ~200k tokens; gpt-oss's o200k is the real vocabulary of "
    "that size we have. gpt-oss's added tokens are removed.",
    provenance="markers used by the template: ]~!b[ ]~b] [e~[ <think> </think> <minimax:tool_call> "
    "</minimax:tool_call>; ]!d~[ ]!p~[ inferred from MiniMaxAI/MiniMax-M2's tokenizer_config (which has ~200 "
    "more added tokens, left out: the template never prints them)",
)

SPECS: dict[str, Spec] = {
    "glm-4.6": Spec(template="zai-org-GLM-4.6.jinja", **_GLM),
    "glm-4.7-flash": Spec(template="zai-org-GLM-4.7-Flash.jinja", **_GLM),
    "kimi-k2": Spec(template="moonshotai-Kimi-K2-Instruct.jinja", **_KIMI),
    "kimi-k2-2507": Spec(template="moonshotai-Kimi-K2-Instruct-2507-07.jinja", **_KIMI),
    "minimax-m2": Spec(template="MiniMaxAI-MiniMax-M2.jinja", **_MINIMAX),
}
# Entries that differ only in their template share one built vocabulary (loading one costs seconds):
# ``load`` gives each entry the shared tokenizers with its own template.
VOCABULARY = {"glm-4.7-flash": "glm-4.6", "kimi-k2-2507": "kimi-k2"}


def _cache_root() -> Path:
    root = os.environ.get("TITO_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "tito") / "reconstructed"


def build(name: str) -> Path:
    """The directory of reconstructed tokenizer ``name`` (tokenizer.json, tokenizer_config.json,
    generation_config.json, PROVENANCE.txt), built once into the cache; its key covers the spec, the
    template and the base file, so a change to any of them rebuilds."""
    spec = SPECS[name]
    base_file = tokenizer_dir(spec.base) / "tokenizer.json"
    template = (fixtures_dir() / "templates" / spec.template).read_text(encoding="utf-8")
    key = hashlib.sha256(
        json.dumps([repr(spec), template, base_file.stat().st_size, base_file.stat().st_mtime_ns]).encode()
    ).hexdigest()[:16]
    out = _cache_root() / f"{name}-{key}"
    if (out / "tokenizer_config.json").is_file():
        return out
    config = json.loads(base_file.read_text(encoding="utf-8"))
    vocab = config["model"]["vocab"]
    first = max(vocab.values()) + 1
    overlap = [t for t in spec.added if t in vocab]
    if overlap:
        raise ValueError(f"{name}: added tokens {overlap} are ordinary tokens of base {spec.base!r}")
    config["added_tokens"] = [
        {"id": first + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, t in enumerate(spec.added)
    ]
    config["post_processor"] = None  # the base's BOS insertion (Llama) is not the family's
    ids = {t: first + i for i, t in enumerate(spec.added)}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "eos_token": spec.eos,
        "bos_token": spec.bos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": True}
            for t, i in ids.items()
        },
        **spec.extra_config,
    }
    _cache_root().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=_cache_root()))
    (tmp / "tokenizer.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, ensure_ascii=False, indent=1), encoding="utf-8")
    if spec.generation_eos:
        gen = {"eos_token_id": [ids[t] for t in spec.generation_eos]}
        (tmp / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    (tmp / "PROVENANCE.txt").write_text(
        f"RECONSTRUCTED tokenizer for {name} (tests/reconstructed.py), not the official file.\n"
        f"base vocabulary: shared fixture {spec.base} ({spec.why})\n"
        f"added tokens (ids {first}-{first + len(spec.added) - 1}, NOT the official ids): {spec.provenance}\n"
        f"chat template: shared/fixtures/templates/{spec.template}\n",
        encoding="utf-8",
    )
    try:
        tmp.rename(out)  # atomic: a concurrent build of the same key leaves one complete directory
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@functools.cache
def _load_built(name: str):
    from transformers import AutoTokenizer

    import renderers

    path = build(name)
    return renderers.load_tokenizer(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@functools.cache
def load(name: str):
    """``(ours, reference)`` for reconstructed tokenizer ``name``: renderers' Tokenizer and transformers',
    both carrying the entry's chat template (entries of one vocabulary share the loaded tokenizers)."""
    if name not in VOCABULARY:
        return _load_built(name)
    tok, hf = _load_built(VOCABULARY[name])
    template = (fixtures_dir() / "templates" / SPECS[name].template).read_text(encoding="utf-8")
    hf = copy.copy(hf)  # shares the backend; only the template differs
    hf.chat_template = template
    return tok.with_chat_template(template, f"{tok.name_or_path} + {SPECS[name].template}"), hf
