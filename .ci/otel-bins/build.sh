#!/usr/bin/env bash
# Build (once) the Go programs the end-to-end tests run on loopback:
#   - Jaeger v2 (module github.com/jaegertracing/jaeger v1.75.0, program cmd/jaeger)
#   - otelcol-kvobs, a small OpenTelemetry Collector distribution (./otelcol)
#   - Prometheus 3.5.0 and promtool (module github.com/prometheus/prometheus
#     v0.305.0, programs cmd/prometheus and cmd/promtool; ./prometheus): the
#     release docker-compose.yml ships (prom/prometheus:v3.5.0)
#
# Output: stdout gets exactly four lines,
#   JAEGER=/abs/path/jaeger-v1.75.0
#   OTELCOL=/abs/path/otelcol-kvobs-v0.161.0-<key>
#   PROMETHEUS=/abs/path/prometheus-3.5.0
#   PROMTOOL=/abs/path/promtool-3.5.0
# where <key> is the first 12 hex digits of sha256(otelcol/components.go + otelcol/go.mod).
# Progress goes to stderr. On failure: non-zero exit and the tail of the build log.
#
# Everything (binaries, GOPATH, module cache, build cache, logs) lives under
#   ${KVOBS_CACHE_DIR:-$HOME/.cache/kvobs-otel}
# never in the repo. A second run with unchanged inputs is a no-op (stamp check).
#
# Env knobs:
#   KVOBS_CACHE_DIR          cache root (default $HOME/.cache/kvobs-otel)
#   KVOBS_OTEL_BINS_FORCE=1  rebuild even if the stamp matches
#   GO                       go command to use (default: go on PATH)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${KVOBS_CACHE_DIR:-$HOME/.cache/kvobs-otel}"
GO="${GO:-go}"

JAEGER_VERSION="v1.75.0"          # the approved release (not v1.76+); keep in sync with jaeger/go.mod
# Jaeger tags each release twice: module v1.75.0 is Jaeger v2.12.0 (the release
# after CHANGELOG.md's "v1.74.0 / v2.11.0"; RELEASE.md). docker-compose.yml ships it.
JAEGER_RELEASE="2.12.0"
OTELCOL_RELEASE="v0.161.0"        # core v0.161.0 + v1.67.0, contrib v0.161.0 (otelcol/go.mod)
# Prometheus 3.x is tagged v0.3<minor, two digits>.<patch> for Go: v0.305.0 is
# release 3.5.0 (the module's VERSION file says 3.5.0). Keep in sync with
# prometheus/go.mod and with the prom/prometheus image in docker-compose.yml
# (tests/test_deploy_static.py checks all three).
PROMETHEUS_VERSION="v0.305.0"
PROMETHEUS_RELEASE="3.5.0"

BIN_DIR="$CACHE/bin"
LOG_DIR="$CACHE/logs"
JAEGER_BIN="$BIN_DIR/jaeger-$JAEGER_VERSION"
# The Collector's component set is part of its name: a short hash of
# components.go + go.mod. Adding or removing a component gives a new path, so
# every machine builds it once, a binary already exported in KVOBS_OTELCOL_BIN
# (or running) is never swapped underneath, and a stale exported path no longer
# matches what this script prints. (The .stamp below still covers every input.)
OTELCOL_KEY="$(cat "$HERE/otelcol/components.go" "$HERE/otelcol/go.mod" | sha256sum | cut -c1-12)"
OTELCOL_BIN="$BIN_DIR/otelcol-kvobs-$OTELCOL_RELEASE-$OTELCOL_KEY"
PROMETHEUS_BIN="$BIN_DIR/prometheus-$PROMETHEUS_RELEASE"
PROMTOOL_BIN="$BIN_DIR/promtool-$PROMETHEUS_RELEASE"

log() { printf '[otel-bins] %s\n' "$*" >&2; }

mkdir -p "$BIN_DIR" "$LOG_DIR" "$CACHE/go/mod" "$CACHE/go/cache"

if ! command -v "$GO" >/dev/null 2>&1; then
  log "ERROR: '$GO' not found on PATH (Go >= 1.26 is needed)"
  exit 1
fi

export GOPATH="$CACHE/go"
export GOMODCACHE="$CACHE/go/mod"
export GOCACHE="$CACHE/go/cache"
# go.mod/go.sum are committed and complete: never let the build rewrite them.
export GOFLAGS="-mod=readonly -buildvcs=false"
export CGO_ENABLED=0
# The pinned modules need go >= 1.26.0 (go.mod). Never fetch a toolchain behind
# the caller's back; a caller may still export GOTOOLCHAIN=go1.27.3 (see README).
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

