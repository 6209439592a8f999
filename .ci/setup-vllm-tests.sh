#!/usr/bin/env bash
# Fetches (once) vLLM's own tests of one supported release and prints the
# directory holding them (its tests/ package, as in vLLM's source tree):
#
#   .ci/setup-vllm-tests.sh VERSION
#
# They come from the release's source distribution on the package registry
# (vllm-VERSION.tar.gz, checked against the registry's sha256), of which only
# tests/ is kept, cached outside the repository:
#   ${KVOBS_CACHE_DIR:-$HOME/.cache/kvobs-otel}/vllm-tests-VERSION
# tests/test_vllm_own_tests.py runs their OffloadingConnector tests stock and
# with kvobs-otel on. Progress goes to stderr, the path to stdout.
set -euo pipefail
version=${1:?usage: .ci/setup-vllm-tests.sh VERSION}
cache=${KVOBS_CACHE_DIR:-$HOME/.cache/kvobs-otel}
dest="$cache/vllm-tests-$version"
if [ -f "$dest/.complete" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$cache"
index=${PIP_INDEX_URL:-https://pypi.org/simple}
t0=$SECONDS
printf 'kvobs-otel: [vLLM %s] its own tests, from the source distribution ...' "$version" >&2
${PYTHON:-python3} - "$version" "$index" "$dest" <<'PY'
import hashlib, html.parser, io, shutil, sys, tarfile, tempfile, urllib.parse, urllib.request
version, index, dest = sys.argv[1:]
name = f"vllm-{version}.tar.gz"
page_url = index.rstrip("/") + "/vllm/"

class Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs = []
    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.hrefs.extend(v for k, v in attrs if k == "href" and v)

with urllib.request.urlopen(page_url, timeout=60) as r:
    parser = Links()
    parser.feed(r.read().decode("utf-8", "replace"))
found = [h for h in parser.hrefs if urllib.parse.urlsplit(h).path.endswith("/" + name)]
if not found:
    sys.exit(f"\n{name} is not on {page_url}")
url = urllib.parse.urljoin(page_url, found[0])
digest = dict(p.split("=", 1) for p in urllib.parse.urlsplit(url).fragment.split("&") if "=" in p)
with urllib.request.urlopen(url.split("#")[0], timeout=600) as r:
    data = r.read()
want = digest.get("sha256")
if want and hashlib.sha256(data).hexdigest() != want:
    sys.exit(f"\n{name}: sha256 does not match the registry's")
tmp = tempfile.mkdtemp(dir=dest.rsplit("/", 1)[0])
prefix = f"vllm-{version}/tests/"
with tarfile.open(fileobj=io.BytesIO(data)) as tar:
    members = [m for m in tar.getmembers()
               if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
    for m in members:
        m.name = m.name[len(f"vllm-{version}/"):]
    tar.extractall(tmp, members=members, filter="data")
shutil.rmtree(dest, ignore_errors=True)
shutil.move(tmp, dest)
open(f"{dest}/.complete", "w").close()
PY
printf ' %ds\n' $((SECONDS - t0)) >&2
echo "$dest"
