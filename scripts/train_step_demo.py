"""One GRPO-style policy-gradient step on the embedded model from shards, on the CPU.

    python scripts/train_step_demo.py out/demo [--model smollm2-135m] [--budget 2048] [--lr 1e-5] [--json]
                                               [--save CHECKPOINT_DIR]

Takes one packed micro-batch (the first packed row; ``--budget`` sizes it), computes per-token
``ratio = exp(logp_new - logp_old)`` with the shards' sampler logprobs as old, the clipped surrogate
``-min(ratio * A, clip(ratio, 1-eps, 1+eps) * A)`` with the per-token advantages, averaged over the
trainable tokens, and takes one AdamW step. Ratio statistics on the trainable tokens are printed before
the step (they are 1 when the shards were sampled at temperature 1 / top-p 1 from these weights, see
scripts/verify_identity.py) and after it (recomputed with the updated weights: they move away from 1).

The model runs in train() mode for the step; SmolLM2 has no dropout, so train and eval forward passes
agree. With all-zero advantages (every rollout of a group equally rewarded) the surrogate has no
gradient; ``--advantage-fallback`` then uses ``reward - mean reward`` of the micro-batch, or 1.0, so
the demo always shows a step (stated in the output).

``--save DIR`` writes the updated weights as a safetensors checkpoint directory (config included, tied
embeddings kept tied), which an engine loads with ``update_weights(DIR, version)`` (``tito serve``:
``POST /update_weights {"weight_dir": DIR, "version": N}``). The directory appears by an atomic rename.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from rollout.data import load_samples
from rollout.data.packing import PackedRow, pack, packed_logprobs
from rollout.models import load_causal_lm


def ratio_stats(logp_new: torch.Tensor, row: PackedRow) -> dict[str, float]:
    """mean/min/max of exp(new - old) and max |ratio - 1| over the row's trainable tokens."""
    m = torch.from_numpy(row.loss_mask)
    r = (logp_new.detach().double() - torch.from_numpy(row.inference_logprobs).double())[m].exp()
    return {"mean": float(r.mean()), "min": float(r.min()), "max": float(r.max()),
            "max_abs_minus_1": float((r - 1).abs().max())}


def grpo_loss(logp_new: torch.Tensor, row: PackedRow, eps: float = 0.2) -> torch.Tensor:
    """Clipped surrogate (PPO/GRPO), masked mean over trainable tokens."""
    m = torch.from_numpy(row.loss_mask)
    old = torch.from_numpy(row.inference_logprobs)
    adv = torch.from_numpy(row.advantages)
    ratio = torch.exp(logp_new - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
    return -(surrogate * m).sum() / m.sum().clamp(min=1)


def save_checkpoint(model: torch.nn.Module, target: str | os.PathLike) -> Path:
    """The model's weights and config as a safetensors directory at ``target``, which must not exist yet
    (written next to it, then renamed into place: a reader never sees half a checkpoint)."""
    target = Path(target)
    if target.exists():
        raise FileExistsError(f"{target} already exists: choose a new directory per checkpoint")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def run(path: str, model_name: str = "smollm2-135m", budget: int = 2048, lr: float = 1e-5, seed: int = 0,
        advantage_fallback: bool = True, save: str | None = None) -> dict:
    """The demo's numbers: ratio statistics before and after one step, the loss, and the batch size."""
    torch.manual_seed(seed)
    samples = load_samples(path)
    note = "shard advantages"
    if advantage_fallback and all(s.advantage == 0 for s in samples):
        rewards = np.array([s.meta.get("reward") or 0.0 for s in samples])
        centered = rewards - rewards.mean()
        for s, a in zip(samples, centered if centered.any() else np.ones(len(samples))):
            s.advantage = float(a)
        note = "fallback: reward - mean" if centered.any() else "fallback: advantage 1.0"
    row = pack(samples, budget, seed=seed)[0]
    model = load_causal_lm(model_name)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    logp = packed_logprobs(model, row)
    before = ratio_stats(logp, row)
    loss = grpo_loss(logp, row)
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        after = ratio_stats(packed_logprobs(model, row), row)
    saved = str(save_checkpoint(model, save)) if save else None
    return {"samples": len(row.pieces), "tokens": len(row), "trainable_tokens": int(row.loss_mask.sum()),
            "advantages": note, "loss": float(loss.detach()), "before": before, "after": after, "saved": saved}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--no-advantage-fallback", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", metavar="DIR", help="write the updated weights as a safetensors checkpoint here")
    args = ap.parse_args(argv)
    if args.save and Path(args.save).exists():  # before the model loads: nothing is computed for nothing
        ap.error(f"--save {args.save}: already exists; choose a new directory per checkpoint")
    out = run(args.path, args.model, args.budget, args.lr, advantage_fallback=not args.no_advantage_fallback,
              save=args.save)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"micro-batch: {out['samples']} samples, {out['tokens']} tokens, {out['trainable_tokens']} trainable "
          f"({out['advantages']}); loss {out['loss']:.6f}")
    for k in ("before", "after"):
        s = out[k]
        print(f"ratio {k:6s} mean {s['mean']:.6f}  min {s['min']:.6f}  max {s['max']:.6f}  "
              f"max|r-1| {s['max_abs_minus_1']:.3g}")
    if out["saved"]:
        print(f"checkpoint: {out['saved']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