LDFLAGS_COMMON="-s -w"
GO_VERSION="$("$GO" env GOVERSION)"

# stamp = hash of every input that affects the binary
stamp_of() { # dir, extra...
  local dir="$1"; shift
  {
    printf '%s\n' "$GO_VERSION" "$@"
    (cd "$dir" && cat go.mod go.sum && find . -maxdepth 1 -name '*.go' -print0 | sort -z | xargs -0 -r cat)
  } | sha256sum | cut -d' ' -f1
}

# build NAME DIR OUT PKG LDFLAGS [TAGS]
# TAGS: comma-separated build tags (go build -tags); part of the stamp when set.
build_one() {
  local name="$1" dir="$2" out="$3" pkg="$4" ldflags="$5" tags="${6:-}"
  local stamp want logf t0 t1
  local -a tagargs=()
  [[ -n "$tags" ]] && tagargs=(-tags "$tags")
  want="$(stamp_of "$dir" "$pkg" "$ldflags" ${tags:+"tags=$tags"})"
  stamp="$out.stamp"
  if [[ -x "$out" && -f "$stamp" && "$(cat "$stamp")" == "$want" && "${KVOBS_OTEL_BINS_FORCE:-0}" != 1 ]]; then
    log "$name: up to date ($out)"
    return 0
  fi
  logf="$LOG_DIR/build-$name.log"
  log "$name: building into $out (log: $logf; first build takes several minutes)"
  t0=$(date +%s)
  if ! (
    cd "$dir"
    echo "== $(date -u +%FT%TZ) $GO_VERSION: go build ${tagargs[*]} $pkg"
    "$GO" build -trimpath "${tagargs[@]}" -ldflags="$ldflags" -o "$out.tmp.$$" "$pkg"
  ) >"$logf" 2>&1; then
    rm -f "$out.tmp.$$"
    log "$name: BUILD FAILED; last lines of $logf:"
    tail -n 40 "$logf" >&2
    return 1
  fi
  mv -f "$out.tmp.$$" "$out"
  printf '%s\n' "$want" >"$stamp"
  t1=$(date +%s)
  log "$name: built in $((t1 - t0))s, $(du -h "$out" | cut -f1)"
}

# One build at a time per cache dir (parallel pytest workers, two CI steps...).
exec 9>"$BIN_DIR/.build.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi

build_one "jaeger-$JAEGER_VERSION" "$HERE/jaeger" "$JAEGER_BIN" \
  github.com/jaegertracing/jaeger/cmd/jaeger \
  "$LDFLAGS_COMMON -X github.com/jaegertracing/jaeger/internal/version.latestVersion=$JAEGER_VERSION"

build_one "otelcol-kvobs-$OTELCOL_RELEASE-$OTELCOL_KEY" "$HERE/otelcol" "$OTELCOL_BIN" \
  . \
  "$LDFLAGS_COMMON -X main.version=$OTELCOL_RELEASE"

# Prometheus and promtool as the release's own build (.promu.yml) makes them:
# tag netgo, version stamped into prometheus/common/version; but without the
# `builtinassets` tag, which embeds the web UI (it needs the UI built with npm
# first). So the UI pages are not served; the HTTP API, /-/ready and /metrics
# work, and the tests use only those.
if ! grep -q "^[[:space:]]github.com/prometheus/prometheus $PROMETHEUS_VERSION\b" "$HERE/prometheus/go.mod"; then
  log "ERROR: prometheus/go.mod does not require github.com/prometheus/prometheus $PROMETHEUS_VERSION"
  exit 1
fi
PROMETHEUS_LDFLAGS="$LDFLAGS_COMMON -X github.com/prometheus/common/version.Version=$PROMETHEUS_RELEASE"
build_one "prometheus-$PROMETHEUS_RELEASE" "$HERE/prometheus" "$PROMETHEUS_BIN" \
  github.com/prometheus/prometheus/cmd/prometheus "$PROMETHEUS_LDFLAGS" netgo
build_one "promtool-$PROMETHEUS_RELEASE" "$HERE/prometheus" "$PROMTOOL_BIN" \
  github.com/prometheus/prometheus/cmd/promtool "$PROMETHEUS_LDFLAGS" netgo

echo "JAEGER=$JAEGER_BIN"
echo "OTELCOL=$OTELCOL_BIN"
echo "PROMETHEUS=$PROMETHEUS_BIN"
echo "PROMTOOL=$PROMTOOL_BIN"
