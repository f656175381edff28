"""What a chat template does, learnt at load time by rendering small sentinel conversations.

No knowledge of any family is written here: every fact comes from rendering the template with
contents that cannot be confused with template text (private-use characters) and looking at where
they land. The result is cached per (template sha256, vocabulary, template kwargs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .base import EFFORT_LEVELS, TemplateRejected
from .template_env import HELPERS, RESERVED, ChatTemplate

# Sentinel texts: supplementary private-use characters, which no template spells and which stay one
# run of ordinary text for every tokenizer (no merges with template text around them).
SENT_USER = "\U000f8101"
SENT_ASSISTANT = "\U000f8102"
SENT_SYSTEM = "\U000f8103"
SENT_TOOL = "\U000f8104"
SENT_NEW = "\U000f8105"
PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_fn", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}


def call_id(i: int) -> str:
    """A stand-in id for tool call ``i``: 9 alphanumerics, the one form every template takes (Mistral's
    reject any other length)."""
    return f"call{i:05d}"


PROBE_CALL_ID = call_id(0)
PROBE_CALL = {"id": PROBE_CALL_ID, "type": "function", "function": {"name": "probe_fn", "arguments": {}}}
# Context names transformers fills in itself, and the special tokens it passes.
NOT_KWARGS = RESERVED | HELPERS | {"bos_token", "eos_token", "unk_token", "pad_token", "mask_token"}


@dataclass
class Probe:
    """What the template does with the current template kwargs (see :func:`probe_template`).

    ``generation_prompt``: the text ``add_generation_prompt`` appends (None: it does not append).
    ``turn_close``: the added token right after an assistant reply's text when the reply ends the
    conversation (None: there is none). ``history_close``: the same once another message follows
    (gpt-oss: ``<|return|>`` vs ``<|end|>``); the bridge splices after it and synthesizes it for a
    truncated completion. ``close_gap``: template text between the reply and its close.
    ``stop_tokens``: added tokens that end an assistant turn (after a reply, after a tool call).
    ``continuations``: for a user / tool / system message after an assistant turn, whether the
    render only appends after the assistant turn's close, with the same text whatever came before.
    """

    generation_prompt: str | None = None
    turn_close: str | None = None
    history_close: str | None = None
    close_gap: str = ""
    stop_tokens: tuple[str, ...] = ()
    thinking_switch: bool = False
    reasoning_efforts: tuple[str, ...] = ()
    tools: bool = False
    kwargs: dict[str, type] = field(default_factory=dict)
    continuations: dict[str, str | None] = field(default_factory=dict)  # role -> None if append-only, else why not
    history_arguments: str = "object"  # "json" where the template renders tool-call arguments only as a string
    tools_in_tail: bool = True  # tool definitions change what follows an assistant turn (else the bridge omits them)
    reply_head: str = ""  # template text after the generation prompt, before a reply's text (SentencePiece Mistral's " ")


def template_kwargs(template: ChatTemplate) -> dict[str, type]:
    """The kwargs a template reads, typed where known: names nothing inside it defines, except names it
    assigns itself without ever asking whether the caller gave them (``{% set content = ... %}`` inside
    a loop looks undeclared to the parser; ``date_string``, tested ``is defined``, is a kwarg)."""
    out: dict[str, type] = {}
    source = template.source
    # minijinja does not count `{% set x = x if x is defined else ... %}` as reading x: names asked for
    # are candidates too, unless they are loop variables or macro parameters
    asked_for = set(re.findall(r"(?<![\w.])([A-Za-z_]\w*)\s+is\s+(?:not\s+)?defined", source))
    asked_for |= set(re.findall(r"(?<![\w.])([A-Za-z_]\w*)\s*\|\s*default\b", source))
    local = set(re.findall(r"for\s+([\w\s,]+?)\s+in\s", source))
    local = {n.strip() for group in local for n in group.split(",")}
    for params in re.findall(r"macro\s+\w+\(([^)]*)\)", source):
        local |= {p.split("=")[0].strip() for p in params.split(",")}
    for name in sorted((template.variables | (asked_for - local)) - NOT_KWARGS):
        assigned = re.search(rf"set\s+{name}\s*=", source) is not None
        asked = re.search(rf"\b{name}\s+is\s+(not\s+)?defined|\b{name}\s*\|\s*default\b", source) is not None
        if assigned and not asked:
            continue
        out[name] = {"enable_thinking": bool, "reasoning_effort": str}.get(name, object)
    return out


def _try(template: ChatTemplate, messages: list[dict], tools: Any, agp: bool, special: dict, kwargs: dict) -> str | None:
    try:
        return template.render(messages, tools, agp, special, **kwargs)
    except TemplateRejected:
        return None


def _efforts(template: ChatTemplate, special: dict, kwargs: dict) -> tuple[str, ...]:
    """Levels of EFFORT_LEVELS the template distinguishes: accepted (no error) and either named as a
    string literal in the template, with a render no other named level gives, or - when the template
    prints the value itself (every level renders differently) - every accepted level."""
    msgs = [{"role": "user", "content": SENT_USER}]
    renders = {}
    for level in EFFORT_LEVELS:
        text = _try(template, msgs, None, True, special, {**kwargs, "reasoning_effort": level})
        if text is not None:
            renders[level] = text
    if not renders:
        return ()
    if len(set(renders.values())) == len(renders) == len(EFFORT_LEVELS):
        return tuple(renders)  # printed verbatim: the template tells every level apart
    named = [lvl for lvl in renders if re.search(rf"""['"]{lvl}['"]""", template.source)]
    seen: dict[str, str] = {}
    for lvl in named:
        seen.setdefault(renders[lvl], lvl)
    keep = set(seen.values())
    return tuple(lvl for lvl in EFFORT_LEVELS if lvl in keep)


