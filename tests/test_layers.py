"""The layers import one way and no file imports itself back: the arrows README and docs/architecture.md
draw are the real ones.

    flows -> storage, codegen, search -> schedule -> tasks

All of them are subpackages of `tensortune` (the repository root, mapped in pyproject.toml); an import of a
bare `codegen` or `flows` would load a second copy of a module under another name (or an unrelated PyPI
project), so the walk also fails on those, in bench/ and tests/ too.

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
    parts = ("tensortune",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    return module.split(".")[1]


def _imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (any depth, any place in the file)."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        graph[name] = {t for line, t in _imported_names(tree) if line not in skip and t in modules and t != name}
    return graph


def test_packages_import_only_the_layers_below():
    bad = [f"{m} imports {t}" for m, targets in import_graph().items() for t in sorted(targets)
           if _layer(t) != _layer(m) and _layer(t) not in ALLOWED[_layer(m)]]
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
    assert "tensortune.codegen.measure" in graph
    assert any(t.startswith("tensortune.codegen.llvm_backend") for t in graph["tensortune.codegen.measure"])


def test_nothing_imports_a_layer_by_its_bare_name():
    bare = [f"{path.relative_to(ROOT)}:{line} imports {name}"
            for folder in PACKAGES + ("bench", "tests") for path in (ROOT / folder).rglob("*.py")
            for line, name in _imported_names(ast.parse(path.read_text(), str(path)))
            if name.split(".")[0] in PACKAGES]
    assert not bare, "import through the package, `tensortune.<layer>`:\n" + "\n".join(bare)


def test_the_runtime_loader_needs_numpy_and_the_standard_library_only():
    """`tensortune.runtime` (runtime.py at the root) is what a deployed process imports: nothing of the
    tuner, so nothing of tensortune at all (tests/test_aot.py checks sys.modules in a fresh process)."""
    import sys
    tree = ast.parse((ROOT / "runtime.py").read_text())
    bad = [f"runtime.py:{line} imports {name}" for line, name in _imported_names(tree)
           if name.split(".")[0] not in sys.stdlib_module_names | {"numpy", "__future__"}]
    relative = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert not bad and not relative, bad + [f"runtime.py:{line}: relative import" for line in relative]
