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
from collections import Counter
from pathlib import Path
from typing import Any

import renderers
from renderers import Break, ParsedResponse

from .samples import SampleBuilder, Segment
from .shards import ShardWriter


class _Rollout:
    __slots__ = ("builder", "tools", "breaks", "weight_versions", "last_completion_len")

    def __init__(self, tools: list[dict] | None) -> None:
        self.builder = SampleBuilder()
        self.tools = tools
        self.breaks: list[dict] = []
        self.weight_versions: list[list[int]] = []  # per segment
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
        stream: str = "shard",
        fmt: str = "arrow",
        rows_per_file: int = 1024,
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
        self._lock = threading.Lock()
        self.writer = ShardWriter(out_dir, stream=stream, fmt=fmt, rows_per_file=rows_per_file) if out_dir else None
        self._breaks_path = Path(out_dir) / "breaks.jsonl" if out_dir else None

    def info(self) -> dict:
        r = self.renderer
        return {"renderer": r.name, "template_sha256": r.template_sha256, "stop_token_ids": list(r.stop_token_ids),
                "vocab_size": self.tokenizer.vocab_size}

    # ---- per rollout -----------------------------------------------------------------------------

    def begin(self, rollout_id: str, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The first prompt (raises ValueError naming the problem for a task that cannot be rendered)."""
        ro = _Rollout(tools)
        ro.builder.start_segment(self.renderer.render(messages, tools, add_generation_prompt=True), turn=0)
        ro.weight_versions.append([])
        self.rollouts[rollout_id] = ro
        return list(ro.builder.prompt_ids())

    def completed(
        self, rollout_id: str, turn: int, completion_ids: list[int], logprobs: list[float] | None,
        message_index: int, weight_version: int = 0,
    ) -> ParsedResponse:
        """Record the engine's completion (trainable) and parse it."""
        ro = self.rollouts[rollout_id]
        prompt = ro.builder.prompt_ids()
        parsed = self.renderer.parse_response(completion_ids, prompt, ro.tools)
        ro.builder.add_completion(completion_ids, logprobs, message_index, turn)
        ro.last_completion_len = len(completion_ids)
        ro.weight_versions[-1].append(weight_version)
        return parsed

    def extend(self, rollout_id: str, turn: int, new_messages: list[dict], messages: list[dict]) -> list[int]:
        """The next prompt: the bridge's append-only extension, or on a Break a full render of
        ``messages`` (the whole conversation so far) that starts a new segment."""
        ro = self.rollouts[rollout_id]
        ids = ro.builder.current.token_ids
        cut = len(ids) - ro.last_completion_len
        prompt, completion = ids[:cut], ids[cut:]
        result = self.renderer.bridge(prompt, completion, new_messages, ro.tools)
        offset = len(messages) - len(new_messages)
        if isinstance(result, Break):
            self._log_break(rollout_id, turn, result)
            ro.breaks.append({"turn": turn, "reason": str(result.reason), "detail": result.detail, "position": result.position})
            ro.builder.start_segment(self.renderer.render(messages, ro.tools, add_generation_prompt=True), turn=turn)
            ro.weight_versions.append([])
        else:
            ro.builder.add_bridge(result, offset, turn)
            with self._lock:
                self.turns_bridged += 1
        return list(ro.builder.prompt_ids())

    def finish(self, rollout_id: str, meta: dict[str, Any]) -> int:
        """Write the rollout's samples (one row per segment) with the driver's metadata
        (task/group ids, reward, components, advantage, finish reason, messages, error).
        Returns the number of rows."""
        ro = self.rollouts.pop(rollout_id, None)
        if ro is None:  # failed before its first render: one empty row keeps the rollout accounted for
            ro = _Rollout(None)
            ro.builder.segments.append(Segment())
            ro.weight_versions.append([])
        segments = [s for s in ro.builder.segments if s.completion_tokens > 0] or ro.builder.segments[-1:]
        rows = []
        for i, seg in enumerate(segments):
            versions = ro.weight_versions[ro.builder.segments.index(seg)]
            rows.append({
                "token_ids": seg.token_ids, "loss_mask": seg.loss_mask, "logprobs": seg.logprobs,
                "message_index": seg.message_index, "turn_index": seg.turn_index,
                "messages": json.dumps(meta.get("messages", []), ensure_ascii=False),
                "reward": float(meta.get("reward", 0.0)),
                "reward_components": json.dumps(meta.get("reward_components", {})),
                "advantage": float(meta.get("advantage", 0.0)),
                "task_id": meta["task_id"], "group_id": meta["group_id"], "rollout_id": rollout_id,
                "segment_index": i, "segment_count": len(segments),
                "finish_reason": meta.get("finish_reason", ""),
                "breaks": json.dumps(ro.breaks),
                "weight_version": min(versions) if versions else 0,
                "model": self.model_name, "renderer": self.renderer.name,
                "template_sha256": self.renderer.template_sha256 or "",
                "prompt_tokens": seg.prompt_tokens, "completion_tokens": seg.completion_tokens,
                "error": meta.get("error"),
            })
        if self.writer is not None:
            self.writer.add(rows)
        return len(rows)

    def discard(self, rollout_id: str) -> None:
        """Forget a rollout that will be re-run (its engine died): nothing of it is written."""
        self.rollouts.pop(rollout_id, None)

    def close(self) -> dict:
        files = self.writer.close() if self.writer is not None else []
        return {"files": files, "break_counts": dict(self.break_counts), "turns_bridged": self.turns_bridged}

    def _log_break(self, rollout_id: str, turn: int, brk: Break) -> None:
        with self._lock:
            self.break_counts[str(brk.reason)] += 1
        if self._breaks_path is None:
            return
        line = json.dumps({"rollout_id": rollout_id, "turn": turn, "reason": str(brk.reason), "detail": brk.detail,
                           "position": brk.position}, ensure_ascii=False) + "\n"
        # O_APPEND: whole-line appends from several renderer actors do not interleave
        fd = os.open(self._breaks_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

