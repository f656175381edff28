"""``tito export DIR --to trl|verl|skyrl|prime``: each trainer's field names and layout.

The shards are multi-turn conversations rendered by the real SmolLM2 renderer (its ``sampled_mask`` is the
loss mask: two assistant turns with a tool result between them) and written by the real ShardWriter; the
logprobs are synthetic. TRL is checked by the real library: ``SFTTrainer`` (TRL 1.16, a cached venv on
top of this one, torch from this venv) trains two steps on the export directory with the real
SmolLM2-135M, and the labels it computes are compared with the *source* shards' loss mask. verl, SkyRL and
prime-rl do not install here (Python 3.12 / GPU stacks): their structures are checked against the field
names, dtypes, shapes and rules in their source, written out below as expected values (commits cited in
docs/trainer.md), never produced by the exporter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout.cli.main import main as tito_main
from rollout.config import RunConfig
from rollout.data import open_shards
from rollout.data.export import TARGETS, export, skyrl_generator_output, verl_batch
from rollout.data.outputs import write_outputs
from rollout.data.shards import DATA_DIR, STREAM, ShardWriter

from ._support import cached_venv, smollm2_gguf

GROUPS, G = 3, 2
TEMPERATURE = 0.7

CONVERSATIONS = [
    [{"role": "system", "content": "You are a calculator."},
     {"role": "user", "content": f"What is {a} + {b}? Use the tool."},
     {"role": "assistant", "content": f"Let me add {a} and {b}."},
     {"role": "user", "content": f"The tool says {a + b}."},
     {"role": "assistant", "content": f"The answer is {a + b}."}]
    for a, b in [(2, 3), (10, 7), (41, 1)]
]


def _rows() -> list[dict]:
    """Shard rows: real token ids and sampled masks from the SmolLM2 renderer; advantage, reward and logprobs
    vary per row. Rollout t1#1 has no sampled token (a failure before sampling) and is skipped by exports."""
    from tito_renderers import create_renderer, load_tokenizer

    renderer = create_renderer(load_tokenizer(smollm2_gguf()))
    rows = []
    for g, messages in enumerate(CONVERSATIONS):
        out = renderer.render(messages)
        ids, mask = list(out.token_ids), list(out.sampled_mask)
        assert any(mask) and not all(mask[mask.index(True):]), "the fixture must have context inside the response"
        for k in range(G):
            row_mask = [False] * len(mask) if (g, k) == (1, 1) else mask
            n_sampled = sum(row_mask)
            rows.append({
                "token_ids": ids, "loss_mask": row_mask,
                "logprobs": [-0.01 * (t % 7 + 1) if m else 0.0 for t, m in enumerate(row_mask)],
                "message_index": list(out.message_indices), "turn_index": [0] * len(ids),
                "messages": json.dumps(messages), "reward": float(g + k), "reward_components": "{}",
                "advantage": k - 0.5, "task_id": f"t{g}", "group_id": f"t{g}", "rollout_id": f"t{g}#{k}",
                "segment_index": 0, "segment_count": 1, "finish_reason": "length" if k == 0 else "no_tool_call",
                "breaks": "[]", "weight_version": 0, "model": "smollm2", "renderer": renderer.name,
                "template_sha256": renderer.template_sha256, "prompt_tokens": len(ids) - n_sampled,
                "completion_tokens": n_sampled, "error": None,
                "temperature": TEMPERATURE, "top_p": 1.0, "top_k": 0, "seed": None,
            })
    return rows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An output directory as ``tito run`` lays it out (shards in data/, manifest with the run config)."""
    out = tmp_path_factory.mktemp("export") / "demo"
    rows = _rows()
    w = ShardWriter(out / DATA_DIR, stream=f"{STREAM}-r0", rows_per_file=4)
    for g in range(GROUPS):
        w.add(rows[g * G:(g + 1) * G])
    w.close()
    cfg = RunConfig(group_size=G, env={"name": "arithmetic"}, sampling={"temperature": TEMPERATURE})
    write_outputs(out, cfg.model_dump(mode="json"), {"renderer": "r", "template_sha256": "0", "rollouts": len(rows)})
    return out, rows


def _trainable(rows: list[dict]) -> list[dict]:
    return [r for r in rows if any(r["loss_mask"])]


def test_cli_writes_each_target_beside_the_source(run_dir, capsys):
    out, rows = run_dir
    for target in TARGETS:
        assert tito_main(["export", str(out), "--to", target]) == 0
        dest = out.with_name(f"demo-{target}")
        printed = capsys.readouterr().out
        assert "exported 5 samples" in printed and "skipped 1 without a trainable token" in printed
        assert [p.name for p in sorted(dest.iterdir())] == ["train-00000.parquet"]
        assert pq.read_table(dest).num_rows == len(_trainable(rows))
    # a second export into the same place, or into the source, is refused with the reason
    assert tito_main(["export", str(out), "--to", "trl"]) == 2
    assert "already holds files" in capsys.readouterr().err
    for inside in (out, out / "trl"):
        assert tito_main(["export", str(out), "--to", "trl", "--out", str(inside)]) == 2
        assert "is inside the source" in capsys.readouterr().err
    assert tito_main(["export", str(out / DATA_DIR / "*.arrow"), "--to", "trl"]) == 2
    assert "give one (--out)" in capsys.readouterr().err
    assert tito_main(["export", str(out / "nothing"), "--to", "trl", "--out", str(out.parent / "x")]) == 2
    assert "no shard files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tito_main(["export", str(out), "--to", "openrlhf"])


def test_trl_columns(run_dir, tmp_path):
    out, rows = run_dir
    result = export(out, "trl", tmp_path / "trl")
    got = pq.read_table(result.out).to_pylist()
    assert result.rows == 5 and result.skipped == 1
    for src, row in zip(_trainable(rows), got):
        assert row["input_ids"] == src["token_ids"] and row["completion_mask"] == src["loss_mask"]
        assert row["labels"] == [t if m else -100 for t, m in zip(src["token_ids"], src["loss_mask"])]


def test_prime_rows_decode_as_training_samples(run_dir, tmp_path):
    """prime-rl's TrainingSample (src/prime_rl/transports/rollouts/types.py): a flat sequence with a per-token
    mask, logprobs, temperatures and advantages (all as long as token_ids) and the env name."""

    class TrainingSample(msgspec.Struct):  # the fields and types prime-rl declares (its optional ones omitted)
        token_ids: list[int]
        mask: list[bool]
        logprobs: list[float]
        temperatures: list[float]
        env_name: str
        advantages: list[float] | None = None

    out, rows = run_dir
    result = export(out, "prime", tmp_path / "prime")
    got = [msgspec.convert(r, TrainingSample) for r in pq.read_table(result.out).to_pylist()]
    for src, s in zip(_trainable(rows), got):
        n = len(src["token_ids"])
        assert s.token_ids == src["token_ids"] and s.mask == src["loss_mask"]
        assert len(s.logprobs) == len(s.temperatures) == len(s.advantages) == n
        np.testing.assert_allclose(s.logprobs, src["logprobs"], rtol=1e-6)
        assert s.temperatures == pytest.approx([TEMPERATURE] * n)
        assert s.env_name == "arithmetic"  # the run's env.name, from the manifest
        assert s.advantages == [src["advantage"] if m else 0.0 for m in src["loss_mask"]]
    named = export(out, "prime", tmp_path / "named", env_name="math", temperature=1.0)
    assert set(pq.read_table(named.out)["env_name"].to_pylist()) == {"math"}


def test_prime_needs_a_temperature(tmp_path):
    rows = [dict(r, temperature=None) for r in _rows()[:2]]
    w = ShardWriter(tmp_path / "s")
    w.add(rows)
    w.close()
    with pytest.raises(ValueError, match="records no sampling temperature"):
        export(tmp_path / "s", "prime", tmp_path / "p")
    assert export(tmp_path / "s", "prime", tmp_path / "q", temperature=0.5).rows == 2


def _split(src: dict) -> tuple[list[int], list[int], list[bool], list[float]]:
    """The documented split, computed here from the source row: prompt before the first sampled token."""
    first = src["loss_mask"].index(True)
    return (src["token_ids"][:first], src["token_ids"][first:], src["loss_mask"][first:], src["logprobs"][first:])


def test_skyrl_generator_output(run_dir, tmp_path):
    """SkyRL's GeneratorOutput (skyrl/train/generators/base.py) and the rules its trainer asserts
    (validate_generator_output in skyrl/train/utils/trainer_utils.py): every per-trajectory list as long as
    response_ids; each response's loss mask, token rewards (if a list) and rollout logprobs as long as it."""
    out, rows = run_dir
    export(out, "skyrl", tmp_path / "skyrl")
    go = skyrl_generator_output(tmp_path / "skyrl")
    documented = {"prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_metrics",
                  "rollout_logprobs", "trajectory_ids", "is_last_step"}
    assert set(go) == documented
    n = len(go["response_ids"])
    assert n == len(go["prompt_token_ids"]) == 5
    for key in ("loss_masks", "rewards", "rollout_logprobs", "stop_reasons", "trajectory_ids", "is_last_step"):
        assert len(go[key]) == n, key
    for i, src in enumerate(_trainable(rows)):
        prompt, response, mask, logprobs = _split(src)
        assert go["prompt_token_ids"][i] == prompt and go["response_ids"][i] == response
        assert go["loss_masks"][i] == [int(m) for m in mask] and all(type(m) is int for m in go["loss_masks"][i])
        assert len(go["rollout_logprobs"][i]) == len(response)
        np.testing.assert_allclose(go["rollout_logprobs"][i], logprobs, rtol=1e-6)
        assert 0 in go["loss_masks"][i]  # the user turn between the two assistant turns is context
        assert go["rewards"][i] == src["reward"] and isinstance(go["rewards"][i], float)
        assert go["stop_reasons"][i] == ("length" if src["finish_reason"] == "length" else "stop")
        assert go["trajectory_ids"][i] == {"instance_id": src["group_id"], "repetition_id": int(src["rollout_id"][-1])}
        assert go["is_last_step"][i] is True


