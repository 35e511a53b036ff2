"""The import graph of ``linattn/`` has no cycle: every module's imports (module level and inside functions, relative
ones resolved) are read with ``ast``, and a cycle fails with its path. A cycle makes import order matter and hides
which layer depends on which; the dispatch (``ops/gated_delta``) may import the Hopper path, never the reverse."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "linattn"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The ``linattn`` modules ``path`` imports anywhere in its body: ``import a.b``, ``from a import b`` (b a module
    or a name of a), relative imports resolved against the module's package. ``from a import b`` with b a module
    counts as an import of b alone (not of a's ``__init__``, which re-exports the public names)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
            if not all(t in modules for t in targets):
                targets.append(base)          # a name of the module (or package) itself
        else:
            continue
        for target in targets:
            # the longest linattn module the target names (a submodule, or the module that holds the name)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = sorted(ROOT.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm), as a path."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_graph_is_read():
    graph = import_graph()
    assert "linattn.ops.gated_delta.chunk" in graph["linattn"] or any(
        m.startswith("linattn.ops") for m in graph["linattn"])
    assert graph["linattn.ops.hopper.forward"], "forward.py imports its stages"


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


# the PyTorch twins the Hopper stages are tested against: no dispatch in them
TWINS = {"linattn.ops.gated_delta.torch_chunk", "linattn.ops.gated_delta.reference"}


def test_hopper_does_not_import_the_dispatch():
    graph = import_graph()
    back = {(m, t) for m, targets in graph.items() if m.startswith("linattn.ops.hopper")
            for t in targets if t.startswith("linattn.ops.gated_delta") and t not in TWINS}
    assert not back, f"hopper/ imports gated_delta/: {sorted(back)}"
