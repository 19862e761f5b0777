"""The engine's layout: imports run one way (no circle, lazy imports inside functions counted
too), ``s2s_flow`` never imports the node catalogue, every module imports on its own in a
fresh interpreter, and no module grows past what a reader takes in at once."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "s2s_flow"
MAX_LINES = 500


def engine_imports() -> dict[str, set[str]]:
    """Per engine module, the other engine modules and top-level packages it imports anywhere."""
    modules = {p.stem for p in ENGINE.glob("*.py")}
    found: dict[str, set[str]] = {}
    for path in ENGINE.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] if node.module != "s2s_flow" else [f"s2s_flow.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                top, _, rest = name.partition(".")
                if top == "s2s_flow" and rest.split(".")[0] in modules:
                    deps.add(rest.split(".")[0])
                elif top != "s2s_flow":
                    deps.add(top)
        found[path.stem] = deps - {path.stem}
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_engine_has_no_import_circle():
    graph = engine_imports()
    assert circles(graph) == []
    # the check sees a circle where there is one (a lazy import back counts as one too)
    assert circles({**graph, "errors": graph["errors"] | {"cli"}})


def test_the_engine_never_imports_the_node_catalogue():
    assert {name: deps & {"nodes", "tests"} for name, deps in engine_imports().items() if deps & {"nodes", "tests"}} \
        == {}


def test_every_engine_module_imports_on_its_own_in_a_fresh_interpreter():
    failed = {}
    for path in sorted(ENGINE.glob("*.py")):
        out = subprocess.run([sys.executable, "-c", f"import s2s_flow.{path.stem}"], capture_output=True, text=True,
                             timeout=120, cwd=ENGINE.parent)
        if out.returncode:
            failed[path.stem] = out.stderr.strip().splitlines()[-1]
    assert failed == {}


def test_no_engine_module_is_longer_than_a_reader_takes_in():
    long = {p.name: n for p in ENGINE.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concern: {long}"
