"""The export sidecar's own behaviour: framing, delivery, identity, and every
way it can fail (cannot start, crashes, stalls, its parent dies).

Real parts: the real sidecar process (``python -m kvobs_otel.sidecar``), the
real lifecycle, builders and OTLP/HTTP exporters inside it, and an OTLP
receiver in this process. The events are the worker role's event tuples,
made here (the real-vLLM harness drives the same path in
test_vllm_sidecar.py); the vLLM-side checks are there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kvobs_otel import identity
from kvobs_otel.config import Settings
from kvobs_otel.lifecycle import events as ev
from kvobs_otel.lifecycle.worker_state import WorkerLifecycle
from kvobs_otel.pipeline import Pipeline
from kvobs_otel.sidecar import link as link_mod
from kvobs_otel.sidecar import wire

from otel_servers import wait_for
from otlp_receiver import HttpReceiver, latest_total, metric_values, received_ids

SETTINGS = Settings(enabled=True, drain_interval_s=0.02)


@pytest.fixture
def rx(monkeypatch):
    with HttpReceiver() as receiver:
        for k, v in {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                     "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                     "OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_METRIC_EXPORT_INTERVAL": "200",
                     "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}.items():
            monkeypatch.setenv(k, v)
        yield receiver


def worker(pipeline: Pipeline, rank: int = 0) -> tuple[int, str]:
    gen = identity.new_generation()
    key = pipeline.register((WorkerLifecycle, {"rank": rank, "worker_gen": gen}),
                            {"kvobs.role": "worker", "kvobs.rank": rank})
    return key, gen


def transfers(pipeline: Pipeline, key: int, first_job: int, n: int) -> None:
    """``n`` load jobs of one rank, each submitted and finished: one
    ``kv.transfer`` span each (ordinary traffic, every trace kept)."""
    offer, now, sched = pipeline.offer, time.monotonic_ns, "sched-gen"
    loads = tuple((j, f"req-{j}", False, 4) for j in range(first_job, first_job + n))
    assert offer((key, ev.W_STEP, now(), (sched, {}, {}, loads, (), ())))
    for j, _r, _s, _b in loads:
        assert offer((key, ev.W_SUBMIT, now(), j, True, True, False))
        assert offer((key, ev.W_RESULT, now(), j, True, 4096, None))


def exited(pid: int) -> bool:
    """Gone, or a zombie until its parent (init: a sidecar is nobody's
    child) reaps it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def transfer_spans(rx: HttpReceiver) -> list:
    with rx.store.lock:
        return [s for s in rx.store.spans if s.name == "kv.transfer"]


def test_frames_survive_any_split():
    messages = [("hello", SETTINGS, 1, 2), ("events", [(1, 2, 3, "x" * 70000)]), ("end",)]
    data = b"".join(wire.frame(m) for m in messages)
    for step in (1, 3, 4096, len(data)):
        reader = wire.FrameReader()
        got = [m for i in range(0, len(data), step) for m in reader.feed(data[i:i + step])]
        assert got == messages and not reader.partial


def test_spans_leave_from_the_sidecar_under_the_vllm_process_identity(rx):
    p = Pipeline(SETTINGS)
    assert p.link is not None and p.local is None  # the default
    sidecar = p.link.pid
    key, gen = worker(p, rank=1)
    transfers(p, key, 0, 50)
    p.close()
    spans = transfer_spans(rx)
    assert len(spans) == 50
    # The resource names the vLLM process (this one), not the sidecar.
    assert {s.resource["process.pid"] for s in spans} == {os.getpid()} != {sidecar}
    assert {(s.attributes["kvobs.rank"], s.attributes["kvobs.worker.generation"])
            for s in spans} == {(1, gen)}
    # What the sidecar says it delivered is what arrived; the process meter
    # says which process and how it exports.
    assert latest_total(rx, "kvobs.observer.exported", signal="spans") == len(
        received_ids(rx))
    (inst,) = {i for i, _ in metric_values(rx, "kvobs.observer.exported")}
    assert inst.endswith(f":{os.getpid()}:process")
    # Closing waited for the sidecar: it has exited.
    assert p.link.proc is None


