"""The coordinator's side of B2's processes: zygotes and their forked
variant children (see benchmarks/b2_variant.py for the other side)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from typing import IO, Any

from benchmarks.common import REPO_ROOT, clean_env

STARTUP_TIMEOUT_S = 900.0
REPLY_TIMEOUT_S = 300.0


def _read(stream: IO[str], timeout: float, who: str, log: Any) -> dict[str, Any]:
    ready, _, _ = select.select([stream], [], [], timeout)
    line = stream.readline() if ready else ""
    msg = json.loads(line) if line else {"error": "no reply" if ready else "timed out"}
    if "error" in msg:
        log.seek(0)
        raise RuntimeError(f"B2 {who}: {msg['error']}\n{log.read()[-3000:]}")
    return msg


class Zygote:
    """A process with vLLM, torch and the harness imported, forking children."""

    def __init__(self, quick: bool) -> None:
        # The zygote's (and its children's) stderr, shown when one fails.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "benchmarks.b2_variant", "--zygote"]
        self.proc = subprocess.Popen(cmd + (["--quick"] if quick else []), cwd=REPO_ROOT,
                                     env=clean_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.fifo_dir = tempfile.mkdtemp(prefix="kvobs-bench-b2-")
        self._n = 0

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        _read(self.proc.stdout, STARTUP_TIMEOUT_S, "zygote", self.log)

    def fork(self, variant: str, reps: int, endpoint: str) -> ForkedChild:
        self._n += 1
        fifo_in = os.path.join(self.fifo_dir, f"{self._n}.in")
        fifo_out = os.path.join(self.fifo_dir, f"{self._n}.out")
        os.mkfifo(fifo_in)
        os.mkfifo(fifo_out)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cmd": "fork", "variant": variant, "reps": reps,
                                          "endpoint": endpoint, "fifo_in": fifo_in,
                                          "fifo_out": fifo_out}) + "\n")
        self.proc.stdin.flush()
        pid = _read(self.proc.stdout, REPLY_TIMEOUT_S, "zygote", self.log)["pid"]
        return ForkedChild(variant, pid, fifo_in, fifo_out, self.log)

    def warnings(self) -> list[str]:
        """kvobs-otel's own warning lines in the children's stderr (distinct)."""
        self.log.seek(0)
        lines = [ln.strip() for ln in self.log if "kvobs-otel:" in ln]
        return list(dict.fromkeys(lines))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for name in os.listdir(self.fifo_dir):
            os.unlink(os.path.join(self.fifo_dir, name))
        os.rmdir(self.fifo_dir)
        self.log.close()


class ForkedChild:
    def __init__(self, variant: str, pid: int, fifo_in: str, fifo_out: str, log: Any) -> None:
        self.variant, self.pid, self.log = variant, pid, log
        # Same order as the child opens them (in, then out).
        self.fin: IO[str] = open(fifo_in, "w", buffering=1)  # noqa: SIM115
        self.fout: IO[str] = open(fifo_out)  # noqa: SIM115
        self.ns: list[int] = []
        self.done = False
        self.alive = True

    def send(self, obj: dict[str, Any]) -> None:
        self.fin.write(json.dumps(obj) + "\n")
        self.fin.flush()

    def read(self, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        return _read(self.fout, timeout, f"{self.variant} child", self.log)

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)

    def finish(self) -> dict[str, Any]:
        self.signal(signal.SIGCONT)
        self.send({"cmd": "finish"})
        msg = self.read()
        self.alive = False  # it exits after this reply; the zygote reaps it
        return msg

    def kill(self) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.alive = False
        for f in (self.fin, self.fout):
            with contextlib.suppress(OSError):
                f.close()
