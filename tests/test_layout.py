"""The package's one boundary: imports flow from the tools to the runtime, never back.

Everything in ``kvobs_otel/`` outside ``kvobs_otel/tools/`` may run inside
vLLM's processes; none of it may import ``kvobs_otel.tools`` (docs/architecture.md).
Read from the source (ast), so an import inside a function or a string handed to
``importlib`` counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvobs_otel"
TOOLS = "kvobs_otel.tools"

# Entry points into the tools that live outside tools/ on purpose: they are
# run or imported only by people, never by the runtime (checked below).
ENTRY_POINTS = {
    "kvobs_otel.__main__": "python -m kvobs_otel",
    "kvobs_otel.cli": "old path of kvobs_otel.tools.cli",
    "kvobs_otel.harness": "old path of kvobs_otel.tools.harness",
}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path, package: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, dotted name) of every module this file imports or names to importlib."""
    name = module_name(path, package)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from kvobs_otel import tools` imports kvobs_otel.tools too.
            found += [(node.lineno, module)]
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings):
            # importlib.import_module("kvobs_otel.tools..."), "-m kvobs_otel.tools.cli",
            # "kvobs_otel.tools.x:attr": any string naming a tool module.
            found.append((node.lineno, node.value.split(":")[0]))
    return found


def violations(paths: list[Path], forbidden: set[str], package: Path = PACKAGE) -> list[str]:
    out = []
    for path in paths:
        seen = set()
        for line, name in imported_names(path, package):
            if line not in seen and any(name == f or name.startswith(f + ".") for f in forbidden):
                seen.add(line)  # one line per import statement
                out.append(f"{path.relative_to(package.parent)}:{line} imports {name}")
    return out


def runtime_modules() -> list[Path]:
    tools = PACKAGE / "tools"
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if tools not in p.parents and module_name(p) not in ENTRY_POINTS)


def test_the_tree_has_the_boundary():
    assert (PACKAGE / "tools" / "__init__.py").is_file()
    assert len(runtime_modules()) > 40  # the walk found the runtime
    for name in ENTRY_POINTS:
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        assert path.is_file(), name


def test_the_runtime_never_imports_the_tools():
    # Nor the entry points that do (importing one would import the tools).
    bad = violations(runtime_modules(), {TOOLS, *ENTRY_POINTS})
    assert not bad, "the runtime imports the offline tools:\n" + "\n".join(bad)


def test_the_check_sees_every_spelling(tmp_path):
    # The rule itself, on a module written for the purpose in a copy of the layout.
    spellings = [
        "import kvobs_otel.tools.cli",
        "from kvobs_otel.tools import cli",
        "from kvobs_otel import tools",
        "from .tools.report import render_report",
        "from . import tools",
        "import importlib\nimportlib.import_module('kvobs_otel.tools.harness')",
        "def f():\n    from kvobs_otel.tools.check import check_spans",
        "import kvobs_otel.harness",
    ]
    clean = ['"""Mentions kvobs_otel.tools in a docstring only."""\nimport kvobs_otel.pipeline']
    package = tmp_path / "kvobs_otel"
    package.mkdir()
    probe = package / "probe.py"
    for source in spellings + clean:
        probe.write_text(source + "\n")
        found = violations([probe], {TOOLS, *ENTRY_POINTS}, package)
        assert bool(found) == (source in spellings), (source, found)


def test_the_entry_points_only_hand_over():
    # An entry point holds no code of its own: imports, __all__, the __main__ guard.
    for name in ENTRY_POINTS:
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        assert len(tree.body) <= 6, name
