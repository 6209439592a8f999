"""The bounded buffer between vLLM's serving threads and the drain thread.

``offer`` is the only call the serving path makes: a length check and a
deque append (atomic under the GIL). When full it drops the event and counts
it; it never waits. The bound can be overshot by at most one event per
concurrently offering thread, which is harmless.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class EventBuffer:
    __slots__ = ("_q", "capacity", "dropped_full", "accepted")

    def __init__(self, capacity: int) -> None:
        self._q: deque[tuple[Any, ...]] = deque()
        self.capacity = capacity
        self.dropped_full = 0
        self.accepted = 0

    def offer(self, event: tuple[Any, ...]) -> bool:
        if len(self._q) >= self.capacity:
            self.dropped_full += 1
            return False
        self._q.append(event)
        self.accepted += 1
        return True

    def put_control(self, event: tuple[Any, ...]) -> None:
        """A control (a role's registration or close) in order among the
        events; never dropped, so not held to the bound (there are few)."""
        self._q.append(event)

    def drain(self, limit: int = 4096) -> list[tuple[Any, ...]]:
        """Take up to ``limit`` events in arrival order (drain thread only)."""
        q = self._q
        out = []
        for _ in range(min(limit, len(q))):
            out.append(q.popleft())
        return out

    def __len__(self) -> int:
        return len(self._q)
