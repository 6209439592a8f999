"""``python -m benchmarks.stops [--runs 10] [--signal INT|TERM] [--kvobs-src DIR]``:
what an immediate stop of a real vLLM engine leaves of its traces (issue 31).

Each run is what a user does: ``vllm serve`` (the CPU build, TP 2, the tiny
model, the plugin on, spans to ``KVOBS_OTEL_TRACES_FILE``), 16 concurrent
completions, then Ctrl-C (SIGINT to the server's process group) the moment
the last response arrives, vLLM's shutdown settings untouched. Per run: the
preemptions vLLM counted, the episodes ``kvobs-otel check`` found in the
file, how many complete, incomplete (a failed receipt) and cut short by a
process stop. Not part of ``make bench`` (minutes per run, no ratio to
hold): it gives the before/after figures of the closing note.

``--busy N``: N busy-looping processes share the host during each run (a
node with other work: the issue's condition, where the sidecars ran seconds
behind).

``--otlp``: the OTLP exporters stay on beside the file, as a user who only
set ``KVOBS_OTEL_TRACES_FILE`` has them (the endpoint from the environment;
by default localhost:4317, where nothing may listen).

``--kvobs-src DIR``: vLLM's processes import kvobs_otel from DIR (another
checkout, e.g. a commit before the sidecar outlived vLLM); the file is
judged by this checkout's ``check`` either way. Needs vLLM's CPU build
(run it with the 0.32.0 environment's Python).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from kvobs_otel.tools.harness.client import run_load
from kvobs_otel.tools.harness.model_files import ensure_model
from kvobs_otel.tools.harness.server import (
    EngineServer,
    ServeConfig,
    engine_available,
    free_port,
)

SETTLE_S = 30.0  # the export sidecars finish after vLLM (bounded at 15 s)


def _settled(path: str, quiet_s: float = 3.0) -> None:
    """Until nobody holds the file (kvobs-otel's writers take a shared
    flock) and its size stays put for ``quiet_s`` (an older checkout's
    writers take no lock), at most SETTLE_S."""
    from kvobs_otel.telemetry.otlp_json import wait_for_writers

    t_end = time.monotonic() + SETTLE_S
    wait_for_writers(path, SETTLE_S)
    size, since = -1, time.monotonic()
    while time.monotonic() < t_end:
        now = os.path.getsize(path)
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.5)


def one_stop(model: str, out_dir: str, run: int, sig: signal.Signals,
             kvobs_src: str | None, otlp: bool = False) -> dict:
    traces = os.path.join(out_dir, f"stop-{run}.otlp.jsonl")
    open(traces, "w").close()  # noqa: SIM115
    env = dict(os.environ, KVOBS_OTEL_ENABLED="1", KVOBS_OTEL_TRACES_FILE=traces,
               KVOBS_OTEL_DEVICE_TYPE="cpu")
    if not otlp:
        env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    if kvobs_src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [kvobs_src, env.get("PYTHONPATH")]))
    server = EngineServer(ServeConfig(observe="plugin"), model, free_port(),
                          os.path.join(out_dir, f"stop-{run}.vllm.log"), env=env)
    try:
        server.wait_ready()
        result = run_load(server.base_url, n_requests=16, salt=f"stop-{run}")
        preemptions = int(server.metric("vllm:num_preemptions_total"))
        server.interrupt(sig)  # the moment the last response arrived
    finally:
        server.stop(signal.SIGTERM)
    forced = "force killing" in server.log_tail(400)
    _settled(traces)
    proc = subprocess.run([sys.executable, "-m", "kvobs_otel", "check", traces, "--json"],
                          capture_output=True, text=True, timeout=300)
    summary = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return {"run": run, "requests_ok": len(result.ok), "vllm_preemptions": preemptions,
            "episodes": summary.get("episodes", 0), "complete": summary.get("complete", 0),
            "incomplete": summary.get("incomplete", 0),
            "cut_short": len(summary.get("cut_short_episodes", [])),
            "check_exit": proc.returncode, "vllm_force_killed": forced}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stops", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--signal", choices=("INT", "TERM"), default="INT",
                    help="INT: Ctrl-C to the process group (default); TERM: to the server")
    ap.add_argument("--kvobs-src", help="import kvobs_otel in vLLM's processes from here")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="N busy-looping processes beside vLLM during each run")
    ap.add_argument("--otlp", action="store_true",
                    help="keep the OTLP exporters on (OTEL_EXPORTER_OTLP_* as in this "
                         "environment: by default localhost:4317), beside the file")
    ap.add_argument("-o", "--output", help="write the runs as JSON here")
    args = ap.parse_args(argv)
    missing = engine_available()
    if missing:
        print(f"python -m benchmarks.stops: {missing}", file=sys.stderr)
        return 2
    model = ensure_model()
    sig = signal.Signals[f"SIG{args.signal}"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvobs-stops-") as out_dir:
        for run in range(args.runs):
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(args.busy)]
            try:
                row = one_stop(model, out_dir, run, sig, args.kvobs_src, args.otlp)
            finally:
                for p in spinners:
                    p.kill()
                    p.wait()
            rows.append(row)
            print(json.dumps(row), flush=True)
    total = {k: sum(r[k] for r in rows) for k in
             ("vllm_preemptions", "episodes", "complete", "incomplete", "cut_short")}
    whole = sum(r["complete"] == r["vllm_preemptions"] and not r["incomplete"] for r in rows)
    print(f"{args.runs} stops (SIG{args.signal}, {args.busy} busy processes beside): "
          f"vLLM counted {total['vllm_preemptions']} "
          f"preemptions; exported {total['episodes']} episodes, {total['complete']} complete, "
          f"{total['incomplete']} incomplete, {total['cut_short']} cut short; "
          f"runs with every episode whole: {whole}/{args.runs}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"runs": rows, "total": total, "whole_runs": whole}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
