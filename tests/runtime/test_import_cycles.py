"""No import cycle in the runtime: the module-level imports of specexport_runtime (those that run
at import time: not under TYPE_CHECKING, not inside functions) form a graph without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import specexport_runtime

PACKAGE = "specexport_runtime"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = (PACKAGE, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _targets(module: str, path: Path, node: ast.stmt, known: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(max(0, node.level - 1)):
        base = base.rpartition(".")[0]
    source = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
    found = set()
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        if sub in known:
            found.add(sub)
        elif source in known:
            found.add(source)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the runtime modules its module-level statements import."""
    known = _modules(root)
    graph = {}
    for module, path in known.items():
        deps: set[str] = set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for stmt in node.body if isinstance(node, ast.Try) else [node]:
                deps |= _targets(module, path, stmt, known)
        graph[module] = deps - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_runtime_has_no_import_cycle():
    graph = import_graph(Path(specexport_runtime.__file__).parent)
    assert len(graph) > 50 and "specexport_runtime.proposers" in graph["specexport_runtime.suffix"]
    assert cycles(graph) == []
