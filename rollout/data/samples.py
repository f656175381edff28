"""Training samples of one rollout, built as the rollout runs.

A rollout is one token sequence per segment. The first segment starts with the initial render;
each turn appends the engine's completion (trainable, with the sampler's logprobs) and then the
bridge's appended tokens (context). A ``Break`` ends the segment; the next one starts with a full
re-render of the conversation so far, whose tokens are all context. So every trainable token is
one the engine sampled, in exactly the context it was sampled in.

Each token also records the weight version that sampled it (``weight_versions``, -1 on context): in
follow mode a weight update can stop a turn that then goes on under the new weights, so one completion
may hold tokens of two versions.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from tito_renderers import Bridged, RenderedTokens


class Segment(msgspec.Struct):
    token_ids: list[int] = msgspec.field(default_factory=list)
    loss_mask: list[bool] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)  # 0.0 where loss_mask is False
    message_index: list[int] = msgspec.field(default_factory=list)
    turn_index: list[int] = msgspec.field(default_factory=list)
    weight_versions: list[int] = msgspec.field(default_factory=list)  # per token; -1 where loss_mask is False
    prompt_tokens: int = 0  # context tokens (not sampled)
    completion_tokens: int = 0  # sampled tokens

    def _extend(self, ids, mask, logprobs, message_index, turn, versions) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend(mask)
        self.logprobs.extend(logprobs)
        self.message_index.extend(message_index)
        self.turn_index.extend([turn] * len(ids))
        self.weight_versions.extend(versions)

    def version_range(self) -> tuple[int, int]:
        """(lowest, highest) weight version of the sampled tokens; (0, 0) for a segment with none."""
        sampled = [v for v in self.weight_versions if v >= 0]
        return (min(sampled), max(sampled)) if sampled else (0, 0)


class SampleBuilder:
    """Accumulates the segments of one rollout; ``message_offset`` values index the rollout's messages."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    @property
    def current(self) -> Segment:
        return self.segments[-1]

    def start_segment(self, rendered: RenderedTokens, turn: int) -> None:
        """A full render opens a segment: all of it is context."""
        seg = Segment()
        n = len(rendered.token_ids)
        seg._extend(rendered.token_ids, [False] * n, [0.0] * n, rendered.message_indices, turn, [-1] * n)
        seg.prompt_tokens = n
        self.segments.append(seg)

    def add_completion(self, completion_ids: list[int], logprobs: list[float] | None, message_index: int, turn: int,
                       versions: Sequence[int] | int = 0) -> None:
        """The engine's sampled tokens: trainable, with their logprobs and the weight version that sampled
        each (one int: all of them)."""
        n = len(completion_ids)
        lps = list(logprobs) if logprobs is not None else [0.0] * n
        if len(lps) != n:
            raise ValueError(f"{len(lps)} logprobs for {n} completion tokens")
        vs = [versions] * n if isinstance(versions, int) else list(versions)
        if len(vs) != n:
            raise ValueError(f"{len(vs)} weight versions for {n} completion tokens")
        if vs and min(vs) < 0:
            raise ValueError(f"weight version {min(vs)} < 0 for a sampled token (-1 marks context tokens)")
        self.current._extend(completion_ids, [True] * n, lps, [message_index] * n, turn, vs)
        self.current.completion_tokens += n

    def add_bridge(self, bridged: Bridged, message_offset: int, turn: int) -> None:
        """Tokens the bridge appended after the completion (new messages, generation prompt)."""
        seg = self.current
        if len(seg.token_ids) != bridged.prefix_len:
            raise ValueError(f"bridge prefix of {bridged.prefix_len} tokens does not match the segment's {len(seg.token_ids)}")
        app = bridged.appended
        n = len(app.token_ids)
        index = [i + message_offset if i >= 0 else -1 for i in app.message_indices]
        seg._extend(app.token_ids, [False] * n, [0.0] * n, index, turn, [-1] * n)
        seg.prompt_tokens += n

    def prompt_ids(self) -> list[int]:
        return self.current.token_ids
