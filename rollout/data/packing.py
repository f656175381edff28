"""Packing samples into micro-batch rows under a token budget, and the log-probs of a packed row.

Layouts
-------
*Packed* (:func:`pack`): each :class:`PackedRow` concatenates whole samples up to ``budget`` tokens.
``position_ids`` restart at 0 for every sample and ``cu_seqlens`` (int32, starting at 0, ending at the
row length) marks the sample boundaries, the flash-attention varlen layout; attention must be
block-diagonal causal (:func:`block_causal_mask` builds it for SDPA/eager attention).
*Padded* (:func:`pad`): one sample per row, right-padded to the longest, with ``attention_mask``.

Per-token fields in both: ``input_ids`` (int64), ``loss_mask`` (bool), ``advantages`` (float32: the
sample's advantage on every trainable token, 0 elsewhere), ``inference_logprobs`` (float32: the
sampler's logprob on trainable tokens, 0 elsewhere), ``weight_versions`` (int32: the weight version that
sampled each trainable token, -1 on context, padding and a split piece's untrained first token; for an
importance weight or a staleness statistic per token). Token ``t`` is trained on the logits at ``t - 1``
of the same sample (:func:`packed_logprobs`), so a sample's first token is never trainable.

Order and bin packing
---------------------
Deterministic for a given ``seed``: the samples are shuffled with ``numpy.random.default_rng(seed)``
(``shuffle=False`` keeps input order), then placed *first-fit*: each sample goes into the first open row
with room for it, else a new row. Rows come out in the order they were opened.

Splitting
---------
A sample longer than ``budget`` is an error naming it, unless ``allow_split=True``: then it is cut into
pieces of ``budget`` tokens (the last shorter), each packed as its own sample with positions restarting
at 0 and its own slice of the loss mask. A piece *loses its earlier context*: its tokens are trained as
if the sequence started at the piece, which is not the distribution they were sampled from. The first
token of a piece has no preceding token to predict it from, so its loss mask is cleared.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .readers import Sample

if TYPE_CHECKING:
    import torch


class SampleTooLong(ValueError):
    pass


@dataclass(frozen=True)
class Piece:
    """Where a sample (or a split piece of one) lies in a packed row: row slice ``[start, start+length)``
    holds the sample's tokens ``[offset, offset+length)``."""

    name: str
    rollout_id: str
    start: int
    length: int
    offset: int = 0
    turn_index: Any = None  # the piece's turn_index array (for naming failing tokens)


