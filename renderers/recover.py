"""The conversation behind a prompt's ids, recovered from the ids alone, for the generic renderer.

A caller that bridges by ids (verifiers' TrainClient, prime-rl, a renderer after a restart) gives the
previous prompt and completion but not the messages; a template that is not append-only needs them,
because the bridge renders the whole conversation (renderers/full_bridge.py). This module reads them
back from the prompt's text, using only what rendering the template itself shows:

1. Roles, in order (``_walk``): from the start of the text, try each role as the next message with a
   sentinel text and see where the template puts it. The text before the sentinel must be what the
   prompt holds there, and the message's text runs up to the template's own text after the sentinel,
   through its turn-closing token (or, where no added token follows, up to its literal text: Llama 2's
   `` [/INST]`` on a vocabulary without it). An assistant turn's text is parsed as a completion
   (reasoning, tool calls, the dialect's scan), the others kept as they stand (a text the template
   writes inside a JSON string, Mistral's tool results, is unescaped). The generation prompt may be
   empty: ``[INST]`` templates (Mistral v1-v3, Llama 2) open the assistant turn with the user turn's
   close. The walk renders with tool definitions, then without them (a template may move them next
   to the last user message, which the walk cannot know is the last), so a message's text may still
   hold what the template moved into it (a tool list, a system prompt); step 2 takes that apart.
2. Texts (``_fit``): the walk's conversation rendered once more, with the tools and with every
   non-assistant text a distinct sentinel, is a pattern of the whole prompt: the template's text
   literal, each sentinel any text. Matched against the prompt it gives every message's text where the
   template really put it. A system message is tried as found, dropped (a tool list in a system turn
   of its own) or added (a system prompt the template moved).
3. Proof: the recovered conversation is rendered to ids, and used only if they equal the prompt's ids
   token for token. A wrong recovery is therefore never used: the bridge then breaks, saying so.
   Where several readings are proven (a system prompt folded into a user text as plain text), the
   bridge uses them only if they all bridge to the same ids (renderers/generic_bridge.py).

The cost is a few template renders per message and one regex match, paid only where the conversation
behind a prompt is not remembered; the renderer remembers what it recovered.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from .annotate import DEFUSE_CANDIDATES, defused
from .base import TemplateRejected
from .full_bridge import RendersWhole, exact_texts
from .messages import MessageError
from .probe import SENT_NEW, Probe, call_id, closers
from .tokenizer import Tokenizer


class Recovers(RendersWhole, Protocol):
    """What recovery uses of the generic renderer (a Protocol: this module needs nothing of
    renderers/generic.py, which imports it)."""

    tokenizer: Tokenizer
    _added_re: re.Pattern[str] | None

    @property
    def probe(self) -> Probe: ...

    def _try_text(self, msgs: list[dict], tools: list[dict] | None, agp: bool) -> str | None: ...

# Sentinels for step 2, one per message: supplementary private-use characters (as the probe's).
_FIRST_SENTINEL = 0xF8200
_SENTINELS = re.compile("[\U000f8200-\U000f8fff]")
_SENTINEL = "\U000f8100"  # the walk's candidate text
_MAX_RENDERS = 400  # the walk gives up after this many template renders (a prompt no role sequence fits)


def recover_conversations(renderer: Recovers, prompt: list[int], tools: list[dict] | None) -> list[list[dict]]:
    """Every reading of ``prompt`` that re-renders to it exactly, among the variants of the first role
    sequence that has one (step 2's: as found, without its system message, with one added); empty where
    none is found.

    More than one where the template folds a system prompt into a user turn with plain text around it:
    Mistral v2/v3 render ``[INST]`` + system + ``\n\n`` + user text, so a user text holding ``\n\n``
    reads as either. The readings may render the next turn differently (a system prompt moves to the
    new last user message, a user text does not): the bridge then breaks rather than guess."""
    prompt = list(prompt)  # a tuple or an array compares unlike a list
    probe = renderer.probe
    # An empty generation prompt is no obstacle: in [INST] templates (Mistral v1-v3, Llama 2) the user
    # turn's closing token opens the assistant turn, and they are the ones that move a system prompt.
    gp = probe.generation_prompt or ""
    if not prompt or not (probe.stop_tokens or probe.history_close):
        return []
    text = renderer.tokenizer.decode(prompt)
    if _SENTINELS.search(text) or _SENTINEL in text or SENT_NEW in text:
        return []
    proven = _recover(renderer, prompt, text, gp, tools)
    if proven:
        return proven
    # A SentencePiece tokenizer that puts its dummy prefix on every run between added tokens decodes to
    # a text with one space too many after each added token: the runs' own text is a second reading.
    runs = renderer.tokenizer.decode_runs(prompt)
    if runs != text and (proven := _recover(renderer, prompt, runs, gp, tools)):
        return proven
    # A message text that holds a marker's text as plain tokens (a user who typed "[/INST]") reads, in the
    # decoded text, as the template's marker: the walk would end the message there. The runs' text with
    # those copies defused is a third reading, the defusing taken out again before the proof.
    reading = _defused_runs(renderer, prompt, runs)
    if reading is None:
        return []
    text, char = reading
    return _recover(renderer, prompt, text, gp, tools, restore=lambda conv: _without(conv, char))


def _defused_runs(renderer: Recovers, prompt: list[int], runs: str) -> tuple[str, str] | None:
    """The prompt's text run by run (``runs``: :meth:`Tokenizer.decode_runs`) with every marker string a
    run of plain tokens decodes to defused (renderers/annotate.py), and the defusing character; None where
    no run holds one."""
    tok, added = renderer.tokenizer, renderer._added_re
    char = next((c for c in DEFUSE_CANDIDATES if c not in runs), None)
    if added is None or char is None:
        return None
    pieces: list[str] = []
    run: list[int] = []
    found = False

    def flush() -> None:
        nonlocal found
        if run:
            piece = tok.backend.decode(run, skip_special_tokens=False)
            fused = defused(piece, added, char)
            found = found or fused != piece
            pieces.append(fused)
            run.clear()

    for i in prompt:
        if i in tok.special_ids:
            flush()
            pieces.append(tok.backend.decode([i], skip_special_tokens=False))
        else:
            run.append(i)
    flush()
    return ("".join(pieces), char) if found else None


def _without(value: Any, char: str) -> Any:
    """``value`` (messages) with ``char`` taken out of every string."""
    if isinstance(value, str):
        return value.replace(char, "")
    if isinstance(value, list):
        return [_without(v, char) for v in value]
    if isinstance(value, dict):
        return {k: _without(v, char) for k, v in value.items()}
    return value


def _recover(renderer: Recovers, prompt: list[int], text: str, gp: str, tools: list[dict] | None,
             restore=None) -> list[list[dict]]:
    """The readings of ``text`` (a decoding of ``prompt``) proven on ``prompt``; ``restore``: what turns a
    conversation read from ``text`` into the caller's (the defusing taken out)."""
    # (DeepSeek V3 appends no generation prompt after tool outputs)
    walk = _Walk(renderer, text, len(text) - len(gp) if text.endswith(gp) else len(text), tools)
    for messages in walk.conversations():
        proven: list[list[dict]] = []
        for conversation in _fits(renderer, messages, tools, text):
            if restore is not None:
                conversation = restore(conversation)
            try:
                ids = renderer._render_tokens(conversation, tools, True).token_ids
            except (TemplateRejected, MessageError):
                continue
            if ids != prompt and (unescaped := _unescaped(conversation)) is not None:
                conversation = unescaped  # a template that writes a text inside a JSON string (Mistral's tool results)
                try:
                    ids = renderer._render_tokens(conversation, tools, True).token_ids
                except (TemplateRejected, MessageError):
                    continue
            if ids == prompt and conversation not in proven:
                proven.append(conversation)
        if proven:
            return proven
    return []


class _Walk:
    """Role sequences whose renders, message by message, spell the prompt's text (step 1)."""

    def __init__(self, renderer: Recovers, text: str, end: int, tools: list[dict] | None) -> None:
        self.r = renderer
        self.text = text
        self.end = end  # where the generation prompt starts
        self.tools = tools  # the walk's (see conversations)
        self.parse_tools = tools
        self.closing = closers(renderer.probe, renderer._added_re)
        self.renders = 0

    def conversations(self):
        """With the tool definitions first (a template that announces tools in its header, Llama 3.1),
        then without (one that moves them next to the last user message, where the walk cannot know
        which user message is the last)."""
        yield from self._from([], 0)
        if self.tools is not None:
            self.tools = None
            yield from self._from([], 0)

    def _from(self, msgs: list[dict], pos: int):
        if msgs and not self.text[pos : self.end].strip():
            yield msgs
            return
        for role in _next_roles(msgs):
            if self.renders >= _MAX_RENDERS:
                return
            step = self._step(msgs, role)
            if step is not None:
                message, nxt = step
                yield from self._from([*msgs, message], nxt)
        # No message renders as the text goes on. Perhaps the walk is at the end, short of template text
        # it does not consume (Qwen's ``</tool_response>``), or at the last user message with what the
        # template put before it (a system block or tool list moved there): step 2 finds out.
        if msgs:
            yield msgs
        if not msgs or msgs[-1]["role"] in ("assistant", "tool"):
            yield [*msgs, {"role": "user", "content": ""}]

    def _step(self, msgs: list[dict], role: str) -> tuple[dict, int] | None:
        """The next message if it has ``role``, and where the walk goes on in the text: rendered with a
        message after it, else (an assistant turn) alone, for a template that moves its tool list next
        to the last user message (Mistral v2-v11), which the follower would be.

        The message's text ends where the template's text after it does: its literal text up to the
        first added token, and that token (Qwen's ``\n</tool_response>``, Llama's ``<|eot_id|>``,
        DeepSeek's ``<｜Assistant｜>``). The walk goes on after that token when it closes a turn, else
        before it (the next message's header)."""
        candidate: dict[str, Any] = {"role": role, "content": _SENTINEL}
        if role == "tool":
            candidate.update(_answered_call(msgs))
        follower = {"role": "user" if role in ("assistant", "system") else "assistant", "content": SENT_NEW}
        step = self._step_with(msgs, candidate, [follower])
        if step is None and role == "assistant" and self.tools is not None:
            step = self._step_with(msgs, candidate, [])
        return step

    def _step_with(self, msgs: list[dict], candidate: dict, after: list[dict]) -> tuple[dict, int] | None:
        role = candidate["role"]
        self.renders += 1
        rendered = self.r._try_text([*msgs, candidate, *after], self.tools, False)
        if rendered is None or rendered.count(_SENTINEL) != 1:
            return None
        at = rendered.index(_SENTINEL)
        quoted = False
        if role == "tool" and rendered[at - 1 : at + 2] == f'"{_SENTINEL}"' and not self.text.startswith(rendered[:at]):
            # a template that writes a tool result inside a JSON string unless it reads as a number
            # (Mistral v3's ``{"content": 7, ...}``): the text without the quotes
            quoted = self.text.startswith(rendered[: at - 1])
            if quoted:
                rendered = rendered[: at - 1] + _SENTINEL + rendered[at + 2 :]
                at -= 1
        tat = at  # where the message's text starts in the prompt's text
        if not self.text.startswith(rendered[:at]):
            # A reply head the template writes before a reply's text only (SentencePiece Mistral's " "
            # after ``[/INST]``) is not there before a turn of tool calls alone: ``[/INST][TOOL_CALLS]``.
            head = self.r.probe.reply_head if role == "assistant" else ""
            if not head or not rendered[:at].endswith(head) or not self.text.startswith(rendered[: at - len(head)]):
                return None
            tat = at - len(head)
        marker = self.r._added_re.search(rendered, at) if self.r._added_re is not None else None
        if marker is None or SENT_NEW in rendered[at : marker.start()]:
            # No added token ends the message's text (Llama 2's ``[INST] ... [/INST]`` on a vocabulary
            # without them): the template's literal text up to the next message's does.
            delimiter = rendered[at + 1 : rendered.find(SENT_NEW, at)]
            stop = self.text.find(delimiter, tat, self.end) if delimiter.strip() else -1
            if stop < 0:
                return None
            closes, nxt = False, stop
        else:
            delimiter = rendered[at + 1 : marker.end()]
            stop = self.text.find(delimiter, tat, self.end + len(delimiter))
            if stop < 0:
                return None
            closes = self.closing.fullmatch(marker.group()) is not None
            nxt = stop + len(delimiter) if closes else stop + len(delimiter) - len(marker.group())
        body = self.text[tat:stop]
        if role != "assistant":
            if not quoted and rendered[at - 1 : at] == '"' and delimiter.startswith('"'):  # inside a JSON string (Mistral's tool results)
                try:
                    body = json.loads(f'"{body}"')
                except ValueError:
                    return None
            return {**candidate, "content": body}, nxt
        ids = self.r.tokenizer.encode(body + (marker.group() if closes and marker is not None else ""))
        message = self.r.parse_response(ids, tools=self.parse_tools).to_message(self.r.history_arguments)
        return self._as_written(msgs, message, exact_texts(message, body), after, tat, body), nxt

    def _as_written(self, msgs: list[dict], message: dict, candidates: list[dict], after: list[dict], tat: int,
                    body: str) -> dict:
        """The first of ``candidates`` (the parsed turn with its text as sampled, renderers/full_bridge.py
        ``exact_texts``) that the template writes as the prompt's text holds it, at ``tat``; else the
        first, else ``message``. One render each, only where the parse stripped text."""
        if len(candidates) > 1:
            for candidate in candidates:
                self.renders += 1
                rendered = self.r._try_text([*msgs, candidate, *after], self.tools, False)
                if rendered is not None and rendered[:tat] == self.text[:tat] and rendered[tat:].startswith(body):
                    return candidate
        return candidates[0] if candidates else message


def _unescaped(conversation: list[dict]) -> list[dict] | None:
    """The conversation with every non-assistant text read as the inside of a JSON string, where that
    changes one; None where none changes."""
    out, changed = [], False
    for m in conversation:
        content = m.get("content")
        if m["role"] != "assistant" and isinstance(content, str) and "\\" in content:
            try:
                decoded = json.loads(f'"{content}"')
            except ValueError:
                decoded = content
            if decoded != content:
                m, changed = {**m, "content": decoded}, True
        out.append(m)
    return out if changed else None


def _next_roles(msgs: list[dict]) -> tuple[str, ...]:
    if not msgs:
        return ("user", "system")
    last = msgs[-1]
    if last["role"] == "assistant":
        return ("tool", "user") if last.get("tool_calls") else ("user", "tool")
    if last["role"] == "tool":
        return ("tool", "assistant", "user")
    return ("assistant", "user")


def _answered_call(msgs: list[dict]) -> dict:
    """The id and name of the call a tool message after ``msgs`` answers (templates render them)."""
    answered = 0
    for m in reversed(msgs):
        if m["role"] == "tool":
            answered += 1
            continue
        calls = (m.get("tool_calls") or []) if m["role"] == "assistant" else []
        if answered < len(calls):
            call = calls[answered]
            return {"tool_call_id": call.get("id") or call_id(answered), "name": call["function"]["name"]}
        break
    return {}


def _fits(renderer: Recovers, messages: list[dict], tools: list[dict] | None, text: str):
    """Conversations whose render matches ``text`` as a pattern (step 2): ``messages``, then without
    its first system message, then with one the template may have moved."""
    variants = [messages]
    if messages and messages[0]["role"] == "system":
        variants.append(messages[1:])
    else:
        variants.append([{"role": "system", "content": ""}, *messages])
    for variant in variants:
        fitted = _fit(renderer, variant, tools, text)
        if fitted is None and any(m["role"] == "tool" for m in variant):
            # a tool result the template writes other than as it stands (a number outside its quotes):
            # as the walk read it (templates move no system prompt or tool list into a tool result)
            fitted = _fit(renderer, variant, tools, text, keep=("assistant", "tool"))
        if fitted is not None:
            yield fitted


def _fit(renderer: Recovers, messages: list[dict], tools: list[dict] | None, text: str,
         keep: tuple[str, ...] = ("assistant",)) -> list[dict] | None:
    skeleton = [
        m if m["role"] in keep else {**m, "content": chr(_FIRST_SENTINEL + i)} for i, m in enumerate(messages)
    ]
    rendered = renderer._try_text(skeleton, tools, True)
    if rendered is None:
        return None
    pattern, groups, seen = [], {}, set()
    pos = 0
    for m in _SENTINELS.finditer(rendered):
        pattern.append(re.escape(rendered[pos : m.start()]))
        i = ord(m.group()) - _FIRST_SENTINEL
        name = f"m{i}"
        pattern.append(f"(?P={name})" if i in seen else f"(?P<{name}>.*?)")
        seen.add(i)
        groups[i] = name
        pos = m.end()
    pattern.append(re.escape(rendered[pos:]))
    match = re.fullmatch("".join(pattern), text, re.DOTALL)
    if match is None:
        return None
    out = []
    for i, m in enumerate(messages):
        if m["role"] in keep:
            out.append(m)
        elif i in groups:
            out.append({**m, "content": match.group(groups[i])})
        else:
            return None  # the template does not render this message's text: it cannot be recovered
    return out
