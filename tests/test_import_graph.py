"""The suite's packages depend on each other in one direction: ``metrics`` stands alone, the data
package reads data and knows no model or harness, methods know no harness, and no module imports
(directly or round a loop) one that imports it back. Read from the source with ``ast``: every
``import`` statement counts, at module level or inside a function, as either runs the other
module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "ccr"  # the project namespace the packages live under (``ccr.methods``)
PACKAGES = ("methods", "metrics", "datamodules", "experiments", "demo")
# package -> packages of the suite it must never import
FORBIDDEN = {
    "metrics": {"methods", "datamodules", "experiments", "demo"},
    "datamodules": {"methods", "experiments", "demo"},
    "methods": {"experiments", "demo"},
}


def module_files() -> dict[str, Path]:
    """Every module of the suite's packages by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / NAMESPACE / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The suite's modules that ``name`` (at ``path``) imports: ``from a import b`` names ``a.b``
    when that is a module, else ``a``; relative imports are resolved against ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else source)
    edges = set()
    for target in targets:
        while target and target not in modules:  # ``import a.b.c`` of a name inside ``a.b``
            target = target.rpartition(".")[0]
        if target and target != name:
            edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported(name, path, modules) for name, path in modules.items()}


def layer(module: str) -> str:
    return module.removeprefix(f"{NAMESPACE}.").split(".")[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm), each a
    set of modules that import one another round a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_every_package_and_the_imports_between_them():
    graph = import_graph()
    assert {layer(m) for m in graph} == set(PACKAGES)
    assert any(layer(t) == "datamodules" for t in graph["ccr.experiments.train"])


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_lower_package_never_imports_a_higher_one(package):
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if layer(module) == package
        for target in targets
        if layer(target) in FORBIDDEN[package]
    )
    assert upward == []


def test_the_cycle_finder_reports_a_loop_and_only_the_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
