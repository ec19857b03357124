"""The package imports downward only (docs/architecture.md, "Layers and import directions"): every
``import`` statement of every module (function-level and ``TYPE_CHECKING`` ones included, since
they are cycles hidden, not removed) is read from the source, folded to deepinfer's first-level
packages and modules, and the graph must have no cycle; models, the cache and the layers below
them never import the engine or what sits above it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import name prefix -> source folder (pyproject's package-dir)
SOURCES = {
    "deepinfer": ROOT / "src" / "deepinfer",
    "deepinfer.compile_passes": ROOT / "compile_passes",
    "deepinfer.kernels": ROOT / "kernels",
}
# first-level units that sit above everything a model needs
TOP = {"engine", "llm", "cli", "server", "bench", "integrations", "quality"}
# what each lower unit must never import (docs/architecture.md, "Layers and import directions")
FORBIDDEN = {
    "models": TOP | {"speculative", "compile", "tiny"},
    "cache": TOP | {"models", "weights", "speculative", "sampling", "compile", "tiny"},
    "weights": TOP | {"models", "cache", "speculative", "sampling", "compile", "tiny"},
    "speculative": TOP | {"models", "cache", "weights", "compile", "tiny"},
    "sampling": TOP | {"models", "cache", "weights", "speculative", "compile", "tiny"},
    "kernels": TOP | {"models", "cache", "weights", "speculative", "compile", "tiny"},
    "platforms": TOP | {"models", "cache", "weights", "speculative", "compile", "tiny"},
}

Edges = dict[tuple[str, str], list[str]]


def module_files(sources: dict[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` below each source folder."""
    modules: dict[str, Path] = {}
    for prefix, folder in sources.items():
        for file in sorted(folder.rglob("*.py")):
            parts = list(file.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([prefix, *parts])] = file
    return modules


def imported_modules(module: str, file: Path) -> list[tuple[str, int]]:
    """Every module ``file`` imports anywhere in its body, with the line."""
    package = module if file.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


def first_level(module: str) -> str:
    """``deepinfer.models.layers.moe`` -> ``models``; the package root is ``deepinfer``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def first_level_edges(sources: dict[str, Path]) -> Edges:
    """(importer unit, imported unit) -> the import sites, over every module of ``sources``."""
    modules = module_files(sources)
    edges: Edges = defaultdict(list)
    for module, file in modules.items():
        for target, line in imported_modules(module, file):
            if target not in modules:
                continue  # another package, or a name imported from a module
            a, b = first_level(module), first_level(target)
            if a != b:
                where = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
                edges[(a, b)].append(f"{where}:{line} imports {target}")
    return edges


def cycles(edges: Edges) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        graph[a].append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _explain(edges: Edges, component: list[str]) -> str:
    inside = [(a, b) for a, b in edges if a in component and b in component]
    return "\n".join(f"  {a} -> {b}: {edges[(a, b)][0]}" for a, b in sorted(inside))


def test_first_level_packages_form_no_cycle():
    edges = first_level_edges(SOURCES)
    assert ("models", "cache") in edges and ("engine", "models") in edges  # the parser sees imports
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join(_explain(edges, c) for c in found)


def upward_imports(edges: Edges) -> list[str]:
    """The edges against the layering of docs/architecture.md, with an import site each."""
    return [f"{a} -> {b}: {sites[0]}" for (a, b), sites in sorted(edges.items()) if b in FORBIDDEN.get(a, ())]


def test_lower_layers_never_import_upward():
    wrong = upward_imports(first_level_edges(SOURCES))
    assert not wrong, "imports against the layering of docs/architecture.md:\n" + "\n".join(wrong)


def test_a_cycle_hidden_in_a_function_is_found(tmp_path):
    """Mutation check of the tests above: a tree whose models import the engine inside a
    function (the pattern the first wave used) is reported, with the import site."""
    pkg = tmp_path / "deepinfer"
    for sub in ("models", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "loop.py").write_text("from deepinfer.models.base import CausalLM\n")
    (pkg / "models" / "base.py").write_text(
        "class CausalLM:\n    def forward(self):\n        from deepinfer.engine import loop\n"
    )
    edges = first_level_edges({"deepinfer": pkg})
    assert cycles(edges) == [["engine", "models"]]
    assert "models/base.py:3" in edges[("models", "engine")][0]
    assert upward_imports(edges) == [f"models -> engine: {edges[('models', 'engine')][0]}"]
