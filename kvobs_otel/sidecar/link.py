"""The vLLM process's end of its sidecar: start it, write to it, watch it.

Started with ``subprocess`` (fork+exec of this Python, ``-m
kvobs_otel.sidecar``), not ``multiprocessing``: vLLM's workers are daemonic
``multiprocessing`` processes, which may not have children of their own
through ``multiprocessing``, and an exec'd child inherits none of vLLM's
threads, locks or CUDA state.

The sidecar is not this process's child (``main.py``: an intermediate
process forks it and exits), so that vLLM's kill of this process's tree
cannot reach it; a ``life`` pipe whose write end only the sidecar holds
tells this process its pid and when it exits.

Failure policy (docs/architecture.md, "The export sidecar"):

- every event the sidecar never handled is counted ``sidecar_lost``: those in
  a write that failed, and those written but not handled when it died (it
  publishes how many it handled in a shared counter);
- a sidecar that stops reading for ``STALL_S`` while the pipe is full is
  killed and counted like a crash; meanwhile the drain thread waits, the
  buffer fills, and the serving side drops and counts ``buffer_full``;
- a failed sidecar is restarted at once, at most ``MAX_FAILURES`` times in
  ``FAILURE_WINDOW_S``; past that, the process exports in-process (one
  warning), as with ``KVOBS_OTEL_EXPORT=in-process``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Protocol

from kvobs_otel.clock import wall_anchor_ns
from kvobs_otel.sidecar import wire
from kvobs_otel.sidecar.main import ACCEPTED_AT, BASE_AT, SHARED


class LinkOwner(Protocol):
    """What the link needs of its pipeline (kvobs_otel.pipeline.Pipeline),
    named here so that the link does not import the pipeline: the pipeline
    holds the link, not the other way round."""

    settings: Any
    buffer: Any  # buffer.EventBuffer
    registered: dict[int, tuple[Any, dict[str, Any], Any]]

    def wake(self) -> None: ...
    def count_error(self, stage: str, quiet: bool = False) -> None: ...
    def own_drops(self) -> dict[str, int]: ...
    def own_errors(self) -> dict[str, int]: ...
    def fall_back_in_process(self) -> None: ...


logger = logging.getLogger("kvobs_otel")

STALL_S = 10.0
MAX_FAILURES = 3
FAILURE_WINDOW_S = 300.0
POLL_S = 1.0  # how often an idle drain cycle checks that the sidecar lives
# A larger pipe absorbs bursts while the sidecar is busy (Linux; best effort).
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
SHARED_Q = struct.Struct("<Q")
# The sidecar's ends of its pipes while this process still holds them (during
# its start): a process forked meanwhile (vLLM forks workers) must not keep
# them open, or the sidecar would never see EOF nor this process its exit.
_TRANSIENT: set[int] = set()


def _close_transient() -> None:
    for fd in list(_TRANSIENT):
        with contextlib.suppress(OSError):
            os.close(fd)
    _TRANSIENT.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_transient)


class SidecarLink:
    def __init__(self, pipeline: LinkOwner) -> None:
        self.pipeline = pipeline
        self.proc: subprocess.Popen[bytes] | None = None  # the intermediate
        self.fd = -1
        self._life = -1  # read end of the life pipe (EOF: the sidecar exited)
        self._sidecar_pid: int | None = None
        self._life_buf = b""
        self._life_lock = threading.Lock()
        self._shm: mmap.mmap | None = None
        self.written = 0  # events in frames wholly written to the current sidecar
        self.lost = 0  # events no sidecar handled
        self.failures: list[float] = []
        self._sent_counts: Any = None
        # Ended when the process's last role closed; a role made after that
        # starts a new sidecar (on the drain thread, the only writer).
        self.ended = False
        # Set when the process is closing: no write waits past it.
        self.closing_by = float("inf")
        self._next_poll = 0.0
        # The write in progress: its frames (bytes, events) and bytes sent.
        self._inflight: list[tuple[int, int]] = []
        self._sent = 0

    def start(self) -> None:
        """Start the first sidecar (after the pipeline holds this link: a
        failure past the budget hands the pipeline back to in-process)."""
        self._start()

    # -- what the pipeline reads ---------------------------------------------------
    def drops(self) -> dict[str, int]:
        return {"sidecar_lost": self.lost}

    @property
    def pid(self) -> int | None:
        """The sidecar's pid (it says it as it starts: waited for, briefly;
        None when there is no sidecar)."""
        deadline = time.monotonic() + 5.0
        while self._sidecar_pid is None and time.monotonic() < deadline and self._alive(0.05):
            pass
        return self._sidecar_pid

    def _alive(self, wait_s: float = 0.0) -> bool:
        """Whether the sidecar may still run: its life pipe has not ended
        (waiting up to ``wait_s`` for it to end). Reads the sidecar's pid when
        it arrives; reaps the intermediate. Any thread (the drain thread, a
        closing one): the reads are serialised, the waits are short slices."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._life_lock:
                alive = self._read_life()
                fd = self._life
            left = deadline - time.monotonic()
            if not alive or left <= 0:
                return alive
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile: look again
                select.select([fd], [], [], min(left, 0.05))

    def _read_life(self) -> bool:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.poll()
        while self._life >= 0:
            try:
                data = os.read(self._life, 64)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:  # EOF: the sidecar exited
                os.close(self._life)
                self._life = -1
                break
            self._life_buf += data
            if self._sidecar_pid is None and len(self._life_buf) >= 8:
                self._sidecar_pid = int.from_bytes(self._life_buf[:8], "little")
        return False

    # -- start ------------------------------------------------------------------------
    def _start(self) -> bool:
        rfd = life_w = -1
        try:
            rfd, wfd = os.pipe()
            _TRANSIENT.add(rfd)
            life_r, life_w = os.pipe()
            _TRANSIENT.add(life_w)
            with contextlib.suppress(OSError):
                fcntl.fcntl(wfd, _F_SETPIPE_SZ, PIPE_BYTES)
            with tempfile.TemporaryFile() as shm_file:
                shm_file.truncate(SHARED.size)
                shm_fd = shm_file.fileno()
                self._shm = shm = mmap.mmap(shm_fd, SHARED.size)
                # Events drained before this sidecar are not its to handle.
                buffer = self.pipeline.buffer
                SHARED_Q.pack_into(shm, BASE_AT, max(0, buffer.accepted - len(buffer)))
                buffer.count_into(memoryview(shm)[ACCEPTED_AT:ACCEPTED_AT + 8].cast("Q"))
                env = dict(os.environ)
                # The child imports this very copy of kvobs_otel.
                root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (root, env.get("PYTHONPATH", "")) if p)
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "kvobs_otel.sidecar", str(rfd), str(shm_fd),
                     str(life_w)],
                    pass_fds=(rfd, shm_fd, life_w), stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True)
            for fd in (rfd, life_w):
                _TRANSIENT.discard(fd)
                os.close(fd)
            os.set_blocking(wfd, False)
            os.set_blocking(life_r, False)
            self.fd, self.written = wfd, 0
            with self._life_lock:
                self._life, self._sidecar_pid, self._life_buf = life_r, None, b""
        except Exception:
            for fd in (rfd, life_w):
                if fd in _TRANSIENT:
                    _TRANSIENT.discard(fd)
                    with contextlib.suppress(OSError):
                        os.close(fd)
            logger.warning("kvobs-otel: could not start the export sidecar", exc_info=True)
            return self._failed()
        from kvobs_otel.observers import CONTROL_KEY, REGISTER

        p = self.pipeline
        hello = ("hello", p.settings, os.getpid(), wall_anchor_ns())
        # A restarted sidecar is told every role still registered.
        # (list(): a role may register on vLLM's thread meanwhile)
        controls = [(CONTROL_KEY, REGISTER, key, spec, resource, progress is not None)
                    for key, (spec, resource, progress) in list(p.registered.items())]
        self._sent_counts = None
        return self._write(wire.frame(hello)) and (
            not controls or self.send_events(controls))

    # -- writing ----------------------------------------------------------------------
    def register(self, key: int, spec: Any, resource: dict[str, Any], progress: bool) -> None:
        from kvobs_otel.observers import CONTROL_KEY, REGISTER

        # Among the events, so it precedes the role's first one; never
        # dropped (a control does not count against the bound).
        self.pipeline.buffer.put_control((CONTROL_KEY, REGISTER, key, spec, resource, progress))
        self.pipeline.wake()

    def _restart_if_ended(self) -> None:
        if self.ended and self.pipeline.registered:
            self.ended = False
            self._start()

    def close_observer(self, key: int) -> None:
        from kvobs_otel.observers import CLOSE, CONTROL_KEY

        self.send_events([(CONTROL_KEY, CLOSE, key)])

    def check(self) -> None:
        """Once per drain cycle, before ``send``: at most once a second
        (waitpid) notice a dead sidecar (a write notices it too, by EPIPE).
        May hand the pipeline back to in-process (past the restart budget)."""
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + POLL_S
            if self.proc is not None and not self._alive():
                self._failed()

    def send_events(self, batch: list[tuple[Any, ...]]) -> bool:
        return self.send([batch], None)

    def send(self, batches: list[list[tuple[Any, ...]]],
             mark: tuple[int, dict[int, int]] | None) -> bool:
        """What one drain cycle has for the sidecar: the event batches, then
        (``mark`` given: a drain cycle) the counts and step progress if
        they changed, in as few writes as the pipe takes (usually one): every
        blocking call gives up the GIL and takes it back from vLLM's busy
        serving thread, which costs both threads far more than the call."""
        self._restart_if_ended()
        group: list[tuple[bytes, int]] = []
        size, ok = 0, True
        for batch in batches:
            if self.fd < 0:  # no sidecar (a write of this cycle failed)
                self.lost += len(batch)
                ok = False
                continue
            try:
                data = wire.frame(("events", batch))
            except Exception:
                # An event that does not pickle is an observer bug: count it.
                self.pipeline.count_error("seam")
                self.lost += len(batch)
                ok = False
                continue
            if group and size + len(data) > PIPE_BYTES:
                ok = self._write_frames(group) and ok
                group, size = [], 0
            group.append((data, len(batch)))
            size += len(data)
        if mark is not None and self.fd >= 0:
            p = self.pipeline
            counts = (mark[1], p.own_drops(), p.own_errors())
            if counts != self._sent_counts:
                self._sent_counts = counts
                group.append((wire.frame(("tick", mark[0], *counts)), 0))
        return (self._write_frames(group) if group else True) and ok

    def _write_frames(self, frames: list[tuple[bytes, int]]) -> bool:
        if self.fd < 0:
            self.lost += sum(n for _, n in frames)
            return False
        return self._write(b"".join(f for f, _ in frames), [(len(f), n) for f, n in frames])

    def _write(self, data: bytes, frames: list[tuple[int, int]] | None = None) -> bool:
        """Write ``data`` (``frames``: its frames' sizes and event counts, so
        the events of frames wholly written count as written, the others as
        lost, whatever happens)."""
        self._inflight, self._sent = frames or [], 0
        view = memoryview(data)
        stall_at = time.monotonic() + STALL_S
        while view:
            try:
                n = os.write(self.fd, view)
                view = view[n:]
                self._sent += n
            except BlockingIOError:
                # closing_by read anew each wait: a close that starts while
                # the drain thread waits here bounds this wait too.
                deadline = min(stall_at, self.closing_by)
                left = deadline - time.monotonic()
                if left <= 0 and deadline >= self.closing_by:
                    self._settle()
                    return False  # closing: abandoned (counted), no restart
                if left <= 0:
                    logger.warning("kvobs-otel: the export sidecar (pid %s) read nothing for "
                                   "%.0f s; killing it", self.pid, STALL_S)
                    self._failed(kill=True)
                    return False
                select.select([], [self.fd], [], min(left, 0.5))
            except OSError:
                self._failed()  # EPIPE: the sidecar is gone
                return False
        self._settle()
        return True

    def _settle(self) -> None:
        """Account the events of the last write's frames."""
        sent = self._sent
        for size, events in self._inflight:
            if sent >= size:
                self.written += events
                sent -= size
            else:
                self.lost += events
                sent = 0
        self._inflight, self._sent = [], 0

    # -- failure ----------------------------------------------------------------------
    def sidecar_counts(self) -> dict[str, int]:
        """What the current (or last) sidecar published: events handled,
        spans delivered, observations dropped on its side."""
        try:
            values = SHARED.unpack_from(self._shm, 0)[:3] if self._shm is not None else (0, 0, 0)
        except Exception:
            values = (0, 0, 0)
        return dict(zip(("handled", "exported", "dropped"), values, strict=True))

    def _handled(self) -> int:
        return self.sidecar_counts()["handled"]

    def _drop_current(self, kill: bool) -> None:
        """Let go of the current sidecar, counting what it never handled."""
        self._settle()  # a write it failed: its whole frames reached the pipe
        proc = self.proc
        if proc is not None and kill and self._alive():  # (alive: its pid is still its own)
            with contextlib.suppress(OSError):
                os.kill(self.pid or proc.pid, signal.SIGKILL)  # (or the intermediate)
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        if proc is not None:
            self._alive(1.0 if kill else 0.0)  # (returns once it is gone, or at the time)
            self.lost += max(0, self.written - self._handled())
        self._close_life()
        self.proc, self.written = None, 0

    def _close_life(self) -> None:
        with self._life_lock:
            if self._life >= 0:
                with contextlib.suppress(OSError):
                    os.close(self._life)
            self._life, self._sidecar_pid = -1, None

    def _failed(self, kill: bool = False) -> bool:
        alive = self.proc is not None and self._alive()
        self._drop_current(kill or alive)
        self.pipeline.count_error("sidecar", quiet=True)  # said below
        now = time.monotonic()
        self.failures = [t for t in self.failures if now - t < FAILURE_WINDOW_S] + [now]
        if len(self.failures) > MAX_FAILURES:
            logger.warning("kvobs-otel: the export sidecar failed %d times in %.0f s; this "
                           "process now exports in-process", len(self.failures),
                           FAILURE_WINDOW_S)
            self.pipeline.fall_back_in_process()
            return False
        logger.warning("kvobs-otel: the export sidecar is gone%s; restarting it "
                       "(%d of %d failures allowed in %.0f s)",
                       " (killed: it stalled or wrote nothing)" if alive else "",
                       len(self.failures), MAX_FAILURES, FAILURE_WINDOW_S)
        return self._start()

    # -- end --------------------------------------------------------------------------
    def end(self, timeout_s: float) -> None:
        """Say goodbye to the sidecar and wait for it to finish at most
        ``timeout_s``: a clean stop of vLLM then finds everything delivered
        once vLLM is gone. Past that, or if vLLM kills this process while it
        waits, the sidecar finishes on its own (within its own bound,
        main.py) and counts and exports what it loses itself."""
        self.closing_by = min(self.closing_by, time.monotonic() + timeout_s)
        self.ended = True
        if self.fd >= 0:
            self._write(wire.frame(("end",)))
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.proc is not None:
            if self._alive(max(0.0, self.closing_by - time.monotonic())):
                logger.warning("kvobs-otel: the export sidecar (pid %s) is still flushing "
                               "after %.1f s; leaving it to finish", self.pid, timeout_s)
            else:
                self.lost += max(0, self.written - self._handled())
        self._close_life()
        self.proc, self.closing_by = None, float("inf")

    def retire(self) -> None:
        """Given up on (the pipeline exports in-process from now on)."""
        self._drop_current(kill=True)

    def forget(self) -> None:
        """In a forked child: close our copy of the pipes, touch nothing else."""
        for fd in (self.fd, self._life):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd, self._life, self.proc = -1, -1, None