def probe_template(template: ChatTemplate, added: re.Pattern | None, special: dict, kwargs: dict) -> Probe:
    """Render sentinel conversations and record what the template does (see :class:`Probe`)."""
    probe = Probe(kwargs=template_kwargs(template))
    user = {"role": "user", "content": SENT_USER}
    reply = {"role": "assistant", "content": SENT_ASSISTANT}
    base = _try(template, [user], None, False, special, kwargs)
    with_prompt = _try(template, [user], None, True, special, kwargs)
    if base is not None and with_prompt is not None and with_prompt.startswith(base):
        probe.generation_prompt = with_prompt[len(base) :]
    # the turn close after a sentinel reply, and the stop tokens
    stops: list[str] = []
    turn = _try(template, [user, reply], None, False, special, kwargs)
    if turn is not None and added is not None and SENT_ASSISTANT in turn:
        after = turn[turn.rindex(SENT_ASSISTANT) + 1 :]
        m = added.search(after)
        if m is not None:
            probe.turn_close, probe.close_gap = m.group(), after[: m.start()]
            stops.append(m.group())
        if with_prompt is not None and turn.startswith(with_prompt):
            probe.reply_head = turn[len(with_prompt) : turn.index(SENT_ASSISTANT)]
    followed = _try(template, [user, reply, {"role": "user", "content": SENT_NEW}], None, False, special, kwargs)
    if followed is not None and added is not None and SENT_ASSISTANT in followed:
        after = followed[followed.rindex(SENT_ASSISTANT) + 1 :]
        m = added.search(after)
        if m is not None and not after[: m.start()]:
            probe.history_close = m.group()
    called = _try(template, [user, {**reply, "tool_calls": [PROBE_CALL]}], [PROBE_TOOL], False, special, kwargs)
    if called is not None and added is not None:
        start = called.rfind(SENT_ASSISTANT) if SENT_ASSISTANT in called else called.rfind(SENT_USER)
        last = None
        for m in added.finditer(called, start + 1):
            last = m
        if last is not None and not called[last.end() :].strip():
            stops.append(last.group())
    probe.stop_tokens = tuple(dict.fromkeys(stops))
    if called is None:  # a template that concatenates the arguments rejects a dict (DeepSeek R1)
        as_string = {**PROBE_CALL, "function": {"name": "probe_fn", "arguments": "{}"}}
        if _try(template, [user, {**reply, "tool_calls": [as_string]}], [PROBE_TOOL], False, special, kwargs) is not None:
            probe.history_arguments = "json"
    # switches
    if "enable_thinking" in probe.kwargs:
        on = _try(template, [user], None, True, special, {**kwargs, "enable_thinking": True})
        off = _try(template, [user], None, True, special, {**kwargs, "enable_thinking": False})
        probe.thinking_switch = on is not None and off is not None and on != off
    if "reasoning_effort" in probe.kwargs:
        probe.reasoning_efforts = _efforts(template, special, {k: v for k, v in kwargs.items() if k != "reasoning_effort"})
    probe.tools = _try(template, [user], [PROBE_TOOL], True, special, kwargs) not in (None, with_prompt)
    probe.continuations = {
        role: _continuation(template, probe, role, special, kwargs, added) for role in ("user", "tool", "system")
    }
    probe.tools_in_tail = _tools_in_tail(template, probe, special, kwargs, added)
    return probe


