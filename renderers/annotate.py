"""Finding, in a render of a chat template, the template's own special tokens and the message text.

Two private-use devices, both removed again before anything is compared or tokenized:

- *defusing*: a character inserted after the first character of every marker (added-token string)
  inside message text, so that the only added-token strings left in a render are the template's;
- *marks*: each text field's stripped core between an open and a close mark naming the field, so
  that the render shows exactly where (and whether verbatim) each message's text landed.

And the string helpers the generic renderer's boundary search uses.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from typing import Any

DEFUSE_CANDIDATES = ("\U0010fffd", "\U0010fffc", "\U0010fffb")
MARK_BASE = 0xF0000  # message i: open chr(MARK_BASE + 2i), close chr(MARK_BASE + 2i + 1)
MAX_MARKED = 0x3F80  # text fields that can be marked (the marks stay below the probe's sentinels)
MARK_RE = re.compile("[\U000f0000-\U000f7eff]")
def added_regex(markers: dict[str, int]) -> re.Pattern | None:
    ordered = sorted(markers, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None


def all_strings(msgs: list[dict], tools: Any) -> str:
    """Every string of the messages and tools, joined (to test for markers and private-use characters)."""
    out: list[str] = []
    stack: list[Any] = [msgs, tools]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return "\x00".join(out)


def defused(value: Any, added: re.Pattern | None, char: str) -> Any:
    """A copy with ``char`` inserted after the first character of every added-token string (roles untouched)."""
    if added is None or value is None:
        return value
    if isinstance(value, str):
        return added.sub(lambda m: m.group()[0] + char + m.group()[1:], value)
    if isinstance(value, dict):
        return {defused(k, added, char): (v if k == "role" else defused(v, added, char)) for k, v in value.items()}
    if isinstance(value, list):
        return [defused(v, added, char) for v in value]
    return value


def wrap(text: str, i: int, fields: list[tuple[int, str, str, str]]) -> str:
    """``text`` with its stripped core between the marks of a new field of message i. Whitespace stays
    outside (so that a template's ``trim`` gives the same text); the field remembers it, and the span
    grows over it where the template kept it."""
    core = text.strip()
    if not core or len(fields) >= MAX_MARKED:
        return text
    k = len(fields)
    lead = text[: len(text) - len(text.lstrip())]
    trail = text[len(text.rstrip()) :]
    fields.append((i, lead, trail, core))
    return f"{lead}{chr(MARK_BASE + 2 * k)}{core}{chr(MARK_BASE + 2 * k + 1)}{trail}"


def mark_message(m: dict, i: int, fields: list[tuple[int, str, str, str]]) -> dict:
    out = dict(m)
    for key in ("content", "reasoning_content"):
        if isinstance(out.get(key), str):
            out[key] = wrap(out[key], i, fields)
    if "tool_calls" in out:
        calls = []
        for call in out["tool_calls"]:
            fn = dict(call["function"])
            fn["name"] = wrap(fn["name"], i, fields)
            args = fn["arguments"]
            fn["arguments"] = wrap(args, i, fields) if isinstance(args, str) else mark_values(args, i, fields)
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def mark_values(value: Any, i: int, fields: list[tuple[int, str, str, str]]) -> Any:
    if isinstance(value, str):
        return wrap(value, i, fields)
    if isinstance(value, dict):
        return {k: mark_values(v, i, fields) for k, v in value.items()}
    if isinstance(value, list):
        return [mark_values(v, i, fields) for v in value]
    return value


def content_spans(text: str, defuse: str, fields: list[tuple[int, str, str, str]], real: str) -> list[tuple[int, int, int]]:
    """Content spans ``(start, end, message)`` in ``real`` (the text without marks and defuse characters),
    grown over the field's leading / trailing whitespace where the template kept it. A mark without its
    partner (the template cut the text, e.g. split it on ``</think>``) is ignored."""
    spans = []
    open_at: dict[int, int] = {}
    removed = 0
    for m in re.finditer(f"[\U000f0000-\U000f7eff{defuse}]", text):
        ch = m.group()
        pos = m.start() - removed
        removed += 1
        if ch == defuse:
            continue
        k, closing = divmod(ord(ch) - MARK_BASE, 2)
        if k >= len(fields):
            continue
        if not closing:
            open_at[k] = pos
        elif k in open_at:
            start = open_at.pop(k)
            i, lead, trail, core = fields[k]
            if real[start:pos] != core.replace(defuse, ""):
                continue  # the template transformed the text (JSON-escaped it...): not the message's own text
            if glued(real, start, pos):
                continue  # template letters glued to the text (an escaped "\n" before it): BPE merges them
            if lead and real[max(0, start - len(lead)) : start] == lead:
                start -= len(lead)
            if trail and real[pos : pos + len(trail)] == trail:
                pos += len(trail)
            if pos > start:
                spans.append((start, pos, i))
    spans.sort()
    return spans


def glued(real: str, start: int, end: int) -> bool:
    """The text at [start, end) touches a letter or digit of the template on either side."""
    before = start > 0 and real[start - 1].isalnum() and real[start].isalnum()
    after = end < len(real) and real[end].isalnum() and real[end - 1].isalnum()
    return before or after


def common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first difference
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def past_closing(prefix: str, real: str, b: int, hi: int, added: re.Pattern | None) -> int:
    """Where the closing text of ``prefix`` (from its last added token on) ends in ``real``: its last
    occurrence between ``b`` and ``hi``; ``b`` when it is not there."""
    if added is None:
        return b
    last = None
    for m in added.finditer(prefix, b):
        last = m
    if last is None:
        return b
    closing = prefix[last.start() :]
    # the last occurrence before the next message's text: the prefix may have diverged long before
    at = real.rfind(closing, b, hi) if hi >= b else -1
    if at >= 0:
        return at + len(closing)
    # the prefix closed its last turn with another token than the full render does (gpt-oss: a final
    # reply ends with <|return|>, the same reply followed by more messages with <|end|>)
    if last.start() == b:
        other = added.match(real, b)
        if other is not None and real.startswith(prefix[last.end() :], other.end()):
            return other.end() + len(prefix) - last.end()
    return b


def snap(pos: int, specials: list[tuple[int, int, int]], special_starts: dict[int, int] | None = None) -> int:
    """A boundary inside a special token's text moves to its start (``specials`` sorted by position)."""
    i = bisect_right(specials, pos, key=lambda t: t[0]) - 1
    if i >= 0 and specials[i][0] < pos < specials[i][1]:
        return specials[i][0]
    return pos
