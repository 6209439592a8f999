"""The sidecar process: reads its vLLM process's events from a pipe and runs
the export side (``observers.py``) on them, until the pipe ends.

It lives in its own session (Ctrl-C at the terminal and SIGTERM to vLLM's
process group do not reach it) and ignores SIGINT and SIGTERM: its lifetime is
its parent's, plus the bounded final flush. Pipe EOF - a clean exit,
``os._exit`` or SIGKILL of the parent alike - flushes and exits.
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import signal
import struct
import time
from typing import Any

from kvobs_otel.sidecar import wire

logger = logging.getLogger("kvobs_otel")

# Counters shared with the parent (a file both map): events handled so far
# (the parent counts the rest as lost when this process dies), spans
# delivered, observations dropped on this side. The parent logs them when
# the sidecar ends, so a loss shows in vLLM's own log too.
SHARED = struct.Struct("<QQQ")
SIDECAR_TICK_S = 0.05  # lifecycle deadlines are checked this often


class Sidecar:
    def __init__(self, rfd: int, shm_fd: int) -> None:
        self.rfd = rfd
        self.shm = mmap.mmap(shm_fd, SHARED.size)
        self.handled = 0
        self.observers: Any = None  # ObserverSet, from the hello
        self.interval = SIDECAR_TICK_S

    def run(self) -> int:
        reader = wire.FrameReader()
        next_tick = time.monotonic() + self.interval
        while True:
            timeout = max(0.0, next_tick - time.monotonic())
            ready, _, _ = select.select([self.rfd], [], [], timeout)
            if ready:
                try:
                    chunk = os.read(self.rfd, 1 << 20)
                except InterruptedError:
                    continue
                if not chunk:
                    break  # EOF: the parent closed the pipe or is gone
                for message in reader.feed(chunk):
                    if not self.dispatch(message):
                        return self.finish()
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.interval
                if self.observers is not None:
                    self.observers.tick(time.monotonic_ns())
        if reader.partial:
            logger.warning("kvobs-otel sidecar: the pipe ended inside a frame (the vLLM "
                           "process died while writing); that batch is lost")
        return self.finish()

    def dispatch(self, message: tuple[Any, ...]) -> bool:
        kind = message[0]
        if kind == "events":
            batch = message[1]
            self.observers.handle(batch)
            self.handled += len(batch)
            self.publish()
        elif kind == "tick":
            _kind, progress, drops, errors = message
            obs = self.observers
            obs.progress.update(progress)
            obs.remote_drops, obs.remote_errors = drops, errors
        elif kind == "hello":
            from kvobs_otel.config import EXPORT_SIDECAR
            from kvobs_otel.observers import ObserverSet

            _kind, settings, pid, offset_ns = message
            # Deadlines run here at the usual pace: waking costs vLLM nothing.
            self.interval = min(settings.drain_interval_s, SIDECAR_TICK_S)
            self.observers = ObserverSet(settings, pid=pid, clock_offset_ns=offset_ns,
                                         mode=EXPORT_SIDECAR)
        elif kind == "end":
            return False
        return True

    def publish(self) -> None:
        from kvobs_otel.telemetry import export

        exported, dropped, _errors = export.STATS.snapshot()
        SHARED.pack_into(self.shm, 0, self.handled, exported, sum(dropped.values()))

    def finish(self) -> int:
        if self.observers is not None:
            self.observers.close()
        self.publish()
        return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(format=f"%(levelname)s kvobs-otel sidecar[{os.getpid()}] %(message)s",
                        level=logging.WARNING)
    if len(argv) != 2:
        print("usage: python -m kvobs_otel.sidecar RFD SHMFD (started by kvobs-otel, "
              "not by hand)", file=__import__("sys").stderr)
        return 2
    return Sidecar(int(argv[0]), int(argv[1])).run()
