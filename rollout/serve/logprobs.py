"""vLLM's logprob shapes on the three token routes, built from the engine's scores.

An engine result carries each sampled token's logprob and, when asked, its rank and the ``k`` most likely
tokens at that position (:class:`~rollout.engines.protocol.TokenLogprobs`); a request may also ask for the
prompt's scores. vLLM's server turns the same data into a per-position dict ``{token: Logprob}`` whose first
key is the sampled (or prompt) token with its rank, followed by the top-k in rank order (a top-k token equal
to the first keeps the first place, with the top-k's rank), and each route reads a prefix of it:

* ``/inference/v1/generate`` (``sampling_params.logprobs = k``): ``top_logprobs`` is the first ``max(k, 1)``
  entries, as ``{token_id, logprob, rank}``;
* ``/v1/completions`` (``logprobs = k``): ``top_logprobs`` is a dict of the first ``k + 1`` entries, keyed by
  the token's text (or ``"token_id:<id>"``), so the sampled token is always there;
* ``/v1/chat/completions`` (``top_logprobs = k``): the first ``k`` entries, as ``{token, logprob, bytes}``;
* ``prompt_logprobs = k``: per prompt token (the first is null) the dict itself, ``{"<id>": {logprob, rank,
  decoded_token}}`` with ``k + 1`` entries at most.

Logprobs of -inf (a token the sampler's filters removed) are sent as -9999.0, as vLLM does. A token's text is
its own decoding, corrected as vLLM corrects it where that ends in U+FFFD (:func:`token_text`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..engines.protocol import TokenLogprobs
from .schemas import ChoiceLogprobs, TokenLogprob, TopLogprob, VLLMSamplingParams

if TYPE_CHECKING:
    from .state import ServerState

# a logprob JSON can carry: vLLM's floor for -inf
FLOOR = -9999.0


def clamp(logprob: float) -> float:
    return logprob if logprob >= FLOOR or math.isnan(logprob) else FLOOR


Decode = Callable[[list[int]], str]  # the tokenizer's decode of a list of ids (special tokens kept)


def token_text(decode: Decode, token: int, context: list[int]) -> str:
    """vLLM's text for a logprob entry: ``decode([token])``, unless that ends in U+FFFD (part of a character
    whose bytes span tokens). Then, as vLLM's ``_correct_decoded_token``: decoded after the last 1..4 tokens of
    ``context`` (the sequence's tokens before this position), the text this token adds (what earlier
    incomplete tokens left undecoded included), or "" while the character is still incomplete."""
    text = decode([token])
    if not text.endswith("\ufffd"):
        return text
    for n in range(1, min(len(context), 4) + 1):
        ctx = context[-n:]
        full = decode([*ctx, token])
        if full.endswith("\ufffd"):
            continue
        clean = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):  # context tokens that were themselves incomplete
            if decode([ctx[j]]).endswith("\ufffd"):
                clean = j
            else:
                break
        prefix = decode(ctx[:clean]) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def entries(token: int, logprob: float, scores: TokenLogprobs | None) -> list[tuple[int, float, int | None]]:
    """vLLM's dict for one position as (id, logprob, rank): ``token`` first (its rank, or None when the engine
    reported no scores), then the top-k with ranks 1..k; a repeated id keeps its first place."""
    out: dict[int, tuple[float, int | None]] = {token: (logprob, scores.rank if scores is not None else None)}
    if scores is not None:
        for rank, (tid, lp) in enumerate(zip(scores.top_ids, scores.top_logprobs), 1):
            out[tid] = (lp, rank)
    return [(tid, lp, rank) for tid, (lp, rank) in out.items()]


def engine_top(wanted: int, needed: int, max_logprobs: int) -> int:
    """The ``top_logprobs`` to ask the engine for: ``wanted`` (what fills vLLM's shape exactly, ranks
    included) when the engine reports that many, else ``needed`` (what the shape cannot do without; the
    engine then refuses it with a message when it cannot)."""
    return wanted if wanted <= max_logprobs else needed


def generate_logprobs(ids: list[int], lps: list[float], tops: list[TokenLogprobs] | None, k: int) -> ChoiceLogprobs:
    """``choices[i].logprobs`` of /inference/v1/generate (``token`` is tito's extra: the renderers client
    reads ``"token_id:<id>"`` there)."""
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        cands = entries(t, lp, tops[i] if tops else None)
        content.append(TokenLogprob(t, clamp(lp), f"token_id:{t}", cands[0][2] or None,
                                    [TopLogprob(tid, clamp(v), r or None) for tid, v, r in cands[: max(k, 1)]]))
    return ChoiceLogprobs(content)


def completion_logprobs(decode: Decode, ids: list[int], lps: list[float], tops: list[TokenLogprobs] | None, k: int,
                        as_ids: bool, context: list[int] = ()) -> dict:
    """OpenAI's legacy completion logprobs as vLLM fills them: per token its text (``"token_id:<id>"`` with
    ``return_tokens_as_token_ids``), logprob, ``top_logprobs`` (the sampled token and the ``k`` most likely,
    keyed by text) and ``text_offset``, where its text starts in the completion's text (each token's text,
    summed; vLLM counts the same way). ``context``: the completion's tokens before ``ids`` (a stream's delta)."""
    seq = [*context, *ids]

    def name(t: int, i: int) -> str:
        return f"token_id:{t}" if as_ids else token_text(decode, t, seq[max(0, i - 4 + len(context)): i + len(context)])

    tokens = [name(t, i) for i, t in enumerate(ids)]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = [{name(tid, i): clamp(v) for tid, v, _ in entries(t, lp, tops[i] if tops else None)[: k + 1]}
           for i, (t, lp) in enumerate(zip(ids, lps))]
    return {"tokens": tokens, "token_logprobs": [clamp(lp) for lp in lps], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(decode: Decode, ids: list[int], lps: list[float], tops: list[TokenLogprobs] | None,
                  k: int | None, as_ids: bool, context: list[int] = ()) -> dict:
    """Chat's ``logprobs.content``: per token its text (or ``"token_id:<id>"``), logprob, the UTF-8 bytes of
    its text, and ``top_logprobs``: the first ``k`` of the sampled token and the most likely ones, each with
    the bytes of what it is named by (vLLM's choices)."""
    seq = [*context, *ids]
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        before = seq[max(0, i + len(context) - 4): i + len(context)]
        text = token_text(decode, t, before)
        cands = entries(t, lp, tops[i] if tops else None)[: k or 0]
        names = [f"token_id:{tid}" if as_ids else token_text(decode, tid, before) for tid, _, _ in cands]
        content.append({"token": f"token_id:{t}" if as_ids else text, "logprob": clamp(lp),
                        "bytes": list(text.encode("utf-8", "replace")),
                        "top_logprobs": [{"token": name, "logprob": clamp(v), "bytes": list(name.encode("utf-8", "replace"))}
                                         for name, (_, v, _) in zip(names, cands)]})
    return {"content": content}


def prompt_logprobs(decode: Decode, prompt: list[int],
                    scores: list[TokenLogprobs | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: null first, then per prompt token ``{"<id>": {logprob, rank,
    decoded_token}}``, the prompt token first. (vLLM's text correction takes its context from the scored
    positions, so never from the first prompt token.)"""
    if scores is None:
        return None
    out: list[dict[str, Any] | None] = []
    for i, (t, s) in enumerate(zip(prompt, scores)):
        if s is None:
            out.append(None)
            continue
        before = prompt[max(1, i - 4): i]
        out.append({str(tid): {"logprob": clamp(v), "rank": r, "decoded_token": token_text(decode, tid, before)}
                    for tid, v, r in entries(t, s.logprob, s)})
    return out


def generate_extras(state: ServerState, sp: VLLMSamplingParams) -> dict[str, Any]:
    """/inference/v1/generate's vLLM settings for the engine: min_tokens, prompt_logprobs, and the top
    logprobs that fill ``sampling_params.logprobs = k`` (the first max(k, 1) entries: ranks from k = 0, the
    alternatives from k = 2)."""
    k = sp.logprobs
    top = 0 if k is None else engine_top(max(k, 1), k if k >= 2 else 0, state.engine_info().max_logprobs)
    return {"min_tokens": sp.min_tokens, "top_logprobs": top, "prompt_logprobs": sp.prompt_logprobs}
