"""The bounded buffer between vLLM's serving threads and the drain thread.

``offer`` is the only call the serving path makes: a length check, a deque
append (atomic under the GIL) and a count. When full it drops the event and
counts it; it never waits. The bound can be overshot by at most one event
per concurrently offering thread, which is harmless.

The count of accepted events lives in memory the export sidecar maps too
(``count_into``): if this process is killed, the sidecar still knows how
many events it accepted and so how many never left it.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class EventBuffer:
    __slots__ = ("_q", "capacity", "dropped_full", "_accepted", "_count")

    def __init__(self, capacity: int) -> None:
        self._q: deque[tuple[Any, ...]] = deque()
        self.capacity = capacity
        self.dropped_full = 0
        self._accepted = 0
        self._count = memoryview(bytearray(8)).cast("Q")

    def offer(self, event: tuple[Any, ...]) -> bool:
        if len(self._q) >= self.capacity:
            self.dropped_full += 1
            return False
        self._q.append(event)
        # Kept here and written through (a store into the mapped slot costs
        # half of reading it back and adding).
        self._accepted = n = self._accepted + 1
        self._count[0] = n
        return True

    @property
    def accepted(self) -> int:
        return self._accepted

    def count_into(self, view: memoryview) -> None:
        """Keep the accepted count in ``view`` (one unsigned 64-bit slot, in
        memory the sidecar maps) from now on, continuing the total."""
        view[0] = self._accepted
        self._count = view

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
