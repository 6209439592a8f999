"""The sidecar process: reads its vLLM process's events from a pipe and runs
the export side (``observers.py``) on them, until the pipe ends.

It is no descendant of its vLLM process: started through an intermediate
process that forks it and exits at once, it is adopted by init (or the
nearest subreaper). vLLM's shutdown kills each engine process's whole tree
(``kill_process_tree``: SIGKILL to every descendant psutil finds), often the
moment it asked them to stop; a sidecar in that tree would die with what it
still held. It lives in its own session (Ctrl-C at the terminal and SIGTERM
to vLLM's process group do not reach it) and ignores SIGINT and SIGTERM: its
lifetime is its vLLM process's, plus the bounded final flush. Pipe EOF - a
clean exit, ``os._exit`` or SIGKILL of the vLLM process alike - flushes and
exits. EOF without the vLLM process's goodbye (``("end",)``) means it was
killed: what it still had open is ended as abandoned (``process_killed``),
and a ``kv.process.end`` span and a drop count say what never left it.

The vLLM process watches a third pipe (``life``): the sidecar writes its pid
there and holds it open until it exits, so the vLLM process can tell it is
alive, and kill it when it stalls, without being its parent.
"""

from __future__ import annotations

import contextlib
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

# Counters shared with the vLLM process (a file both map). Written here:
# events handled so far (the vLLM process counts the rest as lost when this
# process dies), spans delivered, observations dropped on this side. Written
# there: events its buffer accepted (by the serving thread, per event) and,
# of those, how many were drained before this sidecar started; so after a
# kill the sidecar knows how many never reached it.
SHARED = struct.Struct("<QQQQQ")
OWN = struct.Struct("<QQQ")  # the first three, this process's
ACCEPTED_AT, BASE_AT = 24, 32  # byte offsets of the two the vLLM process writes
SIDECAR_TICK_S = 0.05  # lifecycle deadlines are checked this often
# The final flush, once the vLLM process is gone or said goodbye. Nobody waits
# for it (vLLM's shutdown does not), so it may take longer than vLLM's grace.
FINAL_SPANS_S = 10.0
FINAL_METRICS_S = 5.0
# The export stage's batching delay here when OTEL_BSP_SCHEDULE_DELAY is not
# set (in-process it stays 1 s). Its wakes cost vLLM nothing in this process,
# and at 1 s spans left about 1.8 s (p50) after their seam under the real
# engine's load (benchmark B5).
SCHEDULE_DELAY_MS = "200"


class Sidecar:
    def __init__(self, rfd: int, shm_fd: int) -> None:
        self.rfd = rfd
        self.shm = mmap.mmap(shm_fd, SHARED.size)
        self.handled = 0
        self.observers: Any = None  # ObserverSet, from the hello
        self.interval = SIDECAR_TICK_S
        self.goodbye = False  # the vLLM process closed (not killed)

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

    def unsent(self) -> int:
        """Events the vLLM process accepted that never reached this sidecar
        (read after its end: nothing writes the counters any more)."""
        _h, _e, _d, accepted, base = SHARED.unpack_from(self.shm, 0)
        obs = self.observers
        handled = self.handled - (obs.controls_seen if obs is not None else 0)
        return max(0, accepted - base - handled)

    def dispatch(self, message: tuple[Any, ...]) -> bool:
        kind = message[0]
        if kind == "events":
            batch = message[1]
            self.observers.handle(batch)
            self.handled += len(batch)
            self.publish()
        elif kind == "tick":
            _kind, t, progress, drops, errors = message
            obs = self.observers
            obs.advance(t, progress)
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
            self.goodbye = True
            return False
        return True

    def publish(self) -> None:
        from kvobs_otel.telemetry import export

        exported, dropped, _errors = export.STATS.snapshot()
        OWN.pack_into(self.shm, 0, self.handled, exported, sum(dropped.values()))

    def finish(self) -> int:
        from kvobs_otel.lifecycle import records as rec

        obs = self.observers
        if obs is not None:
            if self.goodbye:
                obs.close(rec.END_PROCESS_EXIT, FINAL_SPANS_S, FINAL_METRICS_S)
            else:
                unsent = self.unsent()
                if unsent:  # (vLLM's own force kill at shutdown often loses nothing)
                    logger.warning(
                        "kvobs-otel sidecar: vLLM process %d ended without closing (killed); "
                        "%d events it recorded never reached this sidecar; what it had open "
                        "ends as abandoned (process_killed)", obs.pid, unsent)
                obs.end_open(rec.END_PROCESS_KILLED)  # (before the span of its window)
                obs.process_killed(unsent)
                obs.close(rec.END_PROCESS_KILLED, FINAL_SPANS_S, FINAL_METRICS_S)
        self.publish()
        return 0


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(argv) != 3:
        print("usage: python -m kvobs_otel.sidecar RFD SHMFD LIFEFD (started by kvobs-otel, "
              "not by hand)", file=__import__("sys").stderr)
        return 2
    rfd, shm_fd, life_fd = map(int, argv)
    if not os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "").strip():
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = SCHEDULE_DELAY_MS
    # Out of the vLLM process's tree: the intermediate exits at once and the
    # sidecar is adopted (module docstring).
    if os.fork():
        os._exit(0)
    # Held open until exit. (OSError: the vLLM process let go already.)
    with contextlib.suppress(OSError):
        os.write(life_fd, struct.pack("<Q", os.getpid()))
    logging.basicConfig(format=f"%(levelname)s kvobs-otel sidecar[{os.getpid()}] %(message)s",
                        level=logging.WARNING)
    return Sidecar(rfd, shm_fd).run()
