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

if [ ! -f "$venv/.complete" ]; then
  echo "kvobs-otel: building the CPU vLLM $VLLM_VERSION environment in $venv (first run only)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  # torch first: the PyPI build is a CUDA build that still runs on CPU.
  "$venv/bin/pip" install -q -c "$here/constraints-cpu.txt" torch >&2
  "$venv/bin/pip" install -q --no-deps "vllm==$VLLM_VERSION" >&2
  "$venv/bin/pip" install -q -c "$here/constraints-cpu.txt" -r "$here/requirements-cpu.txt" >&2
  touch "$venv/.complete"
fi
# The project itself, editable and without dependencies (vLLM's full
# dependency set must not be pulled). Re-run every time: the clone may move.
log="$venv/.install-project.log"
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" >"$log" 2>&1 || {
  cat "$log" >&2; exit 1; }
echo "$venv"
