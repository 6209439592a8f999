"""Process-mode ranks: each rank's runner in its own OS process.

Like vLLM's multiproc executor, the engine side sends every rank the pickled
``SchedulerOutput`` over a pipe and gets the pickled ``ModelRunnerOutput``
back. The child applies its environment before importing vLLM (plugins and
env-driven settings are read at import/first use), installs its connector as
the process-global worker connector, and on exit (normal or error) calls the
connector's shutdown, as vLLM's worker does through
``ensure_kv_transfer_shutdown``.

This module must stay importable without vLLM: under ``spawn`` the child
imports it before the environment is set.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

# Seconds to wait for a rank to start / answer / exit before giving up.
START_TIMEOUT_S = 300.0
STEP_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 30.0


class RankProcessError(RuntimeError):
    """A rank process failed; carries the child's traceback."""


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _rank_main(conn: Connection, rank: int, env: dict[str, str], payload: bytes) -> None:
    # Environment first: nothing from vLLM is imported yet in a spawned child.
    os.environ.update(env)
    # As vLLM's WorkerProc: SIGTERM/SIGINT raise SystemExit, so the connector
    # is shut down (and what was observed flushed) on the way out.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    runner = None
    try:
        import torch

        # Ranks share 2 cores; also keeps forked children off the parent's
        # OpenMP pool.
        torch.set_num_threads(1)
        from vllm.distributed.kv_transfer import kv_transfer_state

        from kvobs_otel.tools.harness.runner import RankRunner

        init = pickle.loads(payload)
        runner = RankRunner(**init)
        # One connector per process: keep it installed, as vLLM's worker does.
        kv_transfer_state._KV_CONNECTOR_AGENT = runner.connector
        conn.send(("ready", os.getpid()))
        while True:
            op, arg = conn.recv()
            if op == "step":
                output = runner.execute(pickle.loads(arg))
                conn.send(("ok", pickle.dumps(output)))
            elif op == "call":
                # A failed query is answered, not fatal to the rank.
                try:
                    reply = ("ok", _call(runner, *arg))
                except Exception:
                    reply = ("error", f"rank {rank}:\n{traceback.format_exc()}")
                conn.send(reply)
            elif op == "shutdown":
                break
            elif op == "os_exit":
                os._exit(arg)
            else:
                raise ValueError(f"unknown op {op!r}")
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if runner is not None:
            try:
                runner.shutdown()
            finally:
                from vllm.distributed.kv_transfer import kv_transfer_state

                kv_transfer_state._KV_CONNECTOR_AGENT = None
        with contextlib.suppress(Exception):
            conn.send(("exited", None))
        conn.close()


def _call(runner: Any, name: str, *args: Any) -> Any:
    """Small read-mostly RPC surface for tests and demos."""
    worker = runner.offloading_worker
    if name == "stats":
        return asdict(runner.stats)
    if name == "withheld_job_ids":
        return list(getattr(worker, "withheld_job_ids", []))
    if name == "failed_job_ids":
        return list(getattr(worker, "failed_job_ids", []))
    if name == "transfer_log":
        return list(getattr(worker, "transfer_log", []))
    if name == "check_request_kv":
        return runner.check_request_kv(*args)
    if name == "pid":
        return os.getpid()
    if name == "env":
        # (now, at exec): a spawned rank's variable must already be in the
        # environment it was exec'd with for LD_PRELOAD-style ones to work.
        with open("/proc/self/environ", "rb") as f:
            pairs = (kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            at_exec = {k.decode(): v.decode(errors="replace") for k, v in pairs}
        return os.environ.get(args[0]), at_exec.get(args[0])
    if name == "observation":
        return _observation()
    if name == "calls":
        return list(getattr(runner.connector, "calls", []))
    if name == "connector_class":
        cls = type(runner.connector)
        return f"{cls.__module__}.{cls.__qualname__}"
    raise ValueError(f"unknown call {name!r}")


def _observation() -> dict[str, Any] | None:
    """Everything this rank recorded handed to its export side; where that
    runs and what this process counted."""
    from kvobs_otel.pipeline import current_pipeline

    p = current_pipeline()
    if p is None:
        return None
    p.flush()
    link = p.link
    return {"export": "sidecar" if link is not None else "in-process",
            "sidecar_pid": link.pid if link is not None else None,
            "buffered": len(p.buffer), "drops": p.drop_counts(), "errors": p.error_counts()}


class ProcessRank:
    """Engine-side handle of one rank process."""

    def __init__(
        self,
        rank: int,
        init: dict[str, Any],
        env: dict[str, str],
        start_method: str = "spawn",
    ) -> None:
        self.rank = rank
        ctx = mp.get_context(start_method)
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_rank_main,
            args=(child_conn, rank, env, pickle.dumps(init)),
            name=f"kvobs-harness-rank{rank}",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self._closed = False
        self._shutdown_sent = False

    def wait_ready(self) -> None:
        tag, value = self._recv(START_TIMEOUT_S)
        if tag != "ready":
            raise RankProcessError(f"rank {self.rank} did not start: {value}")

    def send_step(self, scheduler_output_blob: bytes) -> None:
        self._conn.send(("step", scheduler_output_blob))

    def recv_step(self) -> Any:
        tag, value = self._recv(STEP_TIMEOUT_S)
        if tag != "ok":
            raise RankProcessError(value)
        return pickle.loads(value)

    def call(self, name: str, *args: Any) -> Any:
        self._conn.send(("call", (name, *args)))
        tag, value = self._recv(STEP_TIMEOUT_S)
        if tag != "ok":
            raise RankProcessError(value)
        return value

    def exit_now(self, code: int = 0) -> None:
        """The rank leaves through ``os._exit`` at once (no shutdown, no
        atexit), as a worker killed mid-step by a C extension would."""
        self._conn.send(("os_exit", code))

    def _recv(self, timeout: float) -> tuple[str, Any]:
        if not self._conn.poll(timeout):
            raise RankProcessError(f"rank {self.rank}: no answer in {timeout:.0f}s")
        try:
            return self._conn.recv()
        except EOFError as e:
            raise RankProcessError(f"rank {self.rank} exited (code {self.process.exitcode})") from e

    def request_shutdown(self) -> None:
        """Tell the rank to shut its connector down and exit (non-blocking)."""
        if self._shutdown_sent or not self.process.is_alive():
            return
        self._shutdown_sent = True
        with contextlib.suppress(BrokenPipeError, EOFError, OSError):
            self._conn.send(("shutdown", None))

    def close(self) -> None:
        """Shut the rank down and reap it; force if it does not exit."""
        if self._closed:
            return
        self._closed = True
        self.request_shutdown()
        try:
            if self.process.is_alive():
                # Drain until the child says it has run its shutdown.
                while self._conn.poll(EXIT_TIMEOUT_S):
                    tag, _ = self._conn.recv()
                    if tag == "exited":
                        break
        except (BrokenPipeError, EOFError, OSError):
            pass
        self.process.join(EXIT_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(EXIT_TIMEOUT_S)
        self._conn.close()