def test_verl_dataproto_batch(run_dir, tmp_path):
    """verl's rollout DataProto (verl/experimental/agent_loop/agent_loop.py, _postprocess and the padding
    comment above it): prompts left-padded, responses right-padded, input_ids their concatenation,
    attention_mask 1 on real tokens, position_ids counting real tokens from 0, response_mask 1 on
    generated tokens only, rollout_log_probs float32 padded with 0, rm_scores the reward on the last
    response token; non-tensor uid (the GRPO group) and __num_turns__ (int32)."""
    import torch

    out, rows = run_dir
    export(out, "verl", tmp_path / "verl")
    pad = 2  # SmolLM2's pad id; any id works as long as attention_mask hides it
    batch, non_tensor = verl_batch(tmp_path / "verl", pad_token_id=pad, prompt_length=64, response_length=48)
    src = _trainable(rows)
    b = len(src)
    shapes = {"prompts": (b, 64), "responses": (b, 48), "response_mask": (b, 48), "input_ids": (b, 112),
              "attention_mask": (b, 112), "position_ids": (b, 112), "rollout_log_probs": (b, 48), "rm_scores": (b, 48)}
    assert {k: tuple(v.shape) for k, v in batch.items()} == shapes
    floats = {"rollout_log_probs", "rm_scores"}
    assert {k: v.dtype for k, v in batch.items()} == {k: torch.float32 if k in floats else torch.int64 for k in shapes}
    for i, r in enumerate(src):
        prompt, response, mask, logprobs = _split(r)
        p, n = len(prompt), len(response)
        assert batch["prompts"][i].tolist() == [pad] * (64 - p) + prompt
        assert batch["responses"][i].tolist() == response + [pad] * (48 - n)
        assert batch["input_ids"][i].tolist() == batch["prompts"][i].tolist() + batch["responses"][i].tolist()
        assert batch["attention_mask"][i].tolist() == [0] * (64 - p) + [1] * (p + n) + [0] * (48 - n)
        assert batch["position_ids"][i].tolist() == [0] * (64 - p) + list(range(p + n)) + [p + n - 1] * (48 - n)
        assert batch["response_mask"][i].tolist() == [int(m) for m in mask] + [0] * (48 - n)
        np.testing.assert_allclose(batch["rollout_log_probs"][i].numpy(), logprobs + [0.0] * (48 - n), rtol=1e-6)
        assert batch["rm_scores"][i].tolist() == [0.0] * (n - 1) + [r["reward"]] + [0.0] * (48 - n)
    assert list(non_tensor["uid"]) == [r["group_id"] for r in src]
    assert non_tensor["__num_turns__"].dtype == np.int32 and list(non_tensor["__num_turns__"]) == [5] * b
    with pytest.raises(ValueError, match="longer than"):
        verl_batch(tmp_path / "verl", pad_token_id=pad, prompt_length=4)


