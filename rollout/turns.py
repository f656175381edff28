"""The data that crosses the renderer boundary: a sampled turn, the next prompt, a rollout's metadata.

The rollout loop and ``tito serve`` send these to a renderer service (in process or a Ray actor, see
``rollout/handles.py``) and get them back. They are frozen msgspec Structs: cheap to build, typed for a
reader and a checker, and they pickle across Ray unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class SampledTurn(msgspec.Struct, frozen=True):
    """One turn as the engine sampled it and the driver parsed it (the driver parses with the same
    renderer code and tokenizer, so recording a turn costs the renderer service no parse)."""

    index: int  # the turn's index in its rollout (0 for the first)
    completion_ids: list[int]
    logprobs: list[float] | None
    weight_version: int  # the version that sampled the turn (the lowest, when ``versions`` is given)
    assistant: dict[str, Any]  # the parsed assistant message
    # the version that sampled each completion token, where the turn spans several (a weight update
    # stopped it and it went on under the new weights: follow mode's abort_resume); None: all weight_version
    versions: list[int] | None = None


class SegmentBreak(msgspec.Struct, frozen=True):
    """Why a segment ended at ``turn``: a renderer BreakReason or a session-level reason. ``position`` is
    the first diverging token, where known. Logged in breaks.jsonl and in a shard row's ``breaks``."""

    turn: int
    reason: str
    detail: str
    position: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object the break log, the shard rows and the HTTP API write (field order kept)."""
        return {"turn": self.turn, "reason": self.reason, "detail": self.detail, "position": self.position}


class NextPrompt(msgspec.Struct, frozen=True):
    """The prompt for the next turn. ``append``: ``ids`` follow the previous prompt + completion (the
    turn was bridged). ``render``: ``ids`` are a whole prompt from a full render that starts a new
    segment: the first prompt (``brk`` None), or after ``brk``."""

    kind: Literal["append", "render"]
    ids: list[int]
    brk: SegmentBreak | None = None

    def after(self, prompt: list[int], completion: list[int]) -> list[int]:
        """The whole next prompt, given the previous prompt and its completion."""
        return [*prompt, *completion, *self.ids] if self.kind == "append" else self.ids


class Sampling(msgspec.Struct, frozen=True):
    """The sampling settings a shard row records (its ``temperature``/``top_p``/``top_k``/``seed``
    columns; None where not set, as for a ``tito serve`` session)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


class RolloutMeta(msgspec.Struct, frozen=True):
    """What the caller knows of a finished rollout that the renderer service does not: written into
    each of its shard rows beside the samples the service holds.

    The conversation a row records is ``messages`` when given, else the one the service holds followed by
    ``unsent_messages`` (environment messages after the last turn, which no bridge sent): the rollout loop
    sends its messages only for a rollout that failed, so a conversation crosses the wire once."""

    task_id: str
    group_id: str
    finish_reason: str = ""
    messages: list[dict[str, Any]] | None = None
    unsent_messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    reward: float = 0.0
    reward_components: dict[str, float] = msgspec.field(default_factory=dict)
    advantage: float = 0.0
    error: str | None = None
    sampling: Sampling = Sampling()
    lora: str | None = None  # the LoRA adapter its turns were sampled with (None: the base model)
    task: str | None = None  # JSON of the task record (Task.record()): one text per group, shared by its rows


class Finished(msgspec.Struct, frozen=True):
    """One rollout of a group for ``finish_group``: its id, metadata and the last turn if it was never
    bridged (the service records it with the samples)."""

    rollout_id: str
    meta: RolloutMeta
    last_turn: SampledTurn | None = None
