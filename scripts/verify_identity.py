"""Token identity, end to end: recompute every trainable token's logprob from the shards with a plain
forward pass of the same weights over *packed* rows, and compare with the sampler's stored logprob.

    python scripts/verify_identity.py out/demo [--model smollm2-135m] [--budget 2048] [--tol 1e-4]

The stored logprob is of the distribution actually sampled from (after temperature/top-k/top-p). By
default the check assumes a run sampled at temperature 1, top-p 1, top-k off, where that is the model's
raw softmax, what a trainer's forward pass computes; for other runs pass the run's ``--temperature``,
``--top-p`` and ``--top-k`` and the same processing is applied to the recomputed logits. Rows are packed with
``rollout.data.packing.pack`` (positions restarting per sample, block-diagonal causal attention) and run in
fp32, eval mode, without a KV cache. Exits 1, naming each failing sample (rollout id, turn, token
position), when a trainable token's |new - old| or |exp(new - old) - 1| exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from rollout.data import load_samples
from rollout.data.packing import PackedRow, SampleTooLong, pack, packed_logprobs
from rollout.models import load_causal_lm


@dataclass
class Report:
    samples: int = 0
    rows: int = 0
    trainable_tokens: int = 0
    max_abs_diff: float = 0.0
    max_abs_ratio_minus_1: float = 0.0
    failures: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.trainable_tokens > 0 and not self.failures


def check_rows(model: torch.nn.Module, rows: list[PackedRow], tol: float, **sampling: float) -> Report:
    """Compare recomputed with stored logprobs on every trainable token of every row (``sampling``:
    temperature / top_p / top_k of the run, passed to ``packed_logprobs``)."""
    rep = Report(rows=len(rows), samples=sum(len(r.pieces) for r in rows))
    with torch.no_grad():
        for row in rows:
            new = packed_logprobs(model, row, **sampling).double().numpy()
            old = row.inference_logprobs.astype("float64")
            for p in row.pieces:
                sl = slice(p.start, p.start + p.length)
                m = row.loss_mask[sl]
                diff = np.abs(new[sl] - old[sl])[m]
                ratio = np.abs(np.expm1(new[sl] - old[sl]))[m]
                rep.trainable_tokens += int(m.sum())
                if not m.any():
                    continue
                rep.max_abs_diff = max(rep.max_abs_diff, float(diff.max()))
                rep.max_abs_ratio_minus_1 = max(rep.max_abs_ratio_minus_1, float(ratio.max()))
                bad = (diff > tol) | (ratio > tol)
                if bad.any():
                    positions = [int(i) for i in m.nonzero()[0][bad]]
                    rep.failures.append({
                        "sample": p.name, "rollout_id": p.rollout_id,
                        "tokens": [{"position": p.offset + i, "turn": int(p.turn_index[i]),
                                    "old": float(old[p.start + i]), "new": float(new[p.start + i])}
                                   for i in positions[:5]],
                        "failing_tokens": len(positions),
                    })
    return rep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a shard file, a directory of shards, or a glob")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", type=int, default=2048, help="tokens per packed row")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--temperature", type=float, default=1.0, help="the run's sampling.temperature")
    ap.add_argument("--top-p", type=float, default=1.0, help="the run's sampling.top_p")
    ap.add_argument("--top-k", type=int, default=0, help="the run's sampling.top_k")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    samples = load_samples(args.path)
    try:
        rows = pack(samples, args.budget, seed=0)
    except SampleTooLong as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = load_causal_lm(args.model)
    rep = check_rows(model, rows, args.tol, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.json:
        print(json.dumps({**asdict(rep), "ok": rep.ok}))
    else:
        print(f"samples {rep.samples}  rows {rep.rows}  trainable tokens {rep.trainable_tokens}  "
              f"max |new-old| {rep.max_abs_diff:.3g}  max |ratio-1| {rep.max_abs_ratio_minus_1:.3g}  "
              f"tol {args.tol:g}  {'OK' if rep.ok else 'FAIL'}")
        for f in rep.failures:
            print(f"  FAIL {f['sample']} ({f['failing_tokens']} tokens): " + ", ".join(
                f"turn {t['turn']} pos {t['position']} old {t['old']:.6f} new {t['new']:.6f}" for t in f["tokens"]))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
