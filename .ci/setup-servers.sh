#!/usr/bin/env bash
# The real programs the tests run on loopback: Prometheus + promtool and
# Chromium (Debian's packages) and Jaeger v2 + the Collector (built from Go modules,
# cached outside the repo; ~6 min the first time, instant afterwards).
# Prints `export KVOBS_JAEGER_BIN=... KVOBS_OTELCOL_BIN=...` for eval.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Debian packages: Prometheus + promtool (alert and end-to-end tests), openssl
# (certificates for the TLS tests) and
# Chromium (the HTML report's screenshot test).
missing=()
command -v promtool >/dev/null && command -v prometheus >/dev/null || missing+=(prometheus)
command -v openssl >/dev/null || missing+=(openssl)
[ -x /usr/bin/chromium ] || missing+=(chromium)
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
jaeger=$(sed -n 's/^JAEGER=//p' <<<"$bins")
otelcol=$(sed -n 's/^OTELCOL=//p' <<<"$bins")
echo "export KVOBS_JAEGER_BIN=$jaeger KVOBS_OTELCOL_BIN=$otelcol"
