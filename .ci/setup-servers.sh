#!/usr/bin/env bash
# The real servers the tests start on loopback: Prometheus + promtool
# (Debian's package) and Jaeger v2 + the Collector (built from Go modules,
# cached outside the repo; ~6 min the first time, instant afterwards).
# Prints `export KVOBS_JAEGER_BIN=... KVOBS_OTELCOL_BIN=...` for eval.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "kvobs-otel: the tests need Prometheus: run 'sudo apt-get install prometheus'" >&2
    exit 1
  fi
  echo "kvobs-otel: installing Debian's prometheus package" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
bins=$(bash "$here/otel-bins/build.sh")
jaeger=$(sed -n 's/^JAEGER=//p' <<<"$bins")
otelcol=$(sed -n 's/^OTELCOL=//p' <<<"$bins")
echo "export KVOBS_JAEGER_BIN=$jaeger KVOBS_OTELCOL_BIN=$otelcol"
