"""The layers import one way and no file imports itself back: the arrows README and docs/architecture.md
draw are the real ones.

    flows -> storage, codegen, search -> schedule -> tasks

Every import statement counts, also one inside a function (a hidden loop is still a loop), except those
under `if TYPE_CHECKING:`, which only the type checker runs (schedule/steps.py names State in its
annotations that way; state.py imports the steps).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tasks", "schedule", "search", "codegen", "storage", "flows")
# what each package may import besides itself
ALLOWED = {
    "tasks": set(),
    "schedule": {"tasks"},
    "search": {"schedule", "tasks"},
    "codegen": {"schedule", "tasks"},
    "storage": set(),
    "flows": {"storage", "codegen", "search", "schedule", "tasks"},
}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (any depth, any place in the file)."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        found: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    found.add(t)
        graph[name] = found
    return graph


def test_packages_import_only_the_layers_below():
    bad = [f"{m} imports {t}" for m, targets in import_graph().items() for t in sorted(targets)
           if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]]]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycle_between_files():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:                   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "files that import each other (directly or around a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_checker_sees_imports_inside_functions():
    """The graph is built from every import statement, so it would see a loop hidden in a function."""
    graph = import_graph()
    assert "codegen.measure" in graph and any(t.startswith("codegen.llvm_backend") for t in graph["codegen.measure"])