def test_a_drain_cycle_is_one_write_and_a_partial_write_counts_whole_frames(rx, monkeypatch):
    """Every blocking call of the drain thread gives the GIL up and takes it
    back from vLLM's busy thread: a cycle writes its batches and the counts
    at once. And a write that fails part-way counts each event exactly: the
    frames wholly in the pipe as written, the rest as lost."""
    p = Pipeline(Settings(enabled=True, drain_interval_s=60.0))  # cycles by hand
    try:
        key, _ = worker(p)
        # Only this test drains: the drain thread's first wake (a registration
        # wakes it) must not take part of the batches below.
        p._stop = True
        p._wake.set()
        p._thread.join(10)
        p.flush()
        writes: list[int] = []
        real_write = os.write

        def spy(fd, data):
            writes.append(len(data))
            return real_write(fd, data)
        monkeypatch.setattr(link_mod.os, "write", spy)
        transfers(p, key, 0, 3000)  # 6001 events: two batches of the buffer's drain
        p.registered[key] = (*p.registered[key][:2], lambda: 7)  # and a progress tick
        p.link._sent_counts = None
        p.flush()
        assert len(writes) == 1, writes
        wait_for(lambda: len(transfer_spans(rx)) == 3000, "the cycle's spans")
        assert p.link.lost == 0 and p.link.written >= 6001

        # A write the pipe takes only part of, then EPIPE: the first frame was
        # wholly written, the second not.
        written, lost = p.link.written, p.link.lost
        frames = [wire.frame(("events", [(key, ev.W_RESULT, 0, 1, True, 1, None)] * n))
                  for n in (5, 7)]
        calls = []

        def partial(fd, data):
            if calls:
                raise BrokenPipeError
            calls.append(1)
            return real_write(fd, bytes(data[:len(frames[0]) + 3]))
        monkeypatch.setattr(link_mod.os, "write", partial)
        monkeypatch.setattr(link_mod.SidecarLink, "_start", lambda self: False)
        assert not p.link._write_frames([(frames[0], 5), (frames[1], 7)])
        assert (p.link.lost - lost) >= 7  # the second frame, whatever the sidecar handled
        assert p.link.written == 0  # the failed sidecar's account is closed
        # Exactly: what it never handled of what was written, plus the 7.
        assert p.link.lost - lost == 7 + max(0, written + 5 - p.link._handled())
    finally:
        monkeypatch.undo()
        p.close()


def test_sidecar_in_its_own_session_ignores_ctrl_c(rx):
    p = Pipeline(SETTINGS)
    pid = p.link.pid
    try:
        # A terminal's Ctrl-C goes to its foreground process group: not the
        # sidecar's (its own session).
        # (its session is the intermediate's that started it, already gone)
        assert os.getsid(pid) == os.getpgid(pid) != os.getsid(0)
        assert os.getpgid(pid) != os.getpgid(0)
        key, _ = worker(p)
        transfers(p, key, 0, 5)
        p.flush()
        wait_for(lambda: len(transfer_spans(rx)) == 5, "the sidecar's first spans")
        # Sent to it directly, once it runs: ignored (its end is its parent's).
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
        transfers(p, key, 5, 5)
        p.flush()
        wait_for(lambda: len(transfer_spans(rx)) == 10, "spans after SIGINT and SIGTERM")
        assert p.link.pid == pid and p.link._alive()
    finally:
        p.close()


def test_killed_sidecar_is_restarted_and_its_loss_counted(rx):
    p = Pipeline(SETTINGS)
    key, _ = worker(p)
    transfers(p, key, 0, 10)
    p.flush()
    wait_for(lambda: len(transfer_spans(rx)) == 10, "the first sidecar's spans")
    first = p.link.pid
    # Stop it reading, write what it will never handle, then kill it.
    os.kill(first, signal.SIGSTOP)
    transfers(p, key, 10, 7)
    p.flush()
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: (p.drain_once(), p.link.pid not in (None, first))[1],
             "a new sidecar")
    lost = 1 + 2 * 7  # the step, and each job's submit and result
    assert p.drop_counts()["sidecar_lost"] == lost
    assert p.error_counts()["sidecar"] == 1
    # The new sidecar knows the role (registered again) and reports the loss.
    transfers(p, key, 17, 4)
    p.flush()
    wait_for(lambda: latest_total(rx, "kvobs.observer.dropped", reason="sidecar_lost") == lost,
             "the loss reported by the new sidecar")
    p.close()
    jobs = {s.attributes["kvobs.job.id"] for s in transfer_spans(rx)}
    assert jobs == set(range(10)) | set(range(17, 21))


def test_stalled_sidecar_is_killed_and_the_serving_side_never_waits(rx, monkeypatch):
    monkeypatch.setattr(link_mod, "STALL_S", 1.0)
    monkeypatch.setattr(link_mod, "PIPE_BYTES", 4096)  # fill the pipe quickly
    p = Pipeline(Settings(enabled=True, drain_interval_s=0.02, buffer_size=256))
    key, _ = worker(p)
    first = p.link.pid
    os.kill(first, signal.SIGSTOP)
    try:
        # The serving side keeps offering while the drain thread waits on the
        # full pipe: every offer returns at once, the surplus is dropped.
        worst = 0.0
        for i in range(200):
            t = time.perf_counter()
            p.offer((key, ev.W_SUBMIT, time.monotonic_ns(), 10_000 + i, True, True, False))
            worst = max(worst, time.perf_counter() - t)
            time.sleep(0.005)
        wait_for(lambda: p.link.pid not in (None, first), "the stalled sidecar replaced")
        assert p.link._alive()
        assert exited(first)  # killed
        assert p.error_counts()["sidecar"] == 1
        assert p.drop_counts()["sidecar_lost"] > 0
        assert worst < 0.05, worst  # an offer is a deque append, never a wait
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first, signal.SIGKILL)  # never left stopped
        p.close()