def _tools_in_tail(template: ChatTemplate, probe: Probe, special: dict, kwargs: dict, added: re.Pattern | None) -> bool:
    """Whether tool definitions change what a template renders after an assistant turn's close. Templates put
    them in the system preamble or the first user turn; where the text after the close is the same with and
    without them for every continuation, the bridge renders without them (a large tool list costs every
    bridge otherwise)."""
    if probe.history_close is None:
        return True
    u = {"role": "user", "content": SENT_USER}
    for role in ("user", "tool", "system"):
        call = {"tool_calls": [PROBE_CALL]} if role == "tool" else {}
        answer = {"tool_call_id": PROBE_CALL_ID} if role == "tool" else {}
        conversation = [u, {"role": "assistant", "content": SENT_ASSISTANT, **call}, {"role": role, "content": SENT_NEW, **answer}]
        tails = []
        for tools in ([PROBE_TOOL], None):
            full = _try(template, conversation, tools, True, special, kwargs)
            cut = None if full is None else splice_point(full, closers(probe, added), full.find(SENT_NEW))
            tails.append(None if cut is None else full[cut:])
        if tails[0] != tails[1]:
            return True
    return False


def _continuation(template: ChatTemplate, probe: Probe, role: str, special: dict, kwargs: dict, added: re.Pattern) -> str | None:
    """None when a ``role`` message after an assistant turn renders append-only after the turn's close,
    with the same appended text after two different histories; else the reason it does not."""
    if probe.history_close is None:
        return "no added token right after an assistant reply closes its turn, so a splice cannot be anchored on one"
    call = {"tool_calls": [PROBE_CALL]} if role == "tool" else {}
    tools = [PROBE_TOOL] if role == "tool" else None
    new: dict[str, Any] = {"role": role, "content": SENT_NEW}
    if role == "tool":  # the answer to the call (Mistral's templates reject a tool message without its id)
        new["tool_call_id"] = PROBE_CALL_ID
    u = {"role": "user", "content": SENT_USER}
    histories = [
        [u, {"role": "assistant", "content": SENT_ASSISTANT, **call}],
        [
            {"role": "system", "content": SENT_SYSTEM},
            u,
            {"role": "assistant", "content": SENT_USER + SENT_ASSISTANT},
            u,
            {"role": "assistant", "content": SENT_ASSISTANT, **call},
        ],
        [  # an earlier tool round and reasoning: templates that keep conversation-wide state differ here
            {"role": "system", "content": SENT_SYSTEM},
            u,
            {"role": "assistant", "content": SENT_USER, "reasoning_content": SENT_USER, "tool_calls": [PROBE_CALL]},
            {"role": "tool", "content": SENT_TOOL, "tool_call_id": PROBE_CALL_ID},
            {"role": "assistant", "content": SENT_USER + SENT_ASSISTANT},
            u,
            {"role": "assistant", "content": SENT_ASSISTANT, **call},
        ],
    ]
    tails = []
    for k, history in enumerate(histories):
        full = _try(template, [*history, new], tools or ([PROBE_TOOL] if k == 2 else None), True, special, kwargs)
        if full is None:
            if k == 0:
                return f"the template rejects a {role} message after an assistant turn"
            continue  # this history itself is not one the template accepts (e.g. no tool role)
        cut = splice_point(full, closers(probe, added), full.find(SENT_NEW))
        if cut is None:
            return f"no turn-closing token follows the assistant turn when a {role} message comes next"
        if SENT_NEW in full[:cut]:
            return f"MOVES: the template renders a {role} message before the assistant turn it follows"
        if SENT_NEW not in full[cut:]:
            return f"the template does not render a {role} message after an assistant turn"
        # the history up to its last user message must render as it did alone: a template that moves a
        # system prompt or tool list next to the last user message rewrites it (the tails alone look the
        # same). The last assistant turn itself may differ (Qwen3's empty think block, gpt-oss' close).
        alone = _try(template, history, tools or ([PROBE_TOOL] if k == 2 else None), False, special, kwargs)
        last_user = -1 if alone is None else alone.rfind(SENT_USER)
        if last_user < 0 or alone[:last_user] != full[: full.rfind(SENT_USER, 0, cut)]:
            return f"the template renders the earlier conversation differently once a {role} message follows"
        tails.append(full[cut:])
    if len(set(tails)) > 1:
        return f"what the template renders for a {role} message depends on the earlier conversation"
    return None


def closers(probe: Probe, added: re.Pattern | None) -> re.Pattern:
    """The added tokens that can close an assistant turn: its stop tokens and its close in the history."""
    tokens = {*probe.stop_tokens, *([probe.history_close] if probe.history_close else [])}
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or "(?!)")


def splice_point(text: str, closing: re.Pattern, before: int | None = None) -> int | None:
    """Position right after the turn-closing token that follows the last sentinel reply in ``text``: the
    last one before position ``before`` (where the next message's text starts), else the first one."""
    at = text.rfind(SENT_ASSISTANT)
    if at < 0:
        return None
    if before is not None and before > at:
        found = [m.end() for m in closing.finditer(text, at, before)]
        if found:
            return found[-1]
    m = closing.search(text, at)
    return None if m is None else m.end()
