"""The command line behaves like a Unix tool: help, version, exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvobs_otel import __version__
from kvobs_otel.tools.cli import main


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out


@pytest.mark.parametrize("args", [["demo", "--ranks", "0"], ["demo", "--requests", "x"],
                                  ["nonsense"]])
def test_usage_errors_exit_2_with_one_line_no_traceback(args):
    res = subprocess.run([sys.executable, "-m", "kvobs_otel", *args], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "error:" in res.stderr


def test_python_dash_m_runs_the_cli():
    # `python -m kvobs_otel` (kvobs_otel/__main__.py)
    module = "kvobs_otel"
    res = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: kvobs-otel") and "report" in res.stdout
    res = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "demo" in res.stdout


def test_importing_the_package_imports_no_tool():
    res = subprocess.run(
        [sys.executable, "-c", "import sys, kvobs_otel; kvobs_otel.is_instrumented(); "
         "print(sorted(m for m in sys.modules if m.startswith('kvobs_otel.tools')))"],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_the_version_is_pyprojects():
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^version = "([^"]+)"', project, re.M).group(1) == __version__
