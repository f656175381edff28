"""The renderer side of a rollout: initial render, parse, bridge-or-break, samples, shards, break log.

A plain class (``actors/renderer.py`` puts it on Ray). It keeps each running rollout's segments;
the driver sends completions and environment messages and gets back the next prompt ids. Engines
never see text, and nothing here ever re-renders tokens the model sampled: a ``Break`` ends the
segment and starts a new one from a full render, and is logged with its reason.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tito_renderers as renderers
from tito_renderers import Break

from .data.samples import SampleBuilder, Segment
from .data.shards import BREAKS, DATA_DIR, STREAM, ShardWriteError, ShardWriter
from .turns import Finished, NextPrompt, RolloutMeta, SampledTurn, SegmentBreak


class _Before(Sequence):
    """A rollout's messages without the last (the assistant turn just recorded): the conversation behind
    its current prompt, read in place."""

    __slots__ = ("_messages",)

    def __init__(self, messages: list[dict]) -> None:
        self._messages = messages

    def __len__(self) -> int:
        return len(self._messages) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._messages[: len(self)][i]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._messages[i if i >= 0 else i - 1]


class _Rollout:
    __slots__ = ("builder", "tools", "messages", "breaks", "last_completion_len")

    def __init__(self, tools: list[dict] | None, messages: list[dict] | None = None) -> None:
        self.builder = SampleBuilder()
        self.tools = tools
        self.messages = list(messages or [])  # the conversation so far, for a full render after a Break
        self.breaks: list[SegmentBreak] = []
        self.last_completion_len = 0


class RendererService:
    def __init__(
        self,
        model_path: str,
        *,
        renderer_name: str | None = None,
        template_kwargs: dict | None = None,
        thinking_retention: str = "keep",
        out_dir: str | None = None,
        stream: str = STREAM,
        fmt: str = "arrow",
        rows_per_file: int = 1024,
        flush_interval_s: float | None = None,
        model_name: str | None = None,
    ) -> None:
        self.tokenizer = renderers.load_tokenizer(model_path)
        self.renderer = renderers.create_renderer(
            self.tokenizer, name=renderer_name, thinking_retention=thinking_retention, **(template_kwargs or {})
        )
        self.model_name = model_name or str(model_path)
        self.rollouts: dict[str, _Rollout] = {}
        self.break_counts: Counter[str] = Counter()
        self.turns_bridged = 0
        self._cpu_start = time.process_time()  # this process's CPU time, for the capacity figure in close()
        self._lock = threading.Lock()
        self._writer_settings = {"stream": stream, "fmt": fmt, "rows_per_file": rows_per_file,
                                 "flush_interval_s": flush_interval_s}
        # shards go to OUT/data/, the break log beside it (see rollout/data/shards.py for the layout)
        self.writer = ShardWriter(Path(out_dir) / DATA_DIR, **self._writer_settings) if out_dir else None
        self._breaks_path = Path(out_dir) / BREAKS if out_dir else None
        # per-batch outputs (follow mode: batch k's rows go to RUN_DIR/rollouts/step_k/): one writer per
        # directory, opened by the first finish_group for it and closed by close_output
        self._outputs: dict[str, ShardWriter] = {}

    def info(self) -> dict:
        r = self.renderer
        return {"renderer": r.name, "template_sha256": r.template_sha256, "stop_token_ids": list(r.stop_token_ids),
                "vocab_size": self.tokenizer.vocab_size}

    # ---- per rollout -----------------------------------------------------------------------------

    def begin(self, rollout_id: str, messages: list[dict], tools: list[dict] | None) -> NextPrompt:
        """The first prompt, a ``render`` (raises ValueError naming the problem for a task that cannot be
        rendered)."""
        ro = _Rollout(tools, messages)
        ro.builder.start_segment(self.renderer.render(messages, tools, add_generation_prompt=True), turn=0)
        self.rollouts[rollout_id] = ro
        return NextPrompt("render", list(ro.builder.prompt_ids()))

    @staticmethod
    def _record(ro: _Rollout, turn: SampledTurn) -> None:
        # per token: the versions the turn carries (a turn a weight update stopped and resumed), else its one
        versions = turn.versions if turn.versions is not None else turn.weight_version
        ro.builder.add_completion(turn.completion_ids, turn.logprobs, len(ro.messages), turn.index, versions)
        ro.messages.append(turn.assistant)
        ro.last_completion_len = len(turn.completion_ids)

    def extend(self, rollout_id: str, turn: SampledTurn, new_messages: list[dict]) -> NextPrompt:
        """Record a turn's completion (trainable tokens, its parsed assistant message) and return the
        next prompt after ``new_messages``: an ``append`` (the ids that follow the previous prompt +
        completion: the bridge) or, on a Break, a ``render`` of the conversation so far, which starts a
        new segment. Only new tokens cross the wire."""
        self.record_turn(rollout_id, turn)
        return self.bridge_next(rollout_id, new_messages, turn.index + 1)

    def record_turn(self, rollout_id: str, turn: SampledTurn) -> None:
        """Record a turn's completion now (``extend`` does it together with the bridge; the session API
        records right after sampling so a session's samples are complete between calls)."""
        self._record(self.rollouts[rollout_id], turn)

    def bridge_next(self, rollout_id: str, new_messages: list[dict], next_turn: int) -> NextPrompt:
        """The next prompt after the recorded completion and ``new_messages``, as ``extend`` returns it
        (with its break when the turn could not be bridged)."""
        ro = self.rollouts[rollout_id]
        ids = ro.builder.current.token_ids
        cut = len(ids) - ro.last_completion_len
        # the conversation behind the prompt: ro.messages up to the completion just recorded (a view, not
        # a copy; the generic renderer reads it only where it renders the whole conversation)
        result = self.renderer.bridge(ids[:cut], ids[cut:], new_messages, ro.tools, history=_Before(ro.messages))
        offset = len(ro.messages)
        ro.messages.extend(new_messages)
        if isinstance(result, Break):
            brk = SegmentBreak(next_turn, str(result.reason), result.detail, result.position)
            self._log_break(rollout_id, brk)
            ro.breaks.append(brk)
            ro.builder.start_segment(self.renderer.render(ro.messages, ro.tools, add_generation_prompt=True), turn=next_turn)
            return NextPrompt("render", list(ro.builder.prompt_ids()), brk)
        ro.builder.add_bridge(result, offset, next_turn)
        with self._lock:
            self.turns_bridged += 1
        return NextPrompt("append", result.appended.token_ids)

    def restart(self, rollout_id: str, messages: list[dict], tools: list[dict] | None, turn: int, reason: str,
                detail: str) -> NextPrompt:
        """Start a new segment from a full render of ``messages`` and log a break with ``reason``: for a
        conversation that no longer extends the recorded one (a client edited its history, changed its
        tools, or retried after a failed turn). Nothing is bridged, so no sampled token is rewritten."""
        ro = self.rollouts[rollout_id]
        rendered = self.renderer.render(messages, tools, add_generation_prompt=True)  # may raise: nothing changed
        brk = SegmentBreak(turn, str(reason), detail)  # a session-level reason: no token position
        self._log_break(rollout_id, brk)
        ro.breaks.append(brk)
        ro.messages, ro.tools = list(messages), tools
        ro.builder.start_segment(rendered, turn=turn)
        return NextPrompt("render", list(ro.builder.prompt_ids()), brk)

    def sample(self, rollout_id: str) -> dict[str, Any]:
        """A running rollout's training samples so far (one per segment), its breaks and messages;
        KeyError for an unknown id.

        Each segment has the shard row's per-token lists, ``token_weight_versions`` (the shard column
        ``weight_versions``: the version that sampled each token, -1 on context), ``weight_version`` and
        ``weight_version_max`` (lowest and highest sampled version, 0 with no sampled token), and, as
        before, ``weight_versions``: one entry per turn that sampled tokens, that turn's lowest version."""
        ro = self.rollouts[rollout_id]
        segments = []
        for seg in ro.builder.segments:
            low, high = seg.version_range()
            segments.append({"token_ids": seg.token_ids, "loss_mask": seg.loss_mask, "logprobs": seg.logprobs,
                             "message_index": seg.message_index, "turn_index": seg.turn_index,
                             "prompt_tokens": seg.prompt_tokens, "completion_tokens": seg.completion_tokens,
                             "weight_versions": _per_turn(seg), "token_weight_versions": seg.weight_versions,
                             "weight_version": low, "weight_version_max": high})
        return {"segments": segments, "breaks": [b.to_dict() for b in ro.breaks], "messages": list(ro.messages),
                "tools": ro.tools, "renderer": self.renderer.name,
                "template_sha256": self.renderer.template_sha256 or "", "model": self.model_name}

    def finish(self, rollout_id: str, meta: RolloutMeta, last_turn: SampledTurn | None = None) -> int:
        """Record the last turn's completion (if it was not bridged) and queue the rollout's samples
        (one row per segment) with the caller's metadata for the shard writer, as one unit. Returns the number of rows. ``tito serve`` calls :meth:`flush`
        after it to put a closed session on disk at once. Once a write has failed, raises
        :class:`~rollout.data.shards.ShardWriteError` (the caller stops: nothing more can reach disk)."""
        rows = self._rows(rollout_id, meta, last_turn)
        if self.writer is not None:
            self.writer.add(rows)
        return len(rows)

    def finish_group(self, items: list[Finished], out_dir: str | None = None) -> int:
        """``finish`` for every rollout of a group, queued as one unit: a group's rows always land in the
        same file. Returns the number of rows.

        ``out_dir`` (follow mode's batch directory, ``RUN_DIR/rollouts/step_k``): the rows go to that
        directory's own writer (``<out_dir>/data/``, this service's stream, format, ``rows_per_file`` and
        ``flush_interval_s``), opened on first use; :meth:`close_output` ends it. None: the service's
        output directory, as before."""
        rows = [row for f in items for row in self._rows(f.rollout_id, f.meta, f.last_turn)]
        writer = self.writer if out_dir is None else self._output(out_dir)
        if writer is not None:
            writer.add(rows)
        return len(rows)

    def _output(self, out_dir: str) -> ShardWriter:
        key = os.path.normpath(out_dir)
        with self._lock:
            writer = self._outputs.get(key)
            if writer is None:
                writer = self._outputs[key] = ShardWriter(Path(key) / DATA_DIR, **self._writer_settings)
            return writer

    def close_output(self, out_dir: str) -> dict:
        """Write what is pending for ``out_dir`` (see :meth:`finish_group`) and close its writer: returns
        ``{"files": [...], "write_error": str | None}`` as :meth:`close` does (file entries as
        :class:`~rollout.data.shards.ShardWriter` returns them, names relative to ``<out_dir>/data/``;
        ``files`` [] when no row went there). A later ``finish_group`` for it opens a new writer, whose
        files continue the numbering."""
        with self._lock:
            writer = self._outputs.pop(os.path.normpath(out_dir), None)
        return _close_writer(writer)

    def flush(self) -> list[dict]:
        """Write every finished rollout still pending to a shard file now (atomically); returns the new
        file entries ({file, rows, tokens}); [] when nothing is pending or there is no output dir."""
        return self.writer.flush() if self.writer is not None else []

    def _rows(self, rollout_id: str, meta: RolloutMeta, last_turn: SampledTurn | None) -> list[dict[str, Any]]:
        ro = self.rollouts.pop(rollout_id, None)
        if ro is not None and last_turn is not None:
            self._record(ro, last_turn)
        if ro is None:  # failed before its first render: one empty row keeps the rollout accounted for
            ro = _Rollout(None)
            ro.builder.segments.append(Segment())
        segments = [s for s in ro.builder.segments if s.completion_tokens > 0] or ro.builder.segments[-1:]
        s = meta.sampling
        messages = meta.messages if meta.messages is not None else [*ro.messages, *meta.unsent_messages]
        # what every row of the rollout repeats, serialized once (the messages are most of a row's text)
        shared = {
            "messages": json.dumps(messages, ensure_ascii=False), "reward": float(meta.reward),
            "reward_components": json.dumps(meta.reward_components), "advantage": float(meta.advantage),
            "task_id": meta.task_id, "group_id": meta.group_id, "rollout_id": rollout_id,
            "finish_reason": meta.finish_reason, "breaks": json.dumps([b.to_dict() for b in ro.breaks]),
            "model": self.model_name, "lora": meta.lora, "renderer": self.renderer.name,
            "template_sha256": self.renderer.template_sha256 or "", "error": meta.error,
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed, "task": meta.task,
        }
        rows = []
        for i, seg in enumerate(segments):
            low, high = seg.version_range()  # (0, 0) for a segment without a sampled token
            rows.append({
                "token_ids": seg.token_ids, "loss_mask": seg.loss_mask, "logprobs": seg.logprobs,
                "message_index": seg.message_index, "turn_index": seg.turn_index,
                "weight_versions": seg.weight_versions, "segment_index": i, "segment_count": len(segments),
                "weight_version": low, "weight_version_max": high,
                "prompt_tokens": seg.prompt_tokens, "completion_tokens": seg.completion_tokens, **shared,
            })
        return rows

    def discard(self, rollout_id: str) -> None:
        """Forget a rollout that will be re-run (its engine died): nothing of it is written."""
        self.rollouts.pop(rollout_id, None)

    def close(self) -> dict:
        """Write what is pending and report: the files written, ``write_error`` (the first failed write,
        naming the file and the cause; None if every write succeeded), break counts, CPU time. Per-batch
        writers still open (:meth:`finish_group` with ``out_dir``) are closed too; each is reported under
        ``outputs`` ({out_dir: {"files", "write_error"}}), not in ``files``/``write_error``, which stay the
        service's own output directory's."""
        own = _close_writer(self.writer)
        with self._lock:
            batches, self._outputs = self._outputs, {}
        outputs = {d: _close_writer(w) for d, w in batches.items()}
        return {**own, "outputs": outputs, "break_counts": dict(self.break_counts),
                "turns_bridged": self.turns_bridged, "cpu_s": time.process_time() - self._cpu_start}

    def _log_break(self, rollout_id: str, brk: SegmentBreak) -> None:
        """Count a break by reason and append it to breaks.jsonl."""
        with self._lock:
            self.break_counts[brk.reason] += 1
        if self._breaks_path is None:
            return
        line = json.dumps({"rollout_id": rollout_id, **brk.to_dict()}, ensure_ascii=False) + "\n"
        # O_APPEND: whole-line appends from several renderer actors do not interleave
        fd = os.open(self._breaks_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _close_writer(writer: ShardWriter | None) -> dict:
    """Close a writer: ``{"files": its entries, "write_error": the first failed write or None}``."""
    if writer is None:
        return {"files": [], "write_error": None}
    try:
        return {"files": writer.close(), "write_error": None}
    except ShardWriteError as exc:
        return {"files": writer.files, "write_error": str(exc)}


def _per_turn(seg: Segment) -> list[int]:
    """The lowest version of each turn that sampled tokens in ``seg``, in turn order (``sample()``'s
    ``weight_versions``)."""
    low: dict[int, int] = {}
    for turn, v, m in zip(seg.turn_index, seg.weight_versions, seg.loss_mask):
        if m:
            low[turn] = min(v, low.get(turn, v))
    return [low[t] for t in sorted(low)]
