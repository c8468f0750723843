"""Dependencies point down: the graph of every import in attnprobe/, those inside functions included, has no cycle.

An import inside a function runs late, so Python never reports the cycle it closes; this test reads the source
(ast) instead of importing it. Imports under `if TYPE_CHECKING:` never run and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attnprobe"

# The only cycles allowed, each (importer, imported) named with its reason. Nothing else may be added here: move the
# code to the layer that owns it instead (docs/development.md).
ALLOWED = {
    # io's modules reach their writers through the package (`from attnprobe import io` inside the function, then
    # `io.json_writer(...)`), so that a test that patches `io.json_writer` reaches every caller: a patch point of
    # the package's own façade, not a dependency on another layer
    ("attnprobe.io.writing", "attnprobe.io"),
    ("attnprobe.io.writers", "attnprobe.io"),
}


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at `root` (a package's name for its __init__.py)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only, never run)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for inner in ast.walk(node))
    return skipped


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement in `module` names: `from a import b` names a.b (a submodule) or a."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level or inside a function."""
    names = module_names(root)

    def owner(name: str) -> str | None:  # the module a dotted name lives in
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in names}
    for module, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = type_checking_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skipped:
                continue
            targets = imported(node, module, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):  # `from pkg import sub` depends on pkg.sub, not on pkg's __init__
                submodules = [t for t in targets[:-1] if t in names]
                targets = submodules if len(submodules) == len(targets) - 1 else targets
            graph[module].update(t for t in map(owner, targets) if t and t != module)
    return graph


def cycles(graph: dict[str, set[str]], allowed: set[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan), each sorted, `allowed` edges left out."""
    edges = {a: sorted(b for b in targets if (a, b) not in allowed) for a, targets in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in edges.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def explain(graph: dict[str, set[str]], group: list[str]) -> str:
    """The imports inside one cycle, one per line."""
    return "\n".join(f"  {a} -> {b}" for a in group for b in sorted(graph[a]) if b in group)


def test_attnprobe_imports_have_no_cycle():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and graph["attnprobe.similarity"], "the graph did not read the package"
    found = cycles(graph, ALLOWED)
    assert not found, "import cycles (move the code to the layer that owns it):\n" + "\n".join(
        explain(graph, group) for group in found)


def test_allowed_edges_are_still_there():
    graph = import_graph(PACKAGE)
    assert all(b in graph[a] for a, b in ALLOWED), "an allowed import is gone: take it off ALLOWED"


def write_package(root: Path, files: dict[str, str]) -> Path:
    package = root / "pkg"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return package


@pytest.mark.parametrize("late", [
    "def f():\n    from pkg import low\n",
    "def f():\n    from pkg.low import thing\n",
    "def f():\n    import pkg.low\n",
    "def f():\n    from . import low\n",
    "class C:\n    def f(self):\n        from .low import thing\n",
])
def test_a_function_level_import_that_closes_a_cycle_is_found(tmp_path, late):
    package = write_package(tmp_path, {"__init__.py": "", "low.py": "from pkg.high import g\nthing = 1\n",
                                       "high.py": "import numpy\n" + late + "def g():\n    pass\n"})
    assert cycles(import_graph(package)) == [["pkg.high", "pkg.low"]]


def test_downward_and_type_checking_imports_are_no_cycle(tmp_path):
    package = write_package(tmp_path, {
        "__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import g\n",
        "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import g\nthing = 1\n",
        "high.py": "def g():\n    from pkg.low import thing\n    from pkg import sub\n",
        "sub/__init__.py": "from pkg.sub.inner import x\n", "sub/inner.py": "from pkg import low\nx = 1\n",
    })
    graph = import_graph(package)
    assert graph["pkg.high"] == {"pkg.low", "pkg.sub"} and graph["pkg.sub.inner"] == {"pkg.low"}
    assert cycles(graph) == []
