"""``follow.output_format: prime-rl``: each sealed batch also as prime-rl's trainer reads it.

prime-rl is not on PyPI (``pip index versions prime-rl``: no distribution; its ``prime-rl-configs`` package
holds no transport types), so its struct cannot be installed. :class:`TheirMicroBatch` below is therefore a
MIRROR, written here from reading prime-rl at commit 559b447 (``src/prime_rl/transports/rollouts/types.py``,
``MicroBatch``: msgspec, ``array_like=True``, ``omit_defaults=True``, its 16 fields in their order), kept apart
from the writer's own struct so the two are compared rather than one trusted. The files are decoded as prime-rl's
``FileSystemMicroBatchReceiver`` decodes them (``msgspec.msgpack.Decoder(type=list[MicroBatch])`` on
``rollouts/step_k/rank_<r>.bin``), and once untyped, to check the raw wire shape (arrays, not maps).

What is checked against the batch's own shards (``read_step``): every sample appears exactly once across the
ranks, its tokens in order (truncated to ``seq_len`` the way prime-rl's ``prepare_sample`` truncates: its first
``seq_len`` tokens, the sample kept), with its loss mask, its logprobs on trainable tokens, its advantage on every
trainable token (0 on context), positions restarting at 0, its temperature and env name on every token; no micro
batch holds more than ``seq_len`` tokens; every rank has the same number of micro batches; the rank files are in
place (atomically: no temporary left) before the manifest seals the batch; withheld (stale) rollouts are absent.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import msgspec
import numpy as np
import pytest

import tito_renderers as renderers
from rollout.config import FollowConfig, RunConfig
from rollout.data import layout, load_samples, read_step
from rollout.data.prime_rl import PrimeRLOptions, rank_file, write_step
from rollout.data.shards import output_shards, read_manifest
from rollout.engines.replay import ReplayEngine, ReplayRecord
from rollout.envs.arithmetic import ArithmeticEnv
from rollout.envs.base import Task
from rollout.follow.publish import publish_weights
from rollout.follow.service import seal_batch
from rollout.handles import LocalEngine, LocalRenderer
from rollout.loop import RolloutDriver
from rollout.renderer_service import RendererService

from ._support import ours, smollm2_gguf, tokenizer_dir
from .test_follow import Harness, _config_of, _perturbed, _tasks
from .test_follow_withheld import QWEN


class TheirEncodedTensor(msgspec.Struct, array_like=True, gc=False):
    dtype: str
    shape: list[int]
    data: bytes


class TheirRoutedExperts(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    data: bytes
    shape: list[int]
    dtype: str


class TheirMicroBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Mirror of prime-rl 559b447 ``MicroBatch`` (see the module doc)."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    position_ids: list[int]
    sequence_lengths: list[int]
    temperatures: list[float]
    env_names: list[str]
    seq_lens: list[int]
    ref_logprobs: list[float] | None = None
    routed_experts: TheirRoutedExperts | None = None
    mm_kwargs: dict[str, TheirEncodedTensor] | None = None
    mm_token_type_ids: list[int] | None = None
    rl_weights: list[float] | None = None
    ce_weights: list[float] | None = None
    ref_kl_weights: list[float] | None = None


PER_TOKEN = ("loss_mask", "advantages", "inference_logprobs", "position_ids", "temperatures", "env_names")


def decode_ranks(step_dir: Path, ranks: int) -> list[list[TheirMicroBatch]]:
    decoder = msgspec.msgpack.Decoder(type=list[TheirMicroBatch])
    grid = [decoder.decode(rank_file(step_dir, r).read_bytes()) for r in range(ranks)]
    assert not rank_file(step_dir, ranks).exists()  # exactly num_train_workers files
    fields = msgspec.structs.fields(TheirMicroBatch)
    for r in range(ranks):  # the raw wire: each micro batch a msgpack array, its 16 fields by position
        raw = msgspec.msgpack.decode(rank_file(step_dir, r).read_bytes())
        assert all(isinstance(mb, list) and len(mb) == len(fields) for mb in raw)
        assert raw == [[getattr(mb, f.name) for f in fields] for mb in grid[r]]
    return grid


def expected_span(sample, seq_len: int) -> tuple:
    n = min(len(sample), seq_len)
    mask = np.asarray(sample.loss_mask[:n], bool)
    return (tuple(int(t) for t in sample.token_ids[:n]), tuple(bool(m) for m in mask),
            tuple(float(x) if m else 0.0 for x, m in zip(np.asarray(sample.logprobs[:n], np.float32), mask)),
            tuple(float(sample.advantage) if m else 0.0 for m in mask))


def check_grid(grid: list[list[TheirMicroBatch]], samples, *, seq_len: int, env: str, temperature: float) -> None:
    """The decoded rank files hold exactly ``samples`` (see the module doc for each check)."""
    assert len({len(batches) for batches in grid}) == 1, [len(b) for b in grid]  # FSDP: same count on every rank
    spans: Counter[tuple] = Counter()
    trainable = 0
    for mb in (mb for batches in grid for mb in batches):
        n = len(mb.input_ids)
        assert 0 < n <= seq_len, n
        assert all(len(getattr(mb, f)) == n for f in PER_TOKEN)
        assert sum(mb.sequence_lengths) == n and mb.seq_lens == mb.sequence_lengths
        assert mb.ref_logprobs is None and mb.rl_weights is None and mb.mm_kwargs is None
        start = 0
        for length in mb.sequence_lengths:
            sl = slice(start, start + length)
            assert mb.position_ids[sl] == list(range(length))
            assert set(mb.temperatures[sl]) == {temperature} and set(mb.env_names[sl]) == {env}
            if any(mb.loss_mask[sl]):  # all-masked copies pad a rank's count: they train nothing
                spans[(tuple(mb.input_ids[sl]), tuple(mb.loss_mask[sl]), tuple(mb.inference_logprobs[sl]),
                       tuple(mb.advantages[sl]))] += 1
            start += length
        trainable += sum(mb.loss_mask)
    want = Counter(expected_span(s, seq_len) for s in samples)
    assert spans == want
    assert trainable == sum(int(np.asarray(s.loss_mask[:seq_len], bool).sum()) for s in samples)


@pytest.fixture(scope="module")
def model_path() -> str:
    from rollout.models import resolve_model

    smollm2_gguf()
    return str(resolve_model("smollm2-135m"))


def test_a_follow_batch_is_written_as_prime_rl_rank_files_before_it_seals(tmp_path, model_path):
    """The embedded engine, the real renderer service and shards, and a stand-in prime-rl trainer: it waits for
    ``rank_<r>.bin`` of step k as prime-rl's receiver does, decodes every rank with the mirror, then publishes
    version k (max_off_policy_steps 0: batch k + 1 starts only then)."""
    from rollout.models import load_causal_lm

    model = load_causal_lm(model_path)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ranks = 2
    cfg = RunConfig(
        env={"name": "arithmetic", "options": {"difficulty": 1}}, group_size=2, max_turns=1, max_tokens_per_turn=12,
        max_tokens_per_rollout=12, sampling={"temperature": 0.9, "seed": 7}, max_concurrent_rollouts=4,
        follow=FollowConfig(groups_per_step=2, poll_interval_s=0.05, max_steps=2, max_off_policy_steps=0,
                            output_format="prime-rl", prime_rl={"seq_len": 4096, "num_train_workers": ranks}))
    h = Harness(cfg, tmp_path, model_path, _tasks(4, "What is 3 + 4?"))
    received: dict[int, list[list[TheirMicroBatch]]] = {}

    async def trainer() -> None:
        for k in (1, 2):
            step = layout.step_dir(tmp_path, k)
            while not all(rank_file(step, r).exists() for r in range(ranks)):
                await asyncio.sleep(0.05)
            received[k] = decode_ranks(step, ranks)
            publish_weights(tmp_path, k, _perturbed(base, 1 + 0.01 * k), config=_config_of(model))

    async def main() -> int:
        stand_in = asyncio.create_task(trainer())
        sealed = await asyncio.wait_for(h.follow.run(), 240)
        await asyncio.wait_for(stand_in, 30)
        return sealed

    assert asyncio.run(main()) == 2
    h.service.close()
    for k in (1, 2):
        step = layout.step_dir(tmp_path, k)
        batch = read_step(tmp_path, k, timeout=5)
        assert len(batch) == 4  # 2 groups x 2 rollouts, single turn: one sample each
        check_grid(received[k], batch, seq_len=4096, env="arithmetic", temperature=0.9)
        assert decode_ranks(step, ranks) == received[k]  # what the trainer read is what stays
        manifest_ns = (step / layout.SEALED).stat().st_mtime_ns
        assert all(rank_file(step, r).stat().st_mtime_ns <= manifest_ns for r in range(ranks))
        assert not list(step.glob("*.tmp")) and not list(step.glob(".*"))
        recorded = read_manifest(step)["follow"]["prime_rl"]
        assert recorded["num_train_workers"] == ranks and recorded["samples"] == 4
        assert recorded["truncated_samples"] == 0
    # batch 2 was admitted only once the stand-in trainer had read batch 1's rank files and published version 1
    assert set(read_manifest(layout.step_dir(tmp_path, 2))["follow"]["tokens_per_version"]) == {"1"}

    # the same real shards, packed to a sequence length shorter than the longest sample: prime-rl truncates it
    # to its first seq_len tokens (kept, not dropped); one rank and cp padding 1
    batch = read_step(tmp_path, 1)
    lengths = sorted(len(s) for s in batch)
    seq_len = lengths[-1] - 3
    assert seq_len >= lengths[0]
    out = tmp_path / "short"
    out.mkdir()
    stats = write_step(out, output_shards(batch.path), env_name="arithmetic",
                       options=PrimeRLOptions(seq_len=seq_len, num_train_workers=1))
    assert stats["truncated_samples"] == sum(n > seq_len for n in lengths) >= 1
    check_grid(decode_ranks(out, 1), batch, seq_len=seq_len, env="arithmetic", temperature=0.9)


def test_withheld_rollouts_are_not_in_the_rank_files(tmp_path):
    """The stale rollouts of test_follow_withheld's fleet (one engine on version 0, one on 1) are withheld from
    the shards; the rank files hold exactly the kept ones, with the kept rows' advantages."""
    tok = ours(QWEN)
    r = renderers.create_renderer(tok)
    env = ArithmeticEnv()
    task = Task(task_id="t", messages=[{"role": "user", "content": "What is 3 + 4?"}], answer="7")
    prompt = r.render_ids(task.messages, env.tools, add_generation_prompt=True)

    def record(text: str) -> ReplayRecord:
        ids = tok.encode(f"{text}<|im_end|>")
        return ReplayRecord(prompt, ids, [-0.5] * len(ids), "stop", ids[-1])

    fresh = ReplayEngine([record("7"), record("3")], vocab_size=tok.vocab_size, max_model_len=4096,
                         token_delay_s=0.01, weight_version=1)
    stale = ReplayEngine([record("3"), record("3")], vocab_size=tok.vocab_size, max_model_len=4096,
                         token_delay_s=0.01, weight_version=0)
    svc = RendererService(str(tokenizer_dir(QWEN)), out_dir=str(tmp_path / layout.ROLLOUTS), flush_interval_s=None)
    cfg = RunConfig(group_size=4, max_turns=1, max_tokens_per_turn=16, max_tokens_per_rollout=16,
                    follow=FollowConfig(output_format="prime-rl", prime_rl={"seq_len": 64, "num_train_workers": 3}))
    driver = RolloutDriver(cfg, env, [LocalEngine(fresh), LocalEngine(stale)], [LocalRenderer(svc)], fresh.info(), r)
    out_dir = layout.step_dir(tmp_path, 2)
    outcomes = asyncio.run(driver.run_group(task, 0, group_id="t@2.0", out_dir=str(out_dir), min_version=1))
    assert sum(bool(o.withheld) for o in outcomes) == 2
    files = asyncio.run(LocalRenderer(svc).close_output(str(out_dir)))["files"]
    seal_batch(tmp_path, 2, files=files, outcomes=outcomes, bound=1, info={}, config=cfg.model_dump(mode="json"))
    svc.close()
    kept = load_samples(out_dir)
    assert sorted(s.advantage for s in kept) == [-0.25, 0.75]
    grid = decode_ranks(out_dir, 3)
    # two samples, three ranks: each packed alone would leave a rank idle, so the third gets an all-masked copy
    assert [len(b) for b in grid] == [1, 1, 1]
    check_grid(grid, kept, seq_len=64, env="arithmetic", temperature=1.0)
    assert read_manifest(out_dir)["follow"]["prime_rl"]["samples"] == 2


def test_rank_files_only_with_the_prime_rl_format(tmp_path):
    """The default stays shards alone; an unknown format is refused by the config, naming the choices."""
    assert PrimeRLOptions.of_run(RunConfig().model_dump(mode="json")) is None
    on = RunConfig(follow={"output_format": "prime-rl", "prime_rl": {"seq_len": 512, "num_train_workers": 4}})
    assert PrimeRLOptions.of_run(on.model_dump(mode="json")) == PrimeRLOptions(seq_len=512, num_train_workers=4)
    with pytest.raises(ValueError, match="prime-rl"):
        RunConfig(follow={"output_format": "prime_rl"})
    with pytest.raises(ValueError, match="num_train_workers"):
        RunConfig(follow={"output_format": "prime-rl", "prime_rl": {"num_train_workers": 0}})


def test_an_empty_batch_writes_empty_rank_files(tmp_path):
    """No sample (every rollout withheld or failed): each rank file holds an empty list, as prime-rl's own
    prepare_batch returns for no samples; the files still exist, so the batch seals with them."""
    write_step(tmp_path, [], env_name="arithmetic", options=PrimeRLOptions(num_train_workers=2))
    assert decode_ranks(tmp_path, 2) == [[], []]
