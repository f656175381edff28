"""Stop strings over a token stream, and incremental detokenization that never emits what it may retract.

:class:`TextStream` is fed a completion's token ids as they are sampled. It decodes the whole prefix each
time (a few microseconds per hundred tokens; the decode of a prefix is a prefix of the decode of the
whole for byte-level BPE, once incomplete UTF-8 at the end is held back) and releases text only when it is
final: never a trailing U+FFFD (a character whose bytes have not all arrived) and never a suffix that could
be the start of a stop string (hold-back). When a stop string appears, the completion is cut at the first
token whose text completes it (the tokens vLLM returns), and the text at the stop string (kept with
``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Callable

MAX_STOP_STRINGS = 16  # more than this is refused: each is searched on every delta


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | None = None,
                 include_stop: bool = False) -> None:
        self.decode = decode
        self.stops = [s for s in (stops or []) if s]
        self.include_stop = include_stop
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.stop: str | None = None  # the stop string that ended it
        self.cut: int | None = None  # completion tokens kept (up to the one completing the stop string)
        self.released = 0  # characters of the text that are final
        self.taken = 0  # characters handed out by take()
        self.text = ""
        self.done = False

    @property
    def stopped(self) -> bool:
        return self.stop is not None

    def feed(self, ids: list[int]) -> None:
        if self.stopped or self.done or not ids:
            return
        self.ids += ids
        text = self.decode(self.ids)
        found = None
        for s in self.stops:
            # a match cannot start before `released`: the held-back suffix was the longest one that
            # could begin a stop string, so nothing released can be the start of one
            p = text.find(s, self.released)
            if p >= 0 and (found is None or p < found[0]):
                found = (p, s)
        if found is not None:
            p, s = found
            k = len(self.ids)
            while k > 1 and self.decode(self.ids[: k - 1]).find(s, p) == p:
                k -= 1  # the fewest tokens whose text holds the stop string
            self.stop, self.cut = s, k
            self.text = text[: p + len(s) if self.include_stop else p]
            self.released = len(self.text)
            return
        safe = len(text)
        while safe > self.released and text[safe - 1] == "\ufffd":
            safe -= 1
        for h in range(min(self.hold, safe - self.released), 0, -1):
            tail = text[safe - h: safe]
            if any(s.startswith(tail) for s in self.stops):
                safe -= h
                break
        self.text, self.released = text, max(self.released, safe)

    def finish(self) -> None:
        """The completion ended without a stop string: everything is final."""
        if not self.stopped and not self.done:
            self.text = self.decode(self.ids)
            self.released = len(self.text)
        self.done = True

    def take(self) -> str:
        """The text that became final since the last call."""
        piece = self.text[self.taken: self.released]
        self.taken = self.released
        return piece

    @property
    def final_text(self) -> str:
        return self.text[: self.released]
