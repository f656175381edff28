"""The embedded engine's tensors: the batch KV buffer, the session KV store, and the sampler.

Kept apart from the scheduler (embedded.py) so that each piece states one contract:

- :class:`BatchKV` — one preallocated buffer ``[layers, 2, rows, kv_heads, cols, head_dim]``. Each
  running sequence owns one row and keeps its tokens at columns ``[0, len)`` with no padding, so a
  sequence joins or leaves the batch without touching the others (a leaving row is filled by moving the
  last row into it). It doubles as the ``cache=`` object transformers' decoder layers call ``update`` on,
  and with :func:`packed_attention` it runs a whole step — one decode token per running row plus the
  prompts of newly admitted requests — as ONE forward pass over a packed ``[1, T]`` token sequence, so
  admitting a request costs no extra pass over the weights (on a CPU a pass is bound by reading them).
- :class:`SessionStore` — KV kept after a request finishes, keyed by session id, LRU-bounded by bytes.
- :func:`sample` — temperature / top-k / top-p with a per-sequence ``torch.Generator``; the logprob
  returned is that of the distribution actually sampled from (and, on request, the most likely tokens of
  that same distribution); :func:`prompt_scores` — vLLM's prompt_logprobs from a prefill's logits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .protocol import TokenLogprobs

_CURRENT = threading.local()  # the BatchKV whose step the calling (engine worker) thread is running


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention for a packed step (registered with transformers' ``AttentionInterface`` as ``tito_packed``).

    ``query`` is ``[1, heads, T, dim]`` for the step's packed tokens; K/V were already written into the
    batch buffer by :meth:`BatchKV.update`, so each part attends over its own row there: the decode tokens
    (rows ``[0, n)``, one each) in one batched SDPA call with a per-row length mask, then each prefill
    segment causally over its row. Grouped-query heads are expanded by the kernel (``enable_gqa``), not by
    copying K/V. Returns ``[1, T, heads, dim]`` as transformers expects.
    """
    kv: BatchKV = _CURRENT.kv
    plan = kv.plan
    kbuf, vbuf = kv.buf[module.layer_idx, 0], kv.buf[module.layer_idx, 1]
    gqa = kbuf.shape[1] != query.shape[1]
    parts = []
    n = plan.n_decode
    if n:
        q = query[0, :, :n].transpose(0, 1).unsqueeze(2)  # [n, heads, 1, dim]
        out = F.scaled_dot_product_attention(q, kbuf[:n, :, : plan.width], vbuf[:n, :, : plan.width],
                                             attn_mask=plan.decode_mask, scale=scaling, enable_gqa=gqa)
        parts.append(out[:, :, 0].unsqueeze(0))  # [1, n, heads, dim]
    for (row, offset, length, start), mask in zip(plan.segments, plan.segment_masks):
        q = query[:, :, start : start + length]
        k, v = kbuf[row : row + 1, :, : offset + length], vbuf[row : row + 1, :, : offset + length]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                             enable_gqa=gqa)
        parts.append(out.transpose(1, 2))
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).contiguous(), None


def register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register("tito_packed", packed_attention)
    return "tito_packed"


@dataclass
class StepPlan:
    """What one packed forward computes. Tokens ``[0, n_decode)`` are one per row ``[0, n_decode)``; then
    each segment ``(row, offset, length, start)`` is ``length`` prompt tokens of ``row`` written from column
    ``offset``, at packed positions ``[start, start + length)``."""

    n_decode: int
    width: int  # columns the decode rows attend over (longest decode row + 1)
    decode_mask: torch.Tensor | None  # [n, 1, 1, width] bool, True = attend
    segments: list[tuple[int, int, int, int]]
    segment_masks: list[torch.Tensor | None]  # None: plain causal (offset 0)
    rows: torch.Tensor  # [T] row of each packed token
    positions: torch.Tensor  # [T] column (= position id) of each packed token


