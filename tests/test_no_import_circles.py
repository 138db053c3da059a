"""No import circles among the product's modules: dependencies point one way.

Every import counts, at the top of a module or inside a function (a deferred import that closes a circle is
still a circle: the two modules cannot be understood, or moved, apart); only imports for type checkers
(``if TYPE_CHECKING:``) are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("evo", "runtime", "serving", "archive", "genome")


def _modules(root: Path) -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imported(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> Iterator[str]:
    """The product modules an import statement in ``module`` loads (the deepest one each name resolves to)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if modules[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            yield f"{base}.{alias.name}"
        elif base in modules:
            yield base


def _walk(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            yield stmt
        elif isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            yield from _walk(stmt.orelse)
        else:
            for child in ast.iter_child_nodes(stmt):
                if isinstance(child, ast.stmt):
                    yield from _walk([child])
                elif isinstance(child, ast.excepthandler):
                    yield from _walk(child.body)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {m for node in _walk(tree.body) for m in _imported(name, node, modules) if m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_check_finds_a_circle_through_a_deferred_import_and_not_through_type_checking(tmp_path):
    pkg = tmp_path / "evo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from evo.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from evo import a\n    return a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from evo.a import x\n")
    (pkg / "d.py").write_text("from .c import y\n")
    (pkg / "e.py").write_text("try:\n    from . import d\nexcept ImportError:\n    from evo import e\n")
    graph = import_graph(tmp_path)
    assert graph["evo.c"] == set() and graph["evo.d"] == {"evo.c"} and graph["evo.e"] == {"evo.d"}
    assert circles(graph) == [["evo.a", "evo.b"]]


def test_the_product_has_no_import_circles():
    graph = import_graph()
    assert len(graph) > 100 and graph["evo.search"]  # the product's modules, read
    assert circles(graph) == []
