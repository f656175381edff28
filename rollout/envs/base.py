"""The environment protocol: what the multi-turn rollout loop knows about a task's world.

One rollout talks to an environment like this::

    state = env.reset(task)                       # per-rollout state; the env itself holds none
    messages = list(task.messages)
    while True:
        parsed = ...                              # engine completion -> renderer.parse_response
        messages.append(parsed.to_message())
        result = await env.step(state, parsed)    # tool results / user feedback, and whether it is over
        messages.extend(result.new_messages)
        if result.done:
            break
    score = env.score(state, messages)            # reward and its named components

Contracts every environment keeps:

- **Concurrency.** An :class:`Environment` instance is shared by many concurrent rollouts (asyncio tasks in
  one process). Everything that changes during a rollout lives in the :class:`RolloutState` that
  :meth:`Environment.reset` returns; ``step`` and ``score`` only read the env's configuration.
- **Tool calls never vanish.** Every entry of ``parsed.tool_calls`` gets exactly one tool message back, in
  order. A call whose status is not ``ok`` (invalid JSON, unclosed, missing name, ...) gets an error tool
  message naming the status and the parser's error, so the model sees why nothing happened (verifiers
  PR #1463: silently dropped malformed calls ended rollouts as "no tool called").
- **Model output never crashes env code.** Arguments that are not a dict, a missing or mistyped argument,
  an unknown tool name: all become error tool messages (verifiers #562: double-encoded JSON arguments
  reached tool code as a ``str``). Only infrastructure failures (e.g. a sandbox that cannot isolate the
  network) raise, because carrying on would produce wrong training data.
- **Tool call ids match the assistant message.** :meth:`ParsedResponse.to_message` numbers the ``ok`` calls
  ``call_0, call_1, ...`` (skipping the others); tool messages use the same ids (:func:`call_ids`). A call
  that is not ``ok`` is absent from the assistant message, so its error message has no ``tool_call_id``.
- ``step`` on a finished state raises :class:`EnvError` (a rollout-loop bug, not model behaviour).
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar

import msgspec
import pydantic

from tito_renderers.types import ParsedResponse, ToolCall, ToolCallStatus

Message = dict[str, Any]
# the raw text of a failed call is echoed back to the model, shortened: it is for orientation, not storage
_RAW_ECHO_CHARS = 300


class EnvError(ValueError):
    """A misuse of an environment (bad options, a task it cannot run, stepping a finished rollout)."""


class ToolError(Exception):
    """Raised by a tool handler for a problem caused by the model's call (bad arguments, an expression it
    refuses). The message becomes the tool result; the rollout goes on."""


class Task(msgspec.Struct, kw_only=True):
    """One prompt to roll out.

    ``messages`` are OpenAI chat messages (the conversation before the first assistant turn);
    ``answer`` is the reference answer for verifiable tasks (a string, compared numerically by the
    built-in scorers), None when there is none; ``metadata`` carries anything else (source file, extra
    columns, generator parameters) and is passed through to the shards untouched.
    """

    task_id: str
    messages: list[dict[str, Any]]
    answer: str | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)

    def record(self) -> str:
        """The task as JSON, for the shards' ``task`` column: what a reward is recomputed from. A metadata value
        JSON cannot hold (a numpy scalar or array: its value; a date: its ``str``) is converted, sets are sorted
        (the same record in every process)."""
        return msgspec.json.encode(self, enc_hook=_as_text, order="deterministic").decode()


def _as_text(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        return tolist()
    return str(value)


class StepResult(msgspec.Struct, kw_only=True):
    """What one environment step produced: messages to append after the assistant message (tool results,
    user feedback; never an assistant message), whether the rollout is over, and free-form info for logs."""

    new_messages: list[dict[str, Any]]
    done: bool
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class Score(msgspec.Struct, kw_only=True):
    """The rollout's reward and the named components it was computed from (all floats, for the shards)."""

    reward: float
    components: dict[str, float] = msgspec.field(default_factory=dict)