class BatchKV:
    """The running batch's KV cache. Rows ``[0, n)`` are live; row ``r``'s tokens sit at columns ``[0, len_r)``.

    Before each forward the engine lays out the step with :meth:`plan_step`. transformers calls
    :meth:`update` once per layer, which writes the new K/V into the rows; :func:`packed_attention` then
    attends over the buffer with masks that hide each row's unused columns.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_rows: int, max_cols: int) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device, self.max_rows, self.max_cols = dtype, device, max_rows, max_cols
        self.buf: torch.Tensor | None = None  # [layers, 2, rows, kv_heads, cols, head_dim]
        self.plan: StepPlan | None = None

    @property
    def rows(self) -> int:
        return 0 if self.buf is None else self.buf.shape[2]

    @property
    def cols(self) -> int:
        return 0 if self.buf is None else self.buf.shape[4]

    @property
    def token_bytes(self) -> int:
        """Bytes of KV per token (all layers, K and V)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def ensure(self, rows: int, cols: int) -> None:
        """Grow (never shrink) to at least ``rows`` x ``cols``; growth is geometric so it amortizes."""
        if rows <= self.rows and cols <= self.cols:
            return
        new_rows = self.rows if rows <= self.rows else max(rows, min(self.rows * 2, self.max_rows), 4)
        new_cols = self.cols if cols <= self.cols else max(cols, min(self.cols * 2, self.max_cols), 256)
        buf = torch.zeros(self.layers, 2, new_rows, self.kv_heads, new_cols, self.head_dim,
                          dtype=self.dtype, device=self.device)
        if self.buf is not None:
            buf[:, :, : self.rows, :, : self.cols] = self.buf
        self.buf = buf

    def release(self) -> None:
        """Drop the buffer (called when the batch empties, so an idle engine holds no batch memory)."""
        self.buf = None

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.buf[:, :, dst, :, :length] = self.buf[:, :, src, :, :length]

    def read_row(self, row: int, length: int) -> torch.Tensor:
        """A copy of one row's first ``length`` tokens: ``[layers, 2, kv_heads, length, head_dim]``."""
        return self.buf[:, :, row, :, :length].clone()

    def write_row(self, row: int, kv: torch.Tensor) -> None:
        self.buf[:, :, row, :, : kv.shape[3]] = kv

    # -- the cache object transformers sees ------------------------------------------------------------
    def plan_step(self, decode_positions: list[int], segments: list[tuple[int, int, int]]) -> StepPlan:
        """Lay out one packed step: decode rows ``[0, len(decode_positions))`` at their positions, then the
        prefill segments ``(row, offset, length)``. Grows the buffer to fit and makes the plan current for
        :func:`packed_attention` on this thread."""
        dev = self.device
        n = len(decode_positions)
        width = max(decode_positions, default=-1) + 1
        need_cols = max([width] + [o + q for _, o, q in segments])
        need_rows = max([n] + [r + 1 for r, _, _ in segments])
        self.ensure(need_rows, need_cols)
        rows, positions, laid, masks = list(range(n)), list(decode_positions), [], []
        start = n
        for row, offset, length in segments:
            laid.append((row, offset, length, start))
            rows += [row] * length
            positions += range(offset, offset + length)
            if offset:
                cols = torch.arange(offset + length, device=dev)
                masks.append((cols[None, :] <= torch.arange(offset, offset + length, device=dev)[:, None])[None, None])
            else:
                masks.append(None)
            start += length
        pos_t = torch.tensor(decode_positions, device=dev)
        decode_mask = (torch.arange(width, device=dev)[None, :] <= pos_t[:, None])[:, None, None, :] if n else None
        self.plan = StepPlan(n, width, decode_mask, laid, masks, torch.tensor(rows, device=dev),
                             torch.tensor(positions, device=dev))
        _CURRENT.kv = self
        return self.plan

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the step's new K/V ``[1, kv_heads, T, dim]`` at each packed token's (row, column).
        :func:`packed_attention` reads the buffer itself, so what is returned is not used."""
        plan = self.plan
        self.buf[layer_idx, 0][plan.rows, :, plan.positions] = key_states[0].transpose(0, 1)
        self.buf[layer_idx, 1][plan.rows, :, plan.positions] = value_states[0].transpose(0, 1)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only consulted when position_ids are absent
        raise RuntimeError("BatchKV needs explicit position_ids")


@dataclass
class SessionKV:
    token_ids: list[int]  # the tokens whose KV ``kv`` holds, in order
    kv: torch.Tensor  # [layers, 2, kv_heads, len(token_ids), head_dim]
    adapter: str | None = None  # the LoRA adapter it was computed under ("<name>@<version>"), None: the base model

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class SessionStore:
    """Per-session KV, least recently used first out, never more than ``max_bytes`` in total.

    ``take`` removes the entry (the request that reuses it extends it in its batch row and puts the longer
    KV back when it finishes), so KV is never held twice. An entry larger than the whole bound is not kept.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, SessionKV] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def put(self, session_id: str, entry: SessionKV) -> None:
        self.discard(session_id)
        if entry.nbytes > self.max_bytes:
            return
        while self.nbytes + entry.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
        self._entries[session_id] = entry
        self.nbytes += entry.nbytes

    def take(self, session_id: str) -> SessionKV | None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry

    def discard(self, session_id: str) -> None:
        self.take(session_id)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


@dataclass(frozen=True)
class SamplerRow:
    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None  # None only for greedy rows
    top_logprobs: int = 0  # report this many most likely tokens (and the sampled one's rank)
    masked: tuple[int, ...] = ()  # ids that may not be sampled now (min_tokens: the stop ids and EOS)


