"""The training data: what a rollout becomes on disk and everything that reads it back.

- shards.py: the Arrow/Parquet schema, the atomic shard writer, manifests and checksums.
- samples.py: a rollout's turns as training samples (segments split at breaks), built by the renderer service.
- outputs.py: a run's output directory: manifest, summary, resume checks, complete and partial groups.
- layout.py: the run directory a trainer and ``tito run --follow`` share (broadcasts/, rollouts/step_k/).
- readers.py: lazy readers for a trainer (``open_shards``, ``iter_samples``, ``read_step`` of a follow run).
- packing.py: samples packed into fixed-length rows (positions, cu_seqlens, per-token advantages).
- export.py: ``tito export``: the shards in TRL's, verl's, SkyRL's or prime-rl's field names.
- inspect_shards.py, viewer.py: ``tito inspect``: a summary, a sample in the terminal, the HTML viewer.

It may import tito_renderers and rollout/engines (the sampler's log-softmax, for packing); never the loop,
follow, serve, the command line or actors: they all write or read through it. The names a trainer imports stay here: ``from rollout.data import read_step``."""

from .readers import Sample, StepBatch, iter_samples, load_samples, open_shards, read_step, sample_filter, shard_files

__all__ = ["Sample", "StepBatch", "iter_samples", "load_samples", "open_shards", "read_step", "sample_filter",
           "shard_files"]
