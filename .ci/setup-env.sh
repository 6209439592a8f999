#!/usr/bin/env bash
# Creates (once) and prints the path of the CPU vLLM environment the tests,
# the demo and the benchmarks run in. Cached outside the repository, keyed by
# the pinned requirement files, so a second run only re-links the project.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=${KVOBS_CACHE_DIR:-$HOME/.cache/kvobs-otel}
VLLM_VERSION=0.33.0
key=$(cat "$here/constraints-cpu.txt" "$here/requirements-cpu.txt" | sha256sum | cut -c1-12)
venv="$cache/venv-$VLLM_VERSION-$key"
py=${PYTHON:-python3}

quiet() {  # run quietly; show the log only when it fails
  local log; log=$(mktemp)
  "$@" >"$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; return 1; }
  rm -f "$log"
}

if [ ! -f "$venv/.complete" ]; then
  echo "kvobs-otel: building the CPU vLLM $VLLM_VERSION environment in $venv (first run only)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  quiet "$venv/bin/pip" install --upgrade pip
  # torch first: the PyPI build is a CUDA build that still runs on CPU.
  quiet "$venv/bin/pip" install -c "$here/constraints-cpu.txt" torch
  quiet "$venv/bin/pip" install --no-deps "vllm==$VLLM_VERSION"
  # pip warns that vLLM's GPU-only requirements are missing: expected here.
  quiet "$venv/bin/pip" install -c "$here/constraints-cpu.txt" -r "$here/requirements-cpu.txt"
  touch "$venv/.complete"
fi
# The project itself, editable and without dependencies (vLLM's full
# dependency set must not be pulled). Re-run every time: the clone may move.
quiet "$venv/bin/pip" install --no-deps --no-build-isolation -e "$repo"
echo "$venv"
