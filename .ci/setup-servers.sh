#!/usr/bin/env bash
# The real programs the tests run on loopback: Jaeger v2, the Collector and
# Prometheus 3.5.0 + promtool (the release docker-compose.yml ships), built
# from Go modules and cached outside the repo (~10 min the first time, instant
# afterwards), and Chromium (Debian's package).
# Prints `export KVOBS_JAEGER_BIN=... KVOBS_OTELCOL_BIN=... KVOBS_PROMETHEUS_BIN=...
# KVOBS_PROMTOOL_BIN=...` (one line) for eval.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Debian packages: openssl (certificates for the TLS tests), Chromium (the
# HTML report's screenshot test) and libfaketime (a rank process on a skewed
# wall clock, tests/test_clock_skew.py).
missing=()
command -v openssl >/dev/null || missing+=(openssl)
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || missing+=(libfaketime)
# and valgrind for the benchmarks' instruction counts (B6; skipped without it)
command -v callgrind_control >/dev/null || missing+=(valgrind)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "kvobs-otel: the tests need: sudo apt-get install ${missing[*]}" >&2
    exit 1
  fi
  echo "kvobs-otel: installing Debian packages: ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
bins=$(bash "$here/otel-bins/build.sh")
path_of() {  # path_of NAME: the path build.sh printed as NAME=..., shell-quoted
  local p
  p=$(sed -n "s/^$1=//p" <<<"$bins")
  [ -n "$p" ] || { echo "kvobs-otel: build.sh printed no $1=" >&2; return 1; }
  printf '%q' "$p"
}
jaeger=$(path_of JAEGER)
otelcol=$(path_of OTELCOL)
prometheus=$(path_of PROMETHEUS)
promtool=$(path_of PROMTOOL)
echo "export KVOBS_JAEGER_BIN=$jaeger KVOBS_OTELCOL_BIN=$otelcol" \
  "KVOBS_PROMETHEUS_BIN=$prometheus KVOBS_PROMTOOL_BIN=$promtool"
