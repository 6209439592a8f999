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
# requirement files, comments ignored), so it is built once and shared by
# every clone. The project is never installed there: each clone gets its own
# thin environment on top of it, $repo/.venvs/vllm-VERSION (seconds to make;
# remade when the clone moved, its pyproject.toml changed or the cached
# environment did), and that is the path printed. Progress goes to stderr,
# the path to stdout.
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
# Why a thin environment per clone: an editable install in the shared
# environment is one link, to whichever clone ran setup last. Re-linking on
# every call (what this script did) repairs it only for the caller, and only
# until another clone calls: a run already under way (a 30-minute `make
# test`) then starts its export sidecars, rank processes, vLLM's own
# processes and the kvobs-otel script with the other clone's code, and a
# process started from the shared python directly never gets repaired. One
# environment cannot hold two links (every .pth in it is read by every
# process), so each clone has its own.
base_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if compgen -G "$base_site/*kvobs_otel*" >/dev/null; then
  # An older setup-env.sh linked a clone into the shared environment: unlink
  # it, so that no process of the shared python runs that clone's code.
  quiet "$venv/bin/python" -m pip uninstall -y kvobs-otel
  rm -f "$venv/.project"
fi
clone="$repo/.venvs/vllm-$version"
stamp="$venv $repo $(sha256sum <"$repo/pyproject.toml" | cut -c1-12)"
if [ "$(cat "$clone/.stamp" 2>/dev/null)" != "$stamp" ] ||
   ! (cd / && "$clone/bin/python" -c 'import sys, kvobs_otel
sys.exit(kvobs_otel.__file__ != sys.argv[1])' "$repo/kvobs_otel/__init__.py") 2>/dev/null; then
  t0=$SECONDS
  rm -rf "$clone"
  quiet "$venv/bin/python" -m venv --without-pip "$clone"
  site=$("$clone/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # The shared environment's packages, after this one's, and its .pth files
  # but any kvobs_otel link (an older setup-env.sh or pip may have left one).
  cat >"$site/_kvobs_shared_env.py" <<PY
"""Written by .ci/setup-env.sh: this clone's environment sees the shared one's packages."""
import os, site, sys

SHARED = "$base_site"
if SHARED not in sys.path:
    sys.path.append(SHARED)
    known = set(sys.path)
    for name in sorted(os.listdir(SHARED)):
        if name.endswith(".pth") and "kvobs_otel" not in name:
            site.addpackage(SHARED, name, known)
PY
  echo "import _kvobs_shared_env" >"$site/_kvobs_shared_env.pth"
  # The shared environment's commands (ruff, pytest, vllm, ...): a Python
  # script is copied to run this environment's python, a binary is linked.
  for f in "$venv"/bin/*; do
    n=${f##*/}
    [ -f "$f" ] && [ ! -e "$clone/bin/$n" ] || continue  # (not __pycache__/)
    if head -n 1 "$f" | grep -Eqx "#!$venv/bin/python[0-9.]*"; then
      { echo "#!$clone/bin/python"; tail -n +2 "$f"; } >"$clone/bin/$n"
      chmod +x "$clone/bin/$n"
    else
      ln -s "$f" "$clone/bin/$n"
    fi
  done
  # The project itself, editable and without dependencies (vLLM's full
  # dependency set must not be pulled).
  quiet "$clone/bin/python" -m pip install --no-deps --no-build-isolation -e "$repo"
  echo "$stamp" >"$clone/.stamp"
  echo "$tag linked this clone ($clone) in $((SECONDS - t0))s" >&2
fi
echo "$clone"