def test_every_export_reads_with_the_shard_readers(run_dir, tmp_path):
    """An export directory holds Parquet files only: pyarrow, HF datasets, polars and DuckDB read it as is."""
    out, rows = run_dir
    result = export(out, "skyrl", tmp_path / "skyrl")
    assert open_shards(result.out).count_rows() == 5
    import polars as pl

    assert pl.scan_parquet(result.out).collect().height == 5
    datasets = pytest.importorskip("datasets")
    d = datasets.load_dataset(str(result.out), split="train", cache_dir=str(tmp_path / "cache"))
    assert d.num_rows == 5 and d.features["loss_masks"].feature.dtype == "int8"
    duckdb = pytest.importorskip("duckdb")
    assert duckdb.sql(f"SELECT count(*) FROM read_parquet('{result.out}')").fetchall() == [(5,)]
    assert pa.types.is_struct(pq.read_table(result.out).schema.field("trajectory_ids").type)


# --- TRL: the real SFTTrainer trains on the export ---------------------------------------------------------

TRL_SCRIPT = r"""
import json, sys
import datasets, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
import trl

export_dir, model_dir, work = sys.argv[1:4]
torch.manual_seed(0)
train = datasets.load_dataset(export_dir, split="train", cache_dir=work + "/cache")  # the directory as it is
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
before = {n: p.detach().clone() for n, p in model.named_parameters()}
seen = []

class Recording(SFTTrainer):
    # compute_loss receives the collated batch: the labels the loss is computed from
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        seen.append({k: inputs[k].tolist() for k in ("input_ids", "labels", "attention_mask")})
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

args = SFTConfig(output_dir=work + "/out", max_steps=2, per_device_train_batch_size=2, learning_rate=1e-4,
                 use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, seed=0, bf16=False,
                 dataloader_num_workers=0)
trainer = Recording(model=model, args=args, train_dataset=train, processing_class=tokenizer)
trainer.train()
changed = max((p.detach() - before[n]).abs().max().item() for n, p in model.named_parameters())
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
print("RESULT " + json.dumps({"trl": trl.__version__, "steps": trainer.state.global_step, "batches": seen,
                              "losses": losses, "max_weight_change": changed}))
"""


