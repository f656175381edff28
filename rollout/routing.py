"""Sticky least-loaded routing: every turn of a rollout goes to the engine that holds its KV,
unless that engine is overloaded — then to the least loaded one, which becomes the new home.

Pure consistent hashing ignores load (a hot engine thrashes while others idle); pure least-loaded
ignores locality (every turn re-prefills its whole history). This keeps locality until the load
gap is large.
"""

from __future__ import annotations

import time

DEAD = 1 << 30  # the load of a dropped engine: never the least loaded


class StickyLeastLoaded:
    """Routes sessions over ``n`` engines by in-flight request count.

    ``acquire(session)`` returns an engine index and counts the request as in flight until
    ``release(index)``. A session stays on its engine while that engine's load is at most
    ``overload_factor`` x the least loaded engine's load (+1, so light loads never move).
    """

    def __init__(self, n: int, overload_factor: float = 1.5) -> None:
        if n < 1:
            raise ValueError("need at least one engine")
        self.load = [0] * n
        self.home: dict[str, int] = {}
        self.overload_factor = overload_factor
        self.moves = 0
        self.busy_s = [0.0] * n  # wall time each engine had at least one request in flight
        self._busy_since: list[float | None] = [None] * n

    def acquire(self, session: str) -> int:
        least = min(range(len(self.load)), key=self.load.__getitem__)
        home = self.home.get(session)
        if home is None or self.load[home] > self.overload_factor * self.load[least] + 1:
            if home is not None:
                self.moves += 1
            home = self.home[session] = least
        if self.load[home] == 0:
            self._busy_since[home] = time.perf_counter()
        self.load[home] += 1
        return home

    def release(self, index: int) -> None:
        if self.load[index] >= DEAD:  # dropped while this request was in flight: it must stay dropped
            return
        self.load[index] -= 1
        since = self._busy_since[index]
        if self.load[index] == 0 and since is not None:
            self.busy_s[index] += time.perf_counter() - since
            self._busy_since[index] = None

    def forget(self, session: str) -> None:
        self.home.pop(session, None)

    def alive(self) -> list[int]:
        """The engines not dropped, in index order."""
        return [i for i, load in enumerate(self.load) if load < DEAD]

    def revive_engine(self, index: int) -> None:
        """A dropped engine is back (restarted): it takes requests again, starting empty."""
        if self.load[index] >= DEAD:
            self.load[index] = 0

    def drop_engine(self, index: int) -> None:
        """An engine died: its sessions move on their next turn; it gets no new requests."""
        since = self._busy_since[index]
        if since is not None and self.load[index] < DEAD:  # its busy time ends with it
            self.busy_s[index] += time.perf_counter() - since
        self._busy_since[index] = None
        self.load[index] = DEAD
        for session, home in list(self.home.items()):
            if home == index:
                del self.home[session]
