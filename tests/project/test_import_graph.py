"""The import graph of the project's packages has no circles, lazy imports (inside functions)
included, and the layers import downwards only: experiments -> {sim, engine} -> policies, kernels
beside engine. Imports are read with `ast`, so nothing is executed. An entry point (a module of
experiments/ or experiments/lab/ run with `python -m`) imports libraries, never another entry point."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("policies", "sim", "engine", "kernels", "experiments")
# Which packages each may import (besides itself).
ALLOWED = {"policies": set(), "kernels": set(), "sim": {"policies"}, "engine": {"policies", "kernels"},
           "experiments": {"policies", "sim", "engine", "kernels"}}


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module `name` is, or the longest project module it lies in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_only(tree: ast.AST) -> set[ast.AST]:
    """The import statements under `if TYPE_CHECKING:` (never run)."""
    return {inner for node in ast.walk(tree) if isinstance(node, ast.If)
            and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING" for stmt in node.body for inner in ast.walk(stmt)}


def _imports(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = _type_checking_only(tree)
    found = set()
    for node in ast.walk(tree):
        if node in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            targets = [t for t in targets if _resolve(t) != _resolve(base)] or [base]
        else:
            continue
        for target in targets:
            resolved = _resolve(target)
            if resolved is not None and resolved != name:
                found.add(resolved)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def test_the_finder_sees_a_circle_through_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from engine.models import MODELS\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))  # ast.walk reaches function bodies


def test_packages_import_downwards_only():
    wrong = sorted((name, target) for name, targets in GRAPH.items() for target in targets
                   if target.split(".")[0] != name.split(".")[0]
                   and target.split(".")[0] not in ALLOWED[name.split(".")[0]])
    assert wrong == []


def _is_entry_point(name: str) -> bool:
    """A command of experiments/ or experiments/lab/ (a library module under experiments/lib may
    run as a helper process too: it is still a library)."""
    return (name.rpartition(".")[0] in ("experiments", "experiments.lab")
            and 'if __name__ == "__main__"' in MODULES[name].read_text())


def test_entry_points_import_no_other_entry_point():
    entries = {name for name in MODULES if _is_entry_point(name)}
    assert {"experiments.run", "experiments.ab", "experiments.fidelity"} <= entries
    wrong = sorted((name, target) for name in entries for target in GRAPH[name] if target in entries)
    assert wrong == []
