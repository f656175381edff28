"""A sealed follow batch as prime-rl's trainer reads it: ``rollouts/step_k/rank_<r>.bin``.

``follow.output_format: prime-rl`` (docs/follow.md): besides its Arrow shards, each batch ``k`` is written as
one file per trainer data-parallel rank, ``RUN_DIR/rollouts/step_k/rank_<r>.bin``, the path prime-rl's
filesystem transport reads (its trainer's ``output_dir`` is RUN_DIR; both count steps from 1).

Mirrors prime-rl at commit 559b447 (PrimeIntellect-ai/prime-rl, "chore: bump verifiers to latest main"):

* the struct: ``MicroBatch`` of ``src/prime_rl/transports/rollouts/types.py``, a msgspec Struct with
  ``array_like=True`` (encoded as a msgpack *array*, so field order is the wire format) and
  ``omit_defaults=True``; a file is one ``list[MicroBatch]``, encoded with ``msgspec.msgpack.Encoder()``;
* the file: ``FileSystemMicroBatchSender`` in ``transports/rollouts/filesystem.py`` writes
  ``rank_<r>.bin.tmp`` and renames it; ``FileSystemMicroBatchReceiver`` waits until ``rank_<r>.bin``
  exists and decodes it with ``msgspec.msgpack.Decoder(type=list[MicroBatch])``: the rename is the only
  ready marker there is;
* the packing: ``prepare_batch`` of ``src/prime_rl/trainer/batch.py`` (what the orchestrator's
  ``BatchPacker`` calls with its ``seq_len``, ``num_train_workers`` and ``pad_to_multiple_of``):
  a sample longer than ``seq_len`` is *truncated* to its first ``seq_len`` tokens (never dropped, never
  split); samples are packed first-fit in decreasing length into micro batches of at most ``seq_len``
  tokens; with several ranks, bins are split until there are at least as many as ranks (a multiple of
  them); each micro batch is padded to a multiple of ``pad_to_multiple_of`` (token 1, loss mask off,
  position ids restarting); the count is padded to a multiple of the ranks with all-masked copies of the
  first; every rank gets the same number, balanced by token count (prime-rl's fallback cost when it
  cannot load the model's config; prime-rl balances with Karmarkar-Karp, this with a greedy equal-count
  assignment: which rank trains which micro batch differs, what each rank receives has the same shape).

The struct changes often upstream: a trainer from another commit may not decode these files.

Each field, filled from tito's rows (the shards read_step returns, so withheld samples are not there):
``input_ids`` the row's ``token_ids``; ``loss_mask`` its ``loss_mask``; ``inference_logprobs`` its
``logprobs`` (0 on context); ``advantages`` the row's ``advantage`` on every trainable token and 0 on
context (prime-rl's orchestrator likewise assigns a rollout's scalar to its sampled tokens);
``position_ids`` 0..n-1 per sample; ``temperatures`` the row's ``temperature`` on every token (0, greedy, or null,
is written as 1.0: tito reports a greedy token's logprob from the raw log-softmax, which is the trainer's
logits / 1.0); ``env_names`` the run's ``env.name`` on every token; ``sequence_lengths`` and ``seq_lens``
each packed sample's length. ``ref_logprobs``, ``routed_experts``, ``mm_kwargs``, ``mm_token_type_ids`` and
the ``rl/ce/ref_kl_weights`` streams are absent (None): tito has no reference model, MoE routing record or
images, and None is prime-rl's plain GRPO (rl weight 1.0 on the loss mask, no other component).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from .readers import Sample, iter_samples, open_shards

COMMIT = "559b44772"  # PrimeIntellect-ai/prime-rl: the commit whose MicroBatch and packing this mirrors
PAD_TOKEN_ID = 1  # prime-rl's pad_micro_batch pads input_ids with 1 (loss mask off, so never trained)
RESERVED_ENV = "all"  # prime-rl's trainer refuses this env name (its aggregate metrics key)


def rank_file(step_dir: str | Path, rank: int) -> Path:
    return Path(step_dir) / f"rank_{rank}.bin"


class EncodedTensor(msgspec.Struct, array_like=True, gc=False):
    """prime-rl's {dtype, shape, raw bytes} tensor (only its type is needed here: tito sends no images)."""

    dtype: str
    shape: list[int]
    data: bytes


class RoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str


class MicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """prime-rl's ``MicroBatch`` at :data:`COMMIT`, field for field and in its order (the order *is* the wire
    format of an ``array_like`` struct). Per-token lists are aligned with ``input_ids``."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]  # the packed samples' lengths (the last one includes padding)
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]  # sample boundaries; equal to sequence_lengths for text
    ref_logprobs: list[float] | None = None
    routed_experts: RoutedExperts | None = None
    mm_kwargs: dict[str, EncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


@dataclass(frozen=True)
class PrimeRLOptions:
    """The prime-rl orchestrator settings that shape the rank files (named as prime-rl names them)."""

    seq_len: int = 2048
    num_train_workers: int = 1
    pad_to_multiple_of: int = 1

    @classmethod
    def of_run(cls, config: dict[str, Any]) -> PrimeRLOptions | None:
        """The options of a run's config dict (``RunConfig.model_dump``, as the manifest records it); None
        unless ``follow.output_format`` is ``prime-rl``."""
        follow = config.get("follow") or {}
        if follow.get("output_format") != "prime-rl":
            return None
        return cls(**(follow.get("prime_rl") or {}))


@dataclass
class _Packed:
    """One sample as prime-rl's ``prepare_sample`` makes it: truncated to seq_len, its per-token lists."""

    ids: list[int]
    mask: list[bool]
    advantages: list[float]
    logprobs: list[float]
    temperature: float
    env_name: str

    def __len__(self) -> int:
        return len(self.ids)


def _prepared(sample: Sample, temperature: float, env_name: str, seq_len: int) -> _Packed:
    n = min(len(sample), seq_len)  # longer: its first seq_len tokens, as prime-rl truncates
    mask = np.asarray(sample.loss_mask[:n], dtype=bool)
    logprobs = np.where(mask, np.asarray(sample.logprobs[:n], dtype=np.float64), 0.0)
    # msgspec encodes a Python float as float64: the float32 logprob widened exactly, not re-rounded
    return _Packed(np.asarray(sample.token_ids[:n], dtype=np.int64).tolist(), mask.tolist(),
                   np.where(mask, float(sample.advantage), 0.0).tolist(), logprobs.tolist(),
                   temperature, env_name)


def _split(bin_: list[_Packed]) -> tuple[list[_Packed], list[_Packed]]:
    """Two halves of a bin, close in tokens: the longest first, each onto the lighter side."""
    left: list[_Packed] = []
    right: list[_Packed] = []
    for s in sorted(bin_, key=len, reverse=True):
        (left if sum(map(len, left)) <= sum(map(len, right)) else right).append(s)
    return left, right


def _bins(samples: list[_Packed], seq_len: int, ranks: int) -> list[list[_Packed]]:
    """First fit in decreasing length (stable on ties), then, with several ranks, the heaviest bins of more
    than one sample split until every rank has one (the count a multiple of the ranks), as prime-rl does."""
    bins: list[list[_Packed]] = []
    used: list[int] = []
    for s in sorted(samples, key=len, reverse=True):
        for j in range(len(bins)):
            if used[j] + len(s) <= seq_len:
                bins[j].append(s)
                used[j] += len(s)
                break
        else:
            bins.append([s])
            used.append(len(s))
    if ranks > 1:
        target = max(-(-len(bins) // ranks) * ranks, ranks)
        while len(bins) < target:
            splittable = [j for j, b in enumerate(bins) if len(b) > 1]
            if not splittable:
                break
            j = max(splittable, key=lambda j: (sum(map(len, bins[j])), j))
            bins[j], right = _split(bins[j])
            bins.append(right)
    return bins


def _micro_batch(bin_: list[_Packed], pad_to_multiple_of: int) -> MicroBatch:
    mb = MicroBatch(input_ids=[], loss_mask=[], advantages=[], inference_logprobs=[], position_ids=[],
                    sequence_lengths=[], temperatures=[], env_names=[], seq_lens=[])
    for s in bin_:
        n = len(s)
        mb.input_ids += s.ids
        mb.loss_mask += s.mask
        mb.advantages += s.advantages
        mb.inference_logprobs += s.logprobs
        mb.position_ids += range(n)
        mb.temperatures += [s.temperature] * n
        mb.env_names += [s.env_name] * n
        mb.sequence_lengths.append(n)
        mb.seq_lens.append(n)
    pad = -len(mb.input_ids) % pad_to_multiple_of  # the trainer's context-parallel degree divides each row
    if pad:
        mb.input_ids += [PAD_TOKEN_ID] * pad
        mb.loss_mask += [False] * pad
        mb.advantages += [0.0] * pad
        mb.inference_logprobs += [0.0] * pad
        mb.position_ids += range(pad)
        mb.temperatures += [1.0] * pad
        mb.env_names += [""] * pad
        mb.sequence_lengths[-1] += pad
        mb.seq_lens[-1] += pad
    return mb


def _masked_copy(mb: MicroBatch) -> MicroBatch:
    """A micro batch that trains nothing (loss mask off, advantages 0): what a rank with nothing left
    runs so that every rank takes the same number of steps (FSDP's collectives need it)."""
    n = len(mb.input_ids)
    return msgspec.structs.replace(mb, loss_mask=[False] * n, advantages=[0.0] * n)


def _distribute(batches: list[MicroBatch], ranks: int) -> list[list[MicroBatch]]:
    """Equal counts per rank, balanced by tokens: heaviest first onto the lightest rank with room. Each rank
    keeps its micro batches in packing order."""
    per_rank = len(batches) // ranks
    load = [0] * ranks
    owned: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(batches)), key=lambda i: (-len(batches[i].input_ids), i)):
        r = min((r for r in range(ranks) if len(owned[r]) < per_rank), key=lambda r: (load[r], r))
        owned[r].append(i)
        load[r] += len(batches[i].input_ids)
    return [[batches[i] for i in sorted(idx)] for idx in owned]