def _trl_python() -> Path:
    import hashlib

    site = [Path(p) for p in sys.path if Path(p).name == "site-packages"]
    key = f"trl-1.16-{hashlib.sha256(repr(site).encode()).hexdigest()[:12]}"
    return cached_venv(key, ["trl==1.16.*"], inherit=site) / "bin" / "python"


def test_trl_sft_trainer_trains_two_steps_on_the_export(run_dir, tmp_path):
    from rollout.models import model_dir

    python = _trl_python()
    out, rows = run_dir
    result = export(out, "trl", tmp_path / "trl")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="2")
    done = subprocess.run([str(python), "-c", TRL_SCRIPT, str(result.out), str(model_dir(smollm2_gguf())),
                           str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert report["trl"].startswith("1.16.") and report["steps"] == 2 and len(report["batches"]) == 2
    # the labels TRL computed, row by row, against the source shards' loss mask (not the export's columns)
    mask_of = {tuple(r["token_ids"]): r["loss_mask"] for r in _trainable(rows)}
    checked = 0
    for batch in report["batches"]:
        for ids, labels, attn in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            n = sum(attn)
            mask = mask_of[tuple(ids[:n])]
            assert [lab != -100 for lab in labels[:n]] == mask
            assert all(lab == t for lab, t, m in zip(labels, ids, mask) if m)
            assert all(lab == -100 for lab in labels[n:])
            checked += 1
    assert checked == 4
    assert len(report["losses"]) == 2 and all(np.isfinite(report["losses"])) and report["max_weight_change"] > 0
