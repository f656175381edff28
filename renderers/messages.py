"""OpenAI chat messages -> the plain dicts a chat template sees.

The contract (also what the parity tests hand to transformers' ``apply_chat_template``):

- ``role`` is one of system / user / assistant / tool; anything else is an error.
- ``content`` is a string, a list of text parts (joined with ``"\\n"``, as vLLM does for
  string-content templates) or ``None``. ``None`` is dropped from the dict, as transformers does,
  so a template sees the key as undefined.
- ``reasoning_content`` (``reasoning`` and ``thinking`` are accepted too) is kept only when it is a
  non-empty string.
- ``tool_calls`` entries become ``{"id"?, "type": "function", "function": {"name", "arguments"}}``;
  the flat ``{"name", "arguments"}`` form is accepted. ``arguments`` stays as given (a dict or a
  JSON string) because templates render the two differently.
- ``tool_call_id`` and ``name`` are kept when they are strings.

Every problem raises :class:`MessageError` (a ``ValueError``) naming the message index and field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
_KNOWN_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name", *_REASONING_KEYS}


class MessageError(ValueError):
    """A message or tool definition that tito cannot render; the text names the problem."""


def _is_mapping(value: Any) -> bool:
    # a plain dict first: isinstance against the Mapping ABC costs more than the rest of a message's checks
    return value.__class__ is dict or isinstance(value, Mapping)


def _text(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise MessageError(f"{where}[{j}]: only text parts are supported, got {kind!r}")
        return "\n".join(texts)
    raise MessageError(f"{where} must be a string, a list of text parts or null, got {type(value).__name__}")


def _tool_call(call: Any, index: int, j: int) -> dict:
    if not _is_mapping(call):
        raise MessageError(f"message {index}.tool_calls[{j}] must be an object, got {type(call).__name__}")
    function = call.get("function", call)
    if not _is_mapping(function):
        raise MessageError(f"message {index}.tool_calls[{j}].function must be an object, got {type(function).__name__}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise MessageError(f"message {index}.tool_calls[{j}] has no function name")
    arguments = function.get("arguments", {})
    if _is_mapping(arguments):
        arguments = dict(arguments)
    elif arguments is None:
        arguments = {}
    elif not isinstance(arguments, str):
        raise MessageError(
            f"message {index}.tool_calls[{j}].arguments must be an object or a JSON string, got {type(arguments).__name__}"
        )
    call_id = call.get("id")
    if isinstance(call_id, str):
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def normalize_message(message: Any, index: int = 0) -> dict:
    """One OpenAI chat message -> the dict a chat template sees (see the module docstring). The
    checks run on every message of every render: error texts are built only when one fails."""
    if message.__class__ is dict and len(message) == 2:  # most messages: a plain dict of role and text content
        content = message.get("content")
        if content.__class__ is str and message.get("role") in ROLES:
            return {"role": message["role"], "content": content}
    if not _is_mapping(message):
        raise MessageError(f"message {index} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise MessageError(f"message {index}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
    if not message.keys() <= _KNOWN_KEYS:
        raise MessageError(f"message {index}: unknown field(s) {sorted(set(message) - _KNOWN_KEYS)}")
    out: dict[str, Any] = {"role": role}
    content = message.get("content")
    if content.__class__ is not str:
        content = _text(content, f"message {index}.content")
    if content is not None:
        out["content"] = content
    elif role != "assistant":
        raise MessageError(f"message {index}: a {role} message needs content")
    if len(message) == 2 and content is not None:  # role and content only: most messages
        return out
    for key in _REASONING_KEYS:
        reasoning = message.get(key)
        if reasoning is None:
            continue
        if reasoning.__class__ is not str:
            reasoning = _text(reasoning, f"message {index}.{key}")
        if reasoning:
            if role != "assistant":
                raise MessageError(f"message {index}: only assistant messages carry reasoning, not {role}")
            out["reasoning_content"] = reasoning
        break
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise MessageError(f"message {index}: only assistant messages carry tool_calls, not {role}")
        if tool_calls.__class__ is not list and (not isinstance(tool_calls, Sequence) or isinstance(tool_calls, (str, bytes))):
            raise MessageError(f"message {index}.tool_calls must be a list")
        if tool_calls:
            out["tool_calls"] = [_tool_call(c, index, j) for j, c in enumerate(tool_calls)]
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise MessageError(f"message {index}.{key} must be a string, got {type(value).__name__}")
        out[key] = value
    return out


def normalize_messages(messages: Any) -> list[dict]:
    """A list of OpenAI chat messages -> template dicts; raises :class:`MessageError` on bad input."""
    if messages.__class__ is not list and (isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence)):
        raise MessageError(f"messages must be a list of message objects, got {type(messages).__name__}")
    return [normalize_message(m, i) for i, m in enumerate(messages)]


def normalize_tools(tools: Any) -> list[dict] | None:
    """Tool definitions (OpenAI function schemas) as a list of dicts, or None when there are none."""
    if tools is None:
        return None
    if tools.__class__ is not list and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
        raise MessageError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    for j, tool in enumerate(tools):
        if not _is_mapping(tool):
            raise MessageError(f"tools[{j}] must be an object, got {type(tool).__name__}")
        function = tool.get("function", tool)
        if not _is_mapping(function) or not isinstance(function.get("name"), str):
            raise MessageError(f"tools[{j}] has no function name")
    return [dict(t) for t in tools] or None


def tool_names(tools: list[dict] | None) -> set[str] | None:
    """The function names of normalized tool definitions (:func:`normalize_tools`); None without tools,
    which a parser reads as "any name is accepted"."""
    if not tools:
        return None
    return {t.get("function", t).get("name") for t in tools}