def top_scores(logp: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """A position's scores from its log-probs ``[vocab]``: ``token``'s logprob and rank (vLLM's count: the
    tokens at least as likely) and the ``k`` most likely tokens."""
    lp = logp[token]
    values, ids = torch.topk(logp, k) if k else (logp[:0], logp[:0].long())
    return TokenLogprobs(float(lp), int((logp >= lp).sum()), ids.tolist(), values.tolist())


def processed_log_softmax(
    logits: torch.Tensor, temperatures: list[float], top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """The log-probs ``[m, vocab]`` of the distribution each row is sampled from (temperature > 0):
    logits / temperature, keep the top-k (``k <= 0`` or ``>= vocab``: all), then the smallest set of
    most likely tokens whose mass reaches top_p (the most likely always stays); filtered tokens get -inf.
    The trainer side recomputes logprobs with this same function (rollout.data.packing)."""
    vocab = logits.shape[-1]
    temps = torch.tensor(temperatures, dtype=logits.dtype, device=logits.device)
    x = logits / temps[:, None]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if any(k < vocab for k in ks) or any(p < 1.0 for p in top_p):
        # one sort serves both filters; positions are ranks in descending order
        sorted_x, order = x.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=x.device)[None, :]
        drop = ranks >= torch.tensor(ks, device=x.device)[:, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop = before >= torch.tensor(top_p, dtype=probs.dtype, device=x.device)[:, None]
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
    return torch.log_softmax(x, dim=-1)


def sample(logits: torch.Tensor, rows: list[SamplerRow]
           ) -> tuple[list[int], list[float], list[TokenLogprobs | None]]:
    """One token per row of ``logits`` ``[m, vocab]`` (fp32), its logprob, and (rows with ``top_logprobs``)
    its :func:`top_scores` from the same distribution.

    Greedy rows (temperature 0) take the argmax (first index on ties) and report the raw log_softmax.
    Other rows scale by 1/temperature, keep the top-k logits, then the smallest set of tokens whose
    probability reaches top_p (the most likely token always stays), and draw from the renormalized
    distribution with their own generator; the logprob is the log_softmax of that filtered distribution,
    i.e. the one actually sampled from. A row's draw depends only on its logits and its generator, so a
    seeded request reproduces regardless of what else is in the batch. A row's ``masked`` ids get -inf
    logits first (vLLM's min_tokens does the same), so they are never sampled and the logprobs reported are
    of the masked distribution.
    """
    m, vocab = logits.shape
    tokens = [0] * m
    lps = [0.0] * m
    tops: list[TokenLogprobs | None] = [None] * m
    if any(r.masked for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.masked:
                logits[i, list(r.masked)] = float("-inf")
    greedy = [i for i, r in enumerate(rows) if r.temperature == 0]
    if greedy:
        g_logits = logits[greedy]
        g_tok = g_logits.argmax(dim=-1)
        g_logp = torch.log_softmax(g_logits, dim=-1)
        g_lp = g_logp.gather(1, g_tok[:, None])[:, 0]
        for j, i in enumerate(greedy):
            tokens[i], lps[i] = int(g_tok[j]), float(g_lp[j])
            if rows[i].top_logprobs:
                tops[i] = top_scores(g_logp[j], tokens[i], rows[i].top_logprobs)
    rest = [i for i, r in enumerate(rows) if r.temperature != 0]
    if not rest:
        return tokens, lps, tops
    logp = processed_log_softmax(
        logits[rest], [rows[i].temperature for i in rest], [rows[i].top_k for i in rest], [rows[i].top_p for i in rest]
    )
    probs = logp.exp()
    for j, i in enumerate(rest):
        tok = int(torch.multinomial(probs[j], 1, generator=rows[i].generator))
        tokens[i], lps[i] = tok, float(logp[j, tok])
        if rows[i].top_logprobs:
            tops[i] = top_scores(logp[j], tok, rows[i].top_logprobs)
    return tokens, lps, tops


def prompt_scores(logits: torch.Tensor, prompt: list[int], k: int) -> list[TokenLogprobs | None]:
    """vLLM's prompt_logprobs: ``logits`` ``[len(prompt), vocab]`` are the model's outputs at each prompt
    position; token ``i`` is scored by the raw log-softmax at position ``i - 1`` (no temperature or filter:
    vLLM scores prompts before its sampler). The first token has no prefix: None."""
    out: list[TokenLogprobs | None] = [None]
    for start in range(0, len(prompt) - 1, 256):  # bounded temporaries for long prompts
        logp = torch.log_softmax(logits[start: min(start + 256, len(prompt) - 1)].float(), dim=-1)
        targets = torch.tensor(prompt[start + 1: start + 1 + logp.shape[0]], device=logp.device)
        lps = logp.gather(1, targets[:, None])
        ranks = (logp >= lps).sum(dim=1).tolist()
        values, ids = torch.topk(logp, k, dim=1)
        out += [TokenLogprobs(lp, rank, top_ids, top_lps) for lp, rank, top_ids, top_lps
                in zip(lps[:, 0].tolist(), ranks, ids.tolist(), values.tolist())]
    return out