def test_close_is_bounded_when_the_sidecar_stalls(rx, monkeypatch):
    """Shutdown with a sidecar that reads nothing (stopped) and a full pipe:
    the vLLM process still leaves within the documented bound."""
    from kvobs_otel.pipeline import CLOSE_TIMEOUT_S, METRICS_CLOSE_TIMEOUT_S

    monkeypatch.setattr(link_mod, "PIPE_BYTES", 4096)
    p = Pipeline(Settings(enabled=True, drain_interval_s=0.02))
    key, _ = worker(p)
    pid = p.link.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        transfers(p, key, 0, 2000)  # far more than the pipe holds
        t0 = time.monotonic()
        p.close()
        closing = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert closing < CLOSE_TIMEOUT_S + METRICS_CLOSE_TIMEOUT_S + 1.0, closing
    assert p.error_counts()["sidecar"] == 0  # not restarted while closing
    assert p.drop_counts()["sidecar_lost"] > 0


def test_sidecar_that_cannot_start_falls_back_in_process(rx, monkeypatch, caplog):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    p = Pipeline(SETTINGS)
    key, _ = worker(p)
    # The first start and its restarts failed: the process exports itself.
    assert p.link is None and p.local is not None
    assert p.error_counts()["sidecar"] == link_mod.MAX_FAILURES + 1
    assert "now exports in-process" in caplog.text
    transfers(p, key, 0, 6)
    p.close()
    assert len(transfer_spans(rx)) == 6
    assert latest_total(rx, "kvobs.observer.errors", stage="sidecar") == 4


def test_crash_loop_is_bounded_then_in_process(rx, monkeypatch):
    p = Pipeline(SETTINGS)
    key, _ = worker(p)
    transfers(p, key, 0, 3)
    pids: list[int] = []
    for _ in range(link_mod.MAX_FAILURES + 1):
        pids.append(p.link.pid)
        os.kill(pids[-1], signal.SIGKILL)
        wait_for(lambda: (p.drain_once(), p.link is None or p.link.pid != pids[-1])[1],
                 "the sidecar's end noticed")
    assert len(set(pids)) == link_mod.MAX_FAILURES + 1
    assert p.link is None and p.local is not None  # no fifth sidecar
    transfers(p, key, 100, 2)
    p.close()
    assert {100, 101} <= {s.attributes["kvobs.job.id"] for s in transfer_spans(rx)}


def test_a_cycle_that_falls_back_in_process_mid_write_still_counts_every_event(rx, monkeypatch):
    """The last allowed failure happens in the first of a cycle's writes (a
    cycle carrying more than the pipe): the link is given up on, and what
    the rest of that cycle held is still counted, on the retired link."""
    p = Pipeline(Settings(enabled=True, drain_interval_s=60.0))  # cycles by hand
    try:
        key, _ = worker(p)
        p.flush()
        wait_for(lambda: p.link._handled() == p.link.written, "the registration handled")
        p.link.failures = [time.monotonic()] * link_mod.MAX_FAILURES  # budget spent
        before = p.own_drops()["sidecar_lost"]

        def epipe(fd, data):
            raise BrokenPipeError
        monkeypatch.setattr(link_mod.os, "write", epipe)
        offered = 0
        for j in range(6000):  # ~0.4 kB each (distinct: pickle would share one)
            offered += p.offer((key, ev.W_RESULT, 0, j, True, 1, f"{j:0400d}"))
        p.flush()
        assert p.link is None and p.local is not None  # fell back in-process
        assert p.own_drops()["sidecar_lost"] - before == offered
    finally:
        monkeypatch.undo()
        p.close()