@dataclass
class PackedRow:
    input_ids: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    cu_seqlens: np.ndarray
    pieces: list[Piece] = field(default_factory=list)
    weight_versions: np.ndarray | None = None  # int32, aligned with input_ids: -1 wherever loss_mask is false

    def __len__(self) -> int:
        return len(self.input_ids)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The row as a batch of one: ``[1, L]`` tensors (``cu_seqlens`` stays 1-D)."""
        import torch

        out = {k: torch.from_numpy(getattr(self, k))[None] for k in
               ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "weight_versions")
               if getattr(self, k) is not None}
        out["cu_seqlens"] = torch.from_numpy(self.cu_seqlens)
        return out


def _pieces(sample: Sample, budget: int, allow_split: bool) -> list[tuple[int, int]]:
    """(offset, length) pieces of a sample under the budget."""
    n = len(sample)
    if n <= budget:
        return [(0, n)]
    if not allow_split:
        raise SampleTooLong(f"sample {sample.name} has {n} tokens, more than the budget of {budget} "
                            "(raise the budget or pass allow_split=True)")
    return [(o, min(budget, n - o)) for o in range(0, n, budget)]


def pack(samples: Sequence[Sample], budget: int, *, seed: int = 0, shuffle: bool = True,
         allow_split: bool = False) -> list[PackedRow]:
    """Pack samples into rows of at most ``budget`` tokens (see the module docstring for order and
    splitting). Every sample token appears exactly once across the rows (once per piece when split)."""
    if budget <= 0:
        raise ValueError("budget must be positive")
    order = np.random.default_rng(seed).permutation(len(samples)) if shuffle else np.arange(len(samples))
    pieces = [(samples[int(i)], o, n) for i in order for o, n in _pieces(samples[int(i)], budget, allow_split)]
    smallest = min((n for _, _, n in pieces), default=0)
    bins: list[list[tuple[Sample, int, int]]] = []
    used: list[int] = []
    open_bins: list[int] = []  # rows, in opening order, that can still take the smallest piece
    for piece in pieces:
        length = piece[2]
        # first fit over the open rows; a row that cannot take even the smallest piece is closed, which
        # leaves the result exactly first-fit while keeping the scan short on large inputs
        for j, b in enumerate(open_bins):
            if used[b] + length <= budget:
                bins[b].append(piece)
                used[b] += length
                if budget - used[b] < smallest:
                    del open_bins[j]
                break
        else:
            bins.append([piece])
            used.append(length)
            if budget - length >= smallest:
                open_bins.append(len(bins) - 1)
    return [_build(b) for b in bins]


def _build(items: list[tuple[Sample, int, int]]) -> PackedRow:
    ids, pos, mask, adv, lps, vers, pieces = [], [], [], [], [], [], []
    cu = [0]
    for s, offset, length in items:
        sl = slice(offset, offset + length)
        m = np.asarray(s.loss_mask[sl], dtype=bool).copy()
        if offset:
            m[0] = False  # a split piece's first token has no context to be predicted from
        ids.append(np.asarray(s.token_ids[sl], dtype=np.int64))
        pos.append(np.arange(length, dtype=np.int64))
        mask.append(m)
        adv.append(np.where(m, np.float32(s.advantage), np.float32(0)))
        lps.append(np.where(m, np.asarray(s.logprobs[sl], dtype=np.float32), np.float32(0)))
        vers.append(np.where(m, s.versions()[sl], np.int32(-1)).astype(np.int32))
        pieces.append(Piece(s.name, s.rollout_id, cu[-1], length, offset, np.asarray(s.turn_index[sl])))
        cu.append(cu[-1] + length)
    return PackedRow(np.concatenate(ids), np.concatenate(pos), np.concatenate(mask),
                     np.concatenate(adv).astype(np.float32), np.concatenate(lps).astype(np.float32),
                     np.asarray(cu, dtype=np.int32), pieces, np.concatenate(vers))


def pad(samples: Iterable[Sample], pad_id: int = 0) -> dict[str, np.ndarray]:
    """The padded layout: ``[batch, max_len]`` arrays, one sample per row, right-padded (``pad_id`` in
    ``input_ids``, -1 in ``weight_versions``, 0/False elsewhere), with ``attention_mask`` (int64, 1 on real
    tokens)."""
    samples = list(samples)
    n, width = len(samples), max((len(s) for s in samples), default=0)
    out = {"input_ids": np.full((n, width), pad_id, np.int64), "attention_mask": np.zeros((n, width), np.int64),
           "position_ids": np.zeros((n, width), np.int64), "loss_mask": np.zeros((n, width), bool),
           "advantages": np.zeros((n, width), np.float32), "inference_logprobs": np.zeros((n, width), np.float32),
           "weight_versions": np.full((n, width), -1, np.int32)}
    for i, s in enumerate(samples):
        k = len(s)
        m = np.asarray(s.loss_mask, dtype=bool)
        out["input_ids"][i, :k] = s.token_ids
        out["attention_mask"][i, :k] = 1
        out["position_ids"][i, :k] = np.arange(k)
        out["loss_mask"][i, :k] = m
        out["advantages"][i, :k] = np.where(m, s.advantage, 0)
        out["inference_logprobs"][i, :k] = np.where(m, s.logprobs, 0)
        out["weight_versions"][i, :k] = np.where(m, s.versions(), -1)
    return out


def block_causal_mask(cu_seqlens: torch.Tensor | np.ndarray, length: int) -> torch.Tensor:
    """``[1, 1, L, L]`` bool mask, True where query ``i`` may attend key ``j``: same sample and ``j <= i``.
    Passed to a transformers model as ``attention_mask``, a 4D mask is used as-is (SDPA takes bool)."""
    import torch

    cu = torch.as_tensor(np.asarray(cu_seqlens), dtype=torch.long)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), cu[1:] - cu[:-1])
    if len(seg) != length:
        raise ValueError(f"cu_seqlens covers {len(seg)} tokens, row has {length}")
    idx = torch.arange(length)
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    return mask[None, None]


def sampling_log_softmax(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
                         top_k: int = 0) -> torch.Tensor:
    """Log-probs ``[n, vocab]`` of the distribution the embedded engine samples from, computed by the
    engine's own function (``rollout.engines.embedded_kv.processed_log_softmax``). Temperature 1,
    top-p 1, top-k 0 is the plain log_softmax; temperature 0 (greedy) reports the raw log_softmax, as
    the engine does."""
    import torch

    from ..engines.embedded_kv import processed_log_softmax

    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    n = logits.shape[0]
    return processed_log_softmax(logits, [temperature] * n, [top_k] * n, [top_p] * n)


def packed_logprobs(model: Any, row: PackedRow, *, temperature: float = 1.0, top_p: float = 1.0,
                    top_k: int = 0) -> torch.Tensor:
    """``[L]`` fp32 log-probs of each token of a packed row under ``model`` (one full forward pass, no
    KV cache, block-diagonal causal attention, positions restarting per sample): entry ``t`` is
    ``log softmax(logits[t-1])[input_ids[t]]``; a sample's first token gets 0 (nothing predicts it).
    Given sampling settings, the log-probs are of the processed distribution
    (:func:`sampling_log_softmax`), the one the shards' stored logprobs are of. Gradients flow when
    called outside ``torch.no_grad``."""
    import torch

    t = row.tensors()
    logits = model(input_ids=t["input_ids"], position_ids=t["position_ids"],
                   attention_mask=block_causal_mask(row.cu_seqlens, len(row)), use_cache=False).logits[0].float()
    logp = sampling_log_softmax(logits[:-1], temperature, top_p, top_k).gather(1, t["input_ids"][0, 1:, None])[:, 0]
    out = torch.cat([logp.new_zeros(1), logp])
    starts = torch.from_numpy(row.cu_seqlens[:-1].astype(np.int64))
    # logits at a sample's last token predict the next sample's first: never a valid prediction
    return out.index_fill(0, starts, 0.0)
