"""Result types of the renderer contract. msgspec Structs: cheap to build, typed, and serialisable."""

from __future__ import annotations

import enum
from functools import cached_property
from typing import Any

import msgspec


class RenderedTokens(msgspec.Struct):
    """Token ids with per-token attribution, all lists of the same length.

    ``message_indices[i]`` is the index of the message whose turn token i belongs to (its header,
    text and end marker), or -1 for what the template adds outside any message (BOS, a default
    system prompt, tool definitions, the generation prompt). ``sampled_mask[i]`` is True when the
    model would have sampled token i (an assistant turn after its header, end marker included).
    ``is_content[i]`` is True when token i carries text from a message (content, reasoning, tool
    call names and arguments, tool results) rather than template scaffolding.
    """

    token_ids: list[int]
    message_indices: list[int]
    sampled_mask: list[bool]
    is_content: list[bool]

    def __len__(self) -> int:
        return len(self.token_ids)


class ToolCallStatus(enum.StrEnum):
    OK = "ok"
    INVALID_JSON = "invalid_json"  # the call body is not JSON
    NOT_AN_OBJECT = "not_an_object"  # JSON, but not {"name": ..., "arguments": ...}
    MISSING_NAME = "missing_name"
    INVALID_ARGUMENTS = "invalid_arguments"  # arguments present but not an object
    UNKNOWN_TOOL = "unknown_tool"  # a name that is not among the given tools
    UNCLOSED = "unclosed"  # the completion ended before the call's close marker


class ToolCall(msgspec.Struct):
    """One tool call found in a completion. ``token_span`` is [start, end) in completion ids and
    covers the call's markers; ``raw`` is the decoded text between the markers. ``id``: the call id the
    model wrote, where its dialect has one (Mistral's ``"id"`` field or ``[CALL_ID]``); a re-render of the
    turn must carry it (Mistral's templates reject a call without its 9-character id)."""

    name: str | None
    arguments: dict[str, Any] | None
    status: ToolCallStatus
    token_span: tuple[int, int]
    raw: str
    error: str | None = None
    id: str | None = None

    def to_openai(self, call_id: str, arguments: str = "json") -> dict:
        """The OpenAI ``tool_calls`` entry; ``arguments="object"`` keeps the arguments a dict."""
        import json

        args = self.arguments or {}
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name or "", "arguments": args if arguments == "object" else json.dumps(args, ensure_ascii=False)},
        }


class ParsedResponse(msgspec.Struct):
    """A completion split into its parts by scanning token ids.

    ``reasoning_complete`` is False when reasoning was opened and never closed, None when the
    completion has no reasoning at all. ``stop_token_id`` is the stop id the completion ended with,
    or None when it ended without one (truncated).
    """

    content: str
    reasoning_content: str | None
    tool_calls: list[ToolCall]
    reasoning_complete: bool | None
    stop_token_id: int | None

    def to_message(self, arguments: str = "json") -> dict:
        """The assistant message an environment sees (OpenAI shape). Calls whose status is not ok are
        left out here; they stay in ``tool_calls`` with their status for the environment to report.

        ``arguments``: ``"json"`` (the OpenAI wire form, a JSON string) or ``"object"`` (a dict). A
        conversation that will be re-rendered should carry them the way its template expects
        (``Renderer.history_arguments``): most templates ``tojson`` a dict and would double-encode a string."""
        if arguments not in ("json", "object"):
            raise ValueError(f"arguments must be 'json' or 'object', got {arguments!r}")
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        calls = [c for c in self.tool_calls if c.status is ToolCallStatus.OK]
        if calls:
            message["tool_calls"] = [c.to_openai(c.id or f"call_{i}", arguments) for i, c in enumerate(calls)]
        return message


class BreakReason(enum.StrEnum):
    """Why a turn could not be bridged append-only. Every value is documented in docs/renderers.md."""

    ASSISTANT_IN_NEW_MESSAGES = "assistant_in_new_messages"
    STOP_INSIDE_REASONING = "stop_inside_reasoning"
    TRUNCATED_INSIDE_REASONING = "truncated_inside_reasoning"
    TEMPLATE_REWRITES_HISTORY = "template_rewrites_history"
    NO_SPECIAL_TOKEN_ANCHOR = "no_special_token_anchor"
    SYSTEM_MESSAGE_MOVES = "system_message_moves"
    TEMPLATE_NOT_APPEND_ONLY = "template_not_append_only"
    EDGE_WHITESPACE_STRIPPED = "edge_whitespace_stripped"  # the template strips whitespace the model sampled
    INVALID_MESSAGES = "invalid_messages"
    TEMPLATE_ERROR = "template_error"
    EMPTY_PREVIOUS_PROMPT = "empty_previous_prompt"


class Break(msgspec.Struct):
    """The turn cannot extend the previous tokens; the caller re-renders and starts a new segment."""

    reason: BreakReason
    detail: str
    position: int | None = None  # first diverging token position, where known


class Bridged(msgspec.Struct, dict=True):
    """The next prompt: ``token_ids[:prefix_len] == prev_prompt_ids + prev_completion_ids`` exactly.

    ``appended`` attributes the tokens after the prefix; its message indices count into the new
    messages. ``synthesized`` is how many of the appended tokens close a turn the engine did not
    close itself (a truncated completion); they are context, never trainable.

    A bridge costs the same at any history length: it keeps the previous prompt it was given by
    reference (``prev_prompt_ids``, of which the first ``prefix_len - len(prev_completion_ids)``
    tokens are the prompt), and ``token_ids``, the whole next prompt, is built on first read. A caller
    that only appends ``appended.token_ids`` to its own copy (the rollout loop) never pays for it; one
    that changes its prompt list in place before reading ``token_ids`` reads the change (appending to
    it is safe). Not a field: encoding a ``Bridged`` gives the fields.
    """

    prefix_len: int
    appended: RenderedTokens
    synthesized: int = 0
    prev_prompt_ids: list[int] = []
    prev_completion_ids: list[int] = []

    @cached_property
    def token_ids(self) -> list[int]:
        ids = self.prev_prompt_ids[: self.prefix_len - len(self.prev_completion_ids)]
        if ids.__class__ is not list:  # a tuple or an array given as the prompt
            ids = list(ids)
        ids += self.prev_completion_ids
        ids += self.appended.token_ids
        return ids


class Capabilities(msgspec.Struct, frozen=True):
    """What a renderer can do with its template.

    ``thinking_switch``: ``enable_thinking`` changes the render. ``reasoning_efforts``: the levels of
    ``reasoning_effort`` the template distinguishes, in :data:`renderers.base.EFFORT_LEVELS` order
    (empty when it has none). ``tools``: tool definitions and tool calls are rendered. ``bridge``:
    ``bridge`` can extend a turn append-only (else it always returns a ``Break``).
    """

    thinking_switch: bool
    reasoning_efforts: tuple[str, ...]
    tools: bool
    bridge: bool


class TrainingSample(msgspec.Struct):
    token_ids: list[int]
    loss_mask: list[bool]
    message_indices: list[int]
