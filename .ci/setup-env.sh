#!/usr/bin/env bash
# Creates (once) and prints the path of the CPU environment of one supported
# vLLM release, in which the tests, the demo and the benchmarks run:
#
#   .ci/setup-env.sh [VERSION]   build or reuse it; prints the venv path
#                                (default: the newest release, see below)
#   .ci/setup-env.sh --list      the supported releases, newest (default) first
#
# The releases and how each is made: .ci/envs/recipes.sh; every package of
# each is pinned by .ci/envs/vllm-VERSION.txt (.ci/lock-env.sh re-pins).
# Each environment is cached outside the repository,
#   ${KVOBS_CACHE_DIR:-$HOME/.cache/kvobs-otel}/venv-VERSION-KEY
# KEY hashing its pinned inputs (the distribution, the pin file and the
# requirement files, comments ignored), so it is built once; later runs reuse
# it at once and only re-link the project when the clone moved or its
# pyproject.toml changed. Progress goes to stderr, the path to stdout.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
# shellcheck source=envs/recipes.sh
. "$here/envs/recipes.sh"
if [ "${1:-}" = --list ]; then
  printf '%s\n' "${KVOBS_VLLM_VERSIONS[@]}"
  exit 0
fi
version=${1:-${KVOBS_VLLM_VERSIONS[0]}}
recipe "$version" || { echo "kvobs-otel: vLLM $version is not supported" \
  "(supported: ${KVOBS_VLLM_VERSIONS[*]})" >&2; exit 2; }
pins="$here/envs/vllm-$version.txt"
reqs=(); for r in "${REQS[@]}"; do reqs+=(-r "$here/$r"); done
cache=${KVOBS_CACHE_DIR:-$HOME/.cache/kvobs-otel}
key=$( { echo "$DIST==$version"
         for f in "$pins" "${REQS[@]/#/$here/}"; do sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$f"; done
       } | sha256sum | cut -c1-12)
venv="$cache/venv-$version-$key"
py=${PYTHON:-python3}
tag="kvobs-otel: [vLLM $version]"

quiet() {  # run quietly; show the log only when it fails
  local log; log=$(mktemp)
  "$@" >"$log" 2>&1 || { echo >&2; cat "$log" >&2; rm -f "$log"; return 1; }
  rm -f "$log"
}
stage() {  # stage TITLE CMD...: one progress line per stage, with its time
  local title=$1 t0=$SECONDS; shift
  printf '%s %s ...' "$tag" "$title" >&2
  quiet "$@"
  printf ' %ds\n' $((SECONDS - t0)) >&2
}
pin_of() { sed -n "s/^$1==\([^ ;#]*\).*/\1/p" "$pins"; }
check_pins() {  # every installed distribution exactly as pinned
  "$venv/bin/python" - "$pins" <<'PY'
import re, sys
from importlib.metadata import distributions
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
pins = {}
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].split(";", 1)[0].strip()
    if "==" in line:
        name, version = line.split("==", 1)
        pins[norm(name)] = version.strip()
bad = [f"  {d.metadata['Name']} {d.version} (pinned: {pins.get(norm(d.metadata['Name']), 'no')})"
       for d in distributions()
       if norm(d.metadata["Name"]) not in ("pip", "setuptools", "wheel", "kvobs-otel")
       and pins.get(norm(d.metadata["Name"])) != d.version]
if bad:
    sys.exit(f"installed but not as pinned by {sys.argv[1]}:\n" + "\n".join(bad))
PY
}
check_env() {
  check_pins && (cd / && "$venv/bin/python" -c "import torch, vllm")
}

mkdir -p "$cache"
exec 9>"$venv.lock"  # one builder per environment (parallel `make test`s)
flock -n 9 || { echo "$tag waiting for another build of $venv" >&2; flock 9; }
if [ ! -f "$venv/.complete" ]; then
  echo "$tag building $venv (first run only; cached afterwards)" >&2
  t0=$SECONDS
  rm -rf "$venv"
  stage "venv + pip" bash -c '"$1" -m venv "$2" && "$2/bin/pip" install --upgrade pip' _ "$py" "$venv"
  # torch first: the PyPI build is a CUDA build that still runs on CPU.
  stage "torch $(pin_of torch)" "$venv/bin/pip" install -c "$pins" torch
  # vLLM without its dependencies (the full set pulls GPU kernels).
  stage "$DIST $version (--no-deps)" \
    "$venv/bin/pip" install --no-deps -c "$pins" "$DIST==$version"
  # pip warns that vLLM's GPU-only requirements are missing: expected here.
  stage "requirements (${REQS[*]})" "$venv/bin/pip" install -c "$pins" "${reqs[@]}"
  stage "check (every package as pinned; import torch, vllm)" check_env
  touch "$venv/.complete"
  echo "$tag ready in $((SECONDS - t0))s" >&2
fi
# The project itself, editable and without dependencies (vLLM's full
# dependency set must not be pulled), whenever the venv does not already
# import it from this clone with this pyproject.toml.
stamp="$repo $(sha256sum <"$repo/pyproject.toml" | cut -c1-12)"
if [ "$(cat "$venv/.project" 2>/dev/null)" != "$stamp" ] ||
   ! (cd / && "$venv/bin/python" -c 'import sys, kvobs_otel
sys.exit(kvobs_otel.__file__ != sys.argv[1])' "$repo/kvobs_otel/__init__.py") 2>/dev/null; then
  quiet "$venv/bin/pip" install --no-deps --no-build-isolation -e "$repo"
  echo "$stamp" >"$venv/.project"
fi
echo "$venv"
