"""What the routes share: the fleet, the sessions, the parser (a renderer on the served tokenizer), limits."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import cached_property

from tito_renderers import Renderer

from ..engines.protocol import EngineInfo
from .fleet import Fleet
from .metrics import Metrics, server_metrics
from .sessions import SessionManager
from .text_bound import normalizer_forms

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DEFAULT_BODY_TIMEOUT_S = 30.0


@dataclass
class ServerState:
    """Everything the routes use. ``parser`` is a renderer on the served model's tokenizer: it renders
    session-less chat calls, parses completions and supplies the stop ids (the same code as the
    renderer actors, as in ``tito run``). ``max_body_bytes``: larger bodies are refused with 413, from
    their Content-Length before reading, or while reading a chunked one. ``api_key`` / ``admin_api_key``:
    the Bearer keys requests must carry (guard.py; None: no key). ``weights_root``: /update_weights loads
    only directories under it (None: none). ``body_timeout_s``: a body not in by then is a 408."""

    fleet: Fleet
    sessions: SessionManager
    parser: Renderer
    model_names: list[str]  # the first is the served name; all are accepted as `model`
    root: str
    default_max_tokens: int | None = None
    sweep_interval_s: float = 5.0
    metrics: Metrics = field(default_factory=server_metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    weights_root: str | None = None
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    # the LoRA adapters loaded (POST /v1/load_lora_adapter): name -> {"path", "version"}; served as `model: <name>`
    loras: dict[str, dict] = field(default_factory=dict)
    # held from the version check to the update's end, so two updates cannot both pass the check
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def engine_info(self) -> EngineInfo:
        info = self.fleet.infos[0]
        return EngineInfo(backend=info.backend, model=info.model, vocab_size=self.fleet.vocab_size,
                          max_model_len=self.fleet.max_model_len, weight_version=self.fleet.weight_version,
                          eos_token_ids=list(info.eos_token_ids),
                          max_logprobs=min(i.max_logprobs for i in self.fleet.infos),
                          scores_prompts=all(i.scores_prompts for i in self.fleet.infos),
                          max_loras=min(i.max_loras for i in self.fleet.infos))

    @cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token of the vocabulary decodes to, bounded by the byte length of its
        vocabulary string (byte-level BPE spells each byte as one char of at most 2 bytes; SentencePiece
        spells a space as the 3-byte "▁" and a byte as "<0xNN>"): a text of B bytes needs at least
        B / max_token_bytes tokens, whatever the tokenizer does with it."""
        vocab = self.parser.tokenizer.backend.get_vocab(with_added_tokens=True)
        return max(len(t.encode("utf-8")) for t in vocab)

    @cached_property
    def normalizer_forms(self) -> tuple[str, ...] | None:
        """The tokenizer's normalizer as Unicode normal forms, for the bytes bound (text_bound.py)."""
        return normalizer_forms(self.parser.tokenizer.backend)
