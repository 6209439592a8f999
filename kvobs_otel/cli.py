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
        "demo", help="run the real vLLM scheduler under KV pressure on CPU and trace it",
        description="Drive vLLM's real scheduler and OffloadingConnector with N rank "
        "processes and a CPU copy backend under KV pressure. Spans go to an OTLP JSON "
        "file, and to an OTLP endpoint when one is configured (--otlp-endpoint or "
        "OTEL_EXPORTER_OTLP_ENDPOINT).")
    d.add_argument("--ranks", type=_positive, default=2, help="worker ranks (default 2)")
    d.add_argument("--requests", type=_positive, default=12, help="requests (default 12)")
    d.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    d.add_argument("--max-steps", type=_positive, default=5000,
                   help="stop after this many engine steps (default 5000)")
    d.add_argument("-o", "--out", default="kvobs-demo.otlp.jsonl",
                   help="OTLP JSON output file (default ./kvobs-demo.otlp.jsonl)")
    d.add_argument("--otlp-endpoint", help="also export over OTLP to this endpoint")
    d.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        from kvobs_otel.demo import DemoOptions, format_summary, run_demo

        try:
            summary = run_demo(DemoOptions(
                ranks=args.ranks, requests=args.requests, seed=args.seed,
                max_steps=args.max_steps, out=args.out, otlp_endpoint=args.otlp_endpoint))
        except OSError as e:
            print(f"kvobs-otel demo: {e}", file=sys.stderr)
            return 2
        print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
        return 1 if summary["incomplete_receipts"] else 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