UNSENT = 7  # events the parent offers after its drain thread stopped
PARENT = textwrap.dedent("""
    import os, sys, time
    sys.path[:0] = {paths!r}
    from test_sidecar import SETTINGS, UNSENT, transfers, worker
    from kvobs_otel.lifecycle import events as ev
    from kvobs_otel.pipeline import get_pipeline
    p = get_pipeline(SETTINGS)  # the process's pipeline, as the seams get it
    key, _ = worker(p)
    transfers(p, key, 0, 40)
    # One transfer still in flight (submitted, no result yet).
    now = time.monotonic_ns
    p.offer((key, ev.W_STEP, now(), ("sched-gen", {{}}, {{}}, ((99, "req-99", False, 4),), (), ())))
    p.offer((key, ev.W_SUBMIT, now(), 99, True, True, False))
    p.flush()
    # The drain thread stops: what is offered now stays in this process.
    p._stop = True
    p._wake.set()
    p._thread.join()
    for j in range(UNSENT):
        p.offer((key, ev.W_SUBMIT, now(), 1000 + j, True, True, False))
    print(p.link.pid, flush=True)
    how = {how!r}
    if how == "fork_then_sigkill":
        # A child forked now (vLLM forks workers) lives on: it must not hold
        # the sidecar's pipe open, or the sidecar would wait for it.
        if os.fork() == 0:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)  # not holding the test's capture open either
            os.dup2(null, 2)
            time.sleep(60)
            os._exit(0)
        how = "sigkill"
    if how == "vllm_kill_process_tree":
        time.sleep(60)  # the test kills this process's tree, as vLLM's shutdown does
    if how == "os_exit":
        os._exit(0)
    elif how == "sigkill":
        os.kill(os.getpid(), 9)
    elif how == "sigterm":
        import signal
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # as vLLM's workers
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
""")


@pytest.mark.parametrize("how", ["os_exit", "sigkill", "sigterm", "fork_then_sigkill",
                                 "vllm_kill_process_tree"])
def test_parent_death_flushes_on_pipe_eof(rx, how, tmp_path):
    """The sidecar outlives a parent that leaves by ``os._exit`` or SIGKILL
    (no atexit, no shutdown), and vLLM's own kill of the parent's whole
    process tree (its shutdown's force kill), and flushes everything it was
    handed; what it was not handed is counted, and the open work says why
    it ended."""
    here = os.path.dirname(__file__)
    code = PARENT.format(paths=[here, os.path.dirname(here)], how=how)
    # Files, not pipes: the sidecar inherits them, and the test must not wait
    # for it (or for a forked child) to let go of a pipe.
    log = tmp_path / "parent.out"
    with open(log, "w") as f:
        # Nothing leaves before the end: what arrives, the flush at EOF sent.
        env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "60000",
               "OTEL_METRIC_EXPORT_INTERVAL": "60000"}
        parent = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=f, env=env)
        if how == "vllm_kill_process_tree":
            # vLLM's real function (vllm/utils/system_utils.py, 0.32-0.34): SIGKILL
            # to every descendant psutil finds, then the process.
            from vllm.utils.system_utils import kill_process_tree

            wait_for(lambda: log.read_text().strip(), "the parent's sidecar pid")
            sidecar = int(log.read_text().split()[0])
            assert sidecar not in {c.pid for c in psutil.Process(parent.pid).children(
                recursive=True)}  # not in the tree vLLM kills
            kill_process_tree(parent.pid)
        parent.wait(120)

    class out:  # what the parent wrote
        stdout = stderr = log.read_text()

    sidecar = int(out.stdout.split()[0])
    killed = how != "sigterm"
    # Well within the forked child's 60 s: the pipe's end, not the child's.
    # 40 finished transfers and the one in flight, ended by the process's end.
    wait_for(lambda: len(transfer_spans(rx)) == 41,
             lambda: f"41 spans after {how} ({len(transfer_spans(rx))}); {out.stderr[-2000:]}")
    wait_for(lambda: latest_total(rx, "kvobs.observer.exported", signal="spans") == 41 + killed,
             "the sidecar's final count")
    with rx.store.lock:
        spans = list(rx.store.spans)
    (cancelled,) = [s for s in spans if s.attributes.get("kvobs.job.id") == 99]
    # Not a failed transfer: its process stopped, and the span says how.
    assert cancelled.attributes["kvobs.outcome"] == "cancelled"
    assert cancelled.attributes["kvobs.end.cause"] == (
        "process_killed" if killed else "process_exit")
    assert not cancelled.error
    ends = [s for s in spans if s.name == "kv.process.end"]
    if killed:
        # The window in which its events never left it, and how many did not:
        # exactly those offered after its drain thread stopped.
        (end,) = ends
        assert end.attributes["kvobs.end.cause"] == "process_killed"
        assert end.attributes["kvobs.process.unsent_events"] == UNSENT
        assert end.attributes["kvobs.rank"] == 0 and not end.error
        assert end.start_ns <= cancelled.end_ns <= end.end_ns
        wait_for(lambda: latest_total(rx, "kvobs.observer.dropped",
                                      reason="process_killed") == UNSENT,
                 "the loss counted")
        # Said in vLLM's log too (the sidecar writes to the stderr it inherited).
        wait_for(lambda: f"{UNSENT} events it recorded never reached this sidecar"
                 in log.read_text(), "the sidecar's warning")
    else:
        # A goodbye: the exit drained everything, nothing is lost.
        assert not ends
    wait_for(lambda: exited(sidecar), "the sidecar to exit")