def micro_batch_grid(samples: Sequence[Sample], temperatures: Sequence[float | None], *, env_name: str,
                     options: PrimeRLOptions) -> list[list[MicroBatch]]:
    """The micro batches of each rank (``options.num_train_workers`` lists of equal length) for samples in
    read_step's order, ``temperatures[i]`` being sample i's sampling temperature (see the module doc)."""
    if len(temperatures) != len(samples):
        raise ValueError(f"{len(temperatures)} temperatures for {len(samples)} samples")
    if env_name == RESERVED_ENV:
        raise ValueError(f"env.name {env_name!r} is reserved by prime-rl's trainer (its aggregate metrics key)")
    seq_len, ranks = options.seq_len, options.num_train_workers
    prepared = [_prepared(s, float(t) if t else 1.0, env_name, seq_len) for s, t in zip(samples, temperatures)]
    batches = [_micro_batch(b, options.pad_to_multiple_of) for b in _bins(prepared, seq_len, ranks)]
    if batches:
        batches += [_masked_copy(batches[0]) for _ in range(-len(batches) % ranks)]
    return _distribute(batches, ranks) if batches else [[] for _ in range(ranks)]


def _write_atomic(path: Path, data: bytes) -> None:
    """prime-rl's receiver reads a rank file as soon as its name exists: the bytes go to a temporary beside it,
    are flushed to disk, and the rename publishes them whole."""
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_step(step_dir: str | Path, shards: Sequence[Path], *, env_name: str, options: PrimeRLOptions,
               ) -> dict[str, Any]:
    """Write batch ``step_dir``'s rank files from its shard files (those its manifest will list) and return
    what the manifest records about them. Called by the follow service before the manifest seals the batch,
    so a sealed batch always has its rank files."""
    step_dir = Path(step_dir)
    files = [str(p) for p in shards]
    samples = list(iter_samples(files)) if files else []
    temperatures: list[float | None] = [None] * len(samples)
    if files and "temperature" in open_shards(files).schema.names:
        # the same files in the same order as iter_samples: one scalar column
        temperatures = open_shards(files).to_table(columns=["temperature"]).column(0).to_pylist()
    grid = micro_batch_grid(samples, temperatures, env_name=env_name, options=options)
    encoder = msgspec.msgpack.Encoder()
    for rank, batches in enumerate(grid):
        _write_atomic(rank_file(step_dir, rank), encoder.encode(batches))
    truncated = [s for s in samples if len(s) > options.seq_len]
    return {"prime_rl_commit": COMMIT, "seq_len": options.seq_len, "num_train_workers": options.num_train_workers,
            "pad_to_multiple_of": options.pad_to_multiple_of, "micro_batches_per_rank": len(grid[0]),
            "samples": len(samples), "truncated_samples": len(truncated),
            # sampled tokens past seq_len: prime-rl's truncation drops them from training
            "truncated_trainable_tokens": int(sum(np.asarray(s.loss_mask[options.seq_len:], bool).sum()
                                                  for s in truncated))}
