"""The keel package's imports form no cycle, function-local imports included.

A cycle used to be broken by importing inside a function (keel.config ↔ keel.signals.schedule,
keel.cli ↔ keel.sweep); that hides it from Python but not from a reader, so every `import` in a
module, wherever it stands, is an edge here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "keel"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module → the keel modules it imports anywhere in its file. `from keel.a import b` is an
    edge to keel.a.b when that is a module, else to keel.a; importing keel.a.b also runs keel.a."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: a relative import (this test reads absolute ones only)"
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names)
        edges = set()
        for target in targets:
            parts = target.split(".")
            edges.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))  # keel.a.b runs keel.a first
        graph[name] = {m for m in edges if m in modules and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph[node]):
            cycle = visit(nxt)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_find_cycle_finds_a_function_local_cycle():
    assert find_cycle({"keel.a": {"keel.b"}, "keel.b": {"keel.c"}, "keel.c": {"keel.a"}}) == ["keel.a", "keel.b", "keel.c", "keel.a"]
    assert find_cycle({"keel.a": {"keel.b", "keel.c"}, "keel.b": {"keel.c"}, "keel.c": set()}) is None


def test_the_graph_sees_the_edges_that_matter():
    graph = import_graph()
    assert "keel.config" in graph["keel.signals.schedule"]  # module level
    assert "keel.train" in graph["keel.resume"]  # function-local (torch is loaded only to resume)
    assert "keel.signals" in graph["keel.train"]  # importing keel.signals.schedule runs the package first


def test_the_keel_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle)
