"""Frames on the pipe from a vLLM process to its sidecar.

A frame is a 4-byte big-endian length and a pickle of one message tuple:

- ``("hello", settings, pid, clock_offset_ns)``: first, once per sidecar;
- ``("events", [event, ...])``: event tuples as the seams offered them, and
  the controls ``(0, REGISTER, key, spec, resource, stepped)`` and
  ``(0, CLOSE, key)`` in their place among them;
- ``("tick", t_ns, progress, drops, errors)``: the schedulers' step counts
  as of ``t_ns`` (the vLLM process's monotonic clock) and the vLLM
  process's own loss and error counts, when they changed;
- ``("end",)``: flush and exit (pipe EOF means the same).

Pickle is safe here: the pipe is anonymous and its only writer is the
parent that started the sidecar.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator
from typing import Any

from kvobs_otel.observers import CLOSE, CONTROL_KEY, REGISTER  # noqa: F401 (re-exported)

_LEN = struct.Struct(">I")
MAX_FRAME = 1 << 30



def frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Reassembles messages from the chunks ``os.read`` returns."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> Iterator[tuple[Any, ...]]:
        buf = self._buf
        buf += chunk
        while len(buf) >= 4:
            (n,) = _LEN.unpack_from(buf)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes")
            if len(buf) < 4 + n:
                break
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            yield pickle.loads(body)

    @property
    def partial(self) -> bool:
        return bool(self._buf)
