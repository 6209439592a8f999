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
        "import kvobs_otel.__main__",
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


def module_file(name: str, package: Path = PACKAGE) -> Path | None:
    base = package.parent / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules its import statements load (anywhere in
    it, TYPE_CHECKING and function-level imports too; ``from pkg import
    sub`` loads ``sub``, not ``pkg``'s other modules)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        name = module_name(path, package)
        own = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = own.split(".")[: len(own.split(".")) - node.level + 1]
                    module = ".".join(base + ([module] if module else []))
                subs = {f"{module}.{a.name}" for a in node.names}
                found = {s for s in subs if module_file(s, package)}
                targets |= found if found == subs else found | {module}
        graph[name] = {t for t in targets if t != name and module_file(t, package)
                       and t.split(".")[0] == package.name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert len(graph) > 60 and graph["kvobs_otel.pipeline"], "the walk found the package"
    assert not circles(graph), circles(graph)


def test_the_circle_check_sees_a_circle(tmp_path):
    # The rule itself, on a package written for the purpose, including a
    # circle closed only by a TYPE_CHECKING import.
    package = tmp_path / "kvobs_otel"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from kvobs_otel.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvobs_otel import a\n")
    (package / "c.py").write_text("from kvobs_otel import a\n")
    assert circles(import_graph(package)) == [["kvobs_otel.a", "kvobs_otel.sub.b"]]
    (package / "sub" / "b.py").write_text("import json\n")
    assert circles(import_graph(package)) == []
