"""The lifecycle of a process that refused to observe its host."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class RefusedHost:
    """What a refused process exports: its refusal, counted (the alert
    KvobsVllmRefused fires on it), and nothing else."""

    role = "host"

    def __init__(self, reasons: Iterable[str], reason: str, sink: Any = None) -> None:
        self.refused = dict.fromkeys(reasons, 0)
        self.refused[reason] = 1

    def refusals(self) -> dict[str, int]:
        return dict(self.refused)

    def anomalies(self) -> dict[str, int]:
        return {}

    def handle(self, event: tuple[Any, ...]) -> None:
        pass