@dataclasses.dataclass
class RolloutState:
    """Per-rollout state returned by :meth:`Environment.reset`. Environments subclass it or use ``data``.

    ``turns`` counts the assistant turns stepped so far, ``tool_turns`` those that called at least one tool,
    ``done`` is set when a step returned ``done=True``. An environment that builds the conversation itself (an
    adapter whose harness writes the prompt) sets ``prompt`` in ``reset``: the loop renders it instead of
    ``task.messages``; ``tools`` likewise replaces :attr:`Environment.tools` for this rollout.
    """

    task: Task
    turns: int = 0
    tool_turns: int = 0
    done: bool = False
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    prompt: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class EnvOptions(pydantic.BaseModel):
    """Base of every environment's options: unknown options are errors, values are validated and frozen."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


ToolHandler = Callable[[RolloutState, dict[str, Any]], Awaitable[str]]


class Environment(abc.ABC):
    """Base class of environments. Subclasses set ``name`` and ``Options`` and implement :meth:`step`,
    :meth:`score` and :meth:`generate_tasks`; tool-using ones call :meth:`register_tool` in ``__init__`` and
    :meth:`run_tool_calls` in ``step``.

    Construct with an options model or keyword options (validated by ``Options``); :func:`make_env` does
    the same by name.
    """

    name: ClassVar[str]
    Options: ClassVar[type[EnvOptions]] = EnvOptions

    def __init__(self, options: EnvOptions | None = None, **kwargs: Any) -> None:
        if options is not None and kwargs:
            raise EnvError(f"environment {self.name!r}: pass an options object or keyword options, not both")
        self.options = options if options is not None else validate_options(self.name, self.Options, kwargs)
        self._tool_handlers: dict[str, ToolHandler] = {}
        self._tool_schemas: list[dict[str, Any]] = []

    # -- protocol ---------------------------------------------------------------------------------

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """OpenAI function schemas of the tools this environment offers (passed to the renderer), or None."""
        return copy.deepcopy(self._tool_schemas) or None  # a copy: callers may not alter the env's schemas

    def reset(self, task: Task) -> RolloutState:
        """A fresh state for one rollout of ``task``. Raises :class:`EnvError` when the task cannot be run
        by this environment (e.g. a verifiable env given a task without an answer)."""
        return RolloutState(task=task)

    @abc.abstractmethod
    async def step(self, state: RolloutState, parsed: ParsedResponse) -> StepResult:
        """React to one parsed assistant turn. Never raises on anything the model wrote."""

    @abc.abstractmethod
    def score(self, state: RolloutState, trajectory: Sequence[Message]) -> Score:
        """The reward of a finished rollout. ``trajectory`` is task messages + assistant messages (as
        :meth:`ParsedResponse.to_message` built them) + environment messages, in order."""

    @abc.abstractmethod
    def generate_tasks(self, n: int, seed: int) -> list[Task]:
        """``n`` built-in tasks, the same for the same ``(n, seed)`` and options on every machine."""

    # -- helpers for subclasses -----------------------------------------------------------------------

    def _begin_step(self, state: RolloutState, parsed: ParsedResponse) -> None:
        if state.done:
            raise EnvError(f"environment {self.name!r}: step() on a finished rollout of task {state.task.task_id!r}")
        state.turns += 1
        if parsed.tool_calls:
            state.tool_turns += 1

    def register_tool(self, schema: dict[str, Any], handler: ToolHandler) -> None:
        """Offer a tool: ``schema`` is an OpenAI function schema, ``handler(state, arguments)`` returns the
        result text or raises :class:`ToolError` with a message for the model."""
        name = schema["function"]["name"]
        self._tool_schemas.append(schema)
        self._tool_handlers[name] = handler

    async def run_tool_calls(self, state: RolloutState, parsed: ParsedResponse) -> list[Message]:
        """One tool message per entry of ``parsed.tool_calls``, in order (see the module contracts)."""
        messages: list[Message] = []
        for call, call_id in zip(parsed.tool_calls, call_ids(parsed)):
            if call_id is None:
                messages.append(tool_error_message(call, sorted(self._tool_handlers)))
                continue
            name = call.name if isinstance(call.name, str) else None  # a non-str name must not crash the lookup
            if name is None or name not in self._tool_handlers:
                known = ", ".join(sorted(self._tool_handlers)) or "none"
                messages.append(tool_message(call_id, name, f"Error: unknown tool {name!r} (available: {known})."))
                continue
            arguments = call.arguments
            if not isinstance(arguments, dict):
                text = f"Error: the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}."
                messages.append(tool_message(call_id, name, text))
                continue
            try:
                result = await self._tool_handlers[name](state, arguments)
            except ToolError as e:
                result = f"Error: {e}"
            messages.append(tool_message(call_id, name, result))
        return messages


def call_ids(parsed: ParsedResponse) -> list[str | None]:
    """The ``tool_call_id`` of each entry of ``parsed.tool_calls`` as :meth:`ParsedResponse.to_message`
    assigns them: ``call_<k>`` for the k-th ``ok`` call, None for a call that is not ``ok`` (absent there)."""
    ids: list[str | None] = []
    k = 0
    for call in parsed.tool_calls:
        if call.status is ToolCallStatus.OK:
            ids.append(f"call_{k}")
            k += 1
        else:
            ids.append(None)
    return ids


def tool_message(call_id: str | None, name: str | None, content: str) -> Message:
    """A tool message in OpenAI shape (``tool_call_id`` and ``name`` only when known)."""
    message: Message = {"role": "tool", "content": content}
    if call_id is not None:
        message["tool_call_id"] = call_id
    if isinstance(name, str) and name:
        message["name"] = name
    return message


def tool_error_message(call: ToolCall, available: Sequence[str] = ()) -> Message:
    """The error tool message for a call whose status is not ``ok``: it names the status, the parser's
    error and (shortened) the text the model wrote, and says how to fix the call (``available``: the tool
    names, listed for an unknown tool)."""
    status = call.status.value if isinstance(call.status, ToolCallStatus) else str(call.status)
    raw = call.raw.strip() if isinstance(call.raw, str) else ""
    if len(raw) > _RAW_ECHO_CHARS:
        raw = raw[:_RAW_ECHO_CHARS] + "..."
    detail = f": {call.error}" if call.error else ""
    if status == ToolCallStatus.UNKNOWN_TOOL:
        hint = f"Available tools: {', '.join(available) or 'none'}."
    elif status == ToolCallStatus.UNCLOSED:
        hint = "The call was not closed; write the complete call."
    else:
        hint = 'Write the call as a JSON object with a string "name" and an object "arguments".'
    content = f"Error: the tool call could not be executed (status {status}{detail}). Call text: {raw!r}. {hint}"
    name = call.name if isinstance(call.name, str) else None
    return tool_message(None, name, content)


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function tool schema."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def string_argument(arguments: dict[str, Any], key: str, *, max_chars: int) -> str:
    """``arguments[key]`` as a string, or :class:`ToolError` naming what is wrong with it."""
    if key not in arguments:
        given = ", ".join(sorted(map(str, arguments))) or "none"
        raise ToolError(f"missing required argument {key!r} (given: {given})")
    value = arguments[key]
    if not isinstance(value, str):
        raise ToolError(f"argument {key!r} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise ToolError(f"argument {key!r} is {len(value)} characters long; the limit is {max_chars}")
    return value


def validate_options(env_name: str, model: type[EnvOptions], options: dict[str, Any]) -> EnvOptions:
    """``options`` validated by ``model``; :class:`EnvError` names the environment and each bad option."""
    unknown = sorted(set(options) - set(model.model_fields))
    if unknown:
        known = ", ".join(sorted(model.model_fields)) or "none"
        raise EnvError(
            f"environment {env_name!r}: unknown option(s) {', '.join(map(repr, unknown))} (options: {known})"
        )
    try:
        return model(**options)
    except pydantic.ValidationError as e:
        problems = "; ".join(
            f"option {'.'.join(map(str, err['loc']))!r}: {err['msg']} (got {err.get('input')!r})" for err in e.errors()
        )
        raise EnvError(f"environment {env_name!r}: {problems}") from None


def last_assistant(trajectory: Sequence[Message]) -> Message | None:
    """The last assistant message of a trajectory, or None."""
    for message in reversed(trajectory):
        if isinstance(message, dict) and message.get("role") == "assistant":
            return message
    return None


def assistant_messages(trajectory: Sequence[Message]) -> list[Message]:
    return [m for m in trajectory if isinstance(m, dict) and m.get("role") == "assistant"]
