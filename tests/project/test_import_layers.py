"""The package imports downward only (docs/architecture.md, "Layers and import directions"): every
``import`` statement of every module (function-level and ``TYPE_CHECKING`` ones included, since
they are cycles hidden, not removed) is read from the source, folded to deepinfer's first-level
packages and modules, and the graph must have no cycle; models, the cache and the layers below
them never import the engine or what sits above it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def _where(file: Path) -> Path:
    """``file`` as the repository names it (a synthetic tree's files as they are)."""
    return file.relative_to(ROOT) if file.is_relative_to(ROOT) else file


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
                where = _where(file)
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
    function (the way a deferred import hides a cycle) is reported, with the import site."""
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


# ---- file level ---------------------------------------------------------------------------


def module_edges(sources: dict[str, Path]) -> Edges:
    """(importer module, imported module) -> the import sites, between the modules of
    ``sources`` (an import of a module's own package is no edge: Python runs the package
    first whatever the module imports)."""
    modules = module_files(sources)
    edges: Edges = defaultdict(list)
    for module, file in modules.items():
        for target, line in imported_modules(module, file):
            if target in modules and target != module and not module.startswith(target + "."):
                where = _where(file)
                edges[(module, target)].append(f"{where}:{line}")
    return edges


def test_modules_form_no_cycle_at_file_level():
    """Two files that import each other, anywhere in their bodies, are one unit in two
    files: the layering test above folds them into packages and would not see it."""
    edges = module_edges(SOURCES)
    assert ("deepinfer.engine.engine", "deepinfer.engine.scheduler") in edges  # the parser sees imports
    found = cycles(edges)
    assert not found, "file-level import cycles:\n" + "\n".join(_explain(edges, c) for c in found)


def test_a_file_level_cycle_inside_one_package_is_found(tmp_path):
    """Mutation check of the file-level test: two engine files that import each other (one
    only under TYPE_CHECKING) form a cycle the package-level graph cannot show."""
    engine = tmp_path / "deepinfer" / "engine"
    engine.mkdir(parents=True)
    for init in (tmp_path / "deepinfer" / "__init__.py", engine / "__init__.py"):
        init.write_text("")
    (engine / "loop.py").write_text("from deepinfer.engine.sync import WeightSync\n")
    (engine / "sync.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from deepinfer.engine.loop import Engine\n"
    )
    sources = {"deepinfer": tmp_path / "deepinfer"}
    assert cycles(first_level_edges(sources)) == []
    assert cycles(module_edges(sources)) == [["deepinfer.engine.loop", "deepinfer.engine.sync"]]


# ---- private attributes -----------------------------------------------------------------


def private_names_defined(file: Path) -> set[str]:
    """The ``_name``s ``file`` defines: module-level and class-level names, methods, and
    attributes it assigns on ``self`` or ``cls``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


# privates of other projects that a name of ours shares, read on their objects
THIRD_PARTY_PRIVATES = {
    "_version",  # torch.Tensor's version counter (in-place writes)
    "_base",  # torch.Tensor's view base (a step's metadata buffer, copied whole into a graph's)
}


def module_aliases(tree: ast.AST, package: str, modules: dict[str, Path]) -> tuple[dict[str, Path], set[str]]:
    """The names a file binds to modules of ours (-> their files), and the names it binds to
    anything imported from elsewhere (``torch``, ``aten``, ``ctypes``)."""
    ours: dict[str, Path] = {}
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if alias.name in modules:
                    ours[bound] = modules[alias.name]
                else:
                    foreign.add(bound)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                bound, full = alias.asname or alias.name, f"{base}.{alias.name}"
                if full in modules:
                    ours[bound] = modules[full]
                elif not base.startswith("deepinfer"):
                    foreign.add(bound)
    return ours, foreign


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute | ast.Call | ast.Subscript):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def foreign_private_reads(sources: dict[str, Path]) -> list[str]:
    """Every ``obj._name`` (obj not ``self``/``cls``) that reads or sets state another part
    owns: a private of another module of ours (``gemv._library``), or, on any other object,
    a ``_name`` some other file of ``sources`` defines and this file does not. Reads on
    objects of other projects (``torch._dynamo``, ``aten._softmax``) are their contract."""
    modules = module_files(sources)
    defined = {file: private_names_defined(file) for file in modules.values()}
    ours = set().union(*defined.values()) - THIRD_PARTY_PRIVATES
    found = []
    for module, file in modules.items():
        tree = ast.parse(file.read_text(), str(file))
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        aliases, foreign = module_aliases(tree, package, modules)
        for node in ast.walk(tree):
            if (
                not isinstance(node, ast.Attribute)
                or not node.attr.startswith("_")
                or node.attr.startswith("__")
            ):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Name) and value.id in aliases:
                wrong = aliases[value.id] != file  # a module of ours: its privates are its own
            else:
                wrong = (
                    node.attr in ours and node.attr not in defined[file] and _root_name(value) not in foreign
                )
            if wrong:
                where = _where(file)
                found.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_part_reads_another_parts_private_attributes():
    """Each piece of state has one owner; others ask it through its public operations."""
    found = foreign_private_reads(SOURCES)
    assert not found, "private attributes read outside their owner:\n" + "\n".join(found)


def test_a_private_read_from_outside_is_found(tmp_path):
    """Mutation check: a helper that reads the engine's ``_inflight``, or another module's
    ``_library`` (though it has one of its own), is reported; the engine reading its own,
    and third-party privates, are not."""
    pkg = tmp_path / "deepinfer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text(
        "class Engine:\n    def __init__(self):\n        self._inflight = None\n"
        "    def busy(self):\n        return self._inflight is not None\n"
    )
    (pkg / "kernel.py").write_text("def _library():\n    return None\n")
    (pkg / "sync.py").write_text(
        "import torch\nfrom deepinfer import kernel\n\ndef _library():\n    return None\n\n"
        "def apply(engine, t):\n    return engine._inflight, t._version, torch._dynamo, kernel._library()\n"
    )
    sync = pkg / "sync.py"
    assert foreign_private_reads({"deepinfer": pkg}) == [
        f"{sync}:8 engine._inflight",
        f"{sync}:8 kernel._library",
    ]


# ---- the map's import table -------------------------------------------------------------

ARCHITECTURE = ROOT / "docs" / "architecture.md"


def documented_edges(markdown: str) -> dict[str, set[str]]:
    """The import table of docs/architecture.md ("Layers and import directions"): the
    ``text`` block's ``unit -> a, b`` lines (an indented line goes on with the targets,
    ``#`` starts a comment, ``nothing`` is no target)."""
    section = markdown.split("## Layers and import directions", 1)[1]
    block = section.split("```text\n", 1)[1].split("```", 1)[0]
    table: dict[str, set[str]] = {}
    unit = None
    for raw in block.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line:
            continue
        if not raw[0].isspace():
            unit, _, line = line.partition("->")
            unit = unit.split("(")[0].strip()
            table.setdefault(unit, set())
        assert unit is not None, f"a continuation line before any unit: {raw!r}"
        targets = {t.strip() for t in line.split(",") if t.strip() and t.strip() != "nothing"}
        table[unit] |= targets
    return table


def table_mismatch(doc: dict[str, set[str]], edges: Edges) -> list[str]:
    """How the documented table differs from the code's first-level import graph."""
    code: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        code[a].add(b)
        code.setdefault(b, set())
    out = [
        f"not in the table: {a} -> {b} ({edges[(a, b)][0]})"
        for a in code
        for b in code[a] - doc.get(a, set())
    ]
    out += [f"in the table, not the code: {a} -> {b}" for a in doc for b in doc[a] - code.get(a, set())]
    out += [f"a unit in one only: {u}" for u in set(code) ^ set(doc)]
    return sorted(out)


def test_the_maps_import_table_is_the_import_graph():
    """docs/architecture.md lists every first-level unit and exactly the units it imports."""
    wrong = table_mismatch(documented_edges(ARCHITECTURE.read_text()), first_level_edges(SOURCES))
    assert not wrong, "docs/architecture.md's import table is not the code's:\n" + "\n".join(wrong)


def test_a_wrong_table_is_caught():
    """Mutation check: the table without one of its edges, or with one the code lacks, fails."""
    text, edges = ARCHITECTURE.read_text(), first_level_edges(SOURCES)
    assert "engine" in documented_edges(text)["llm"]
    dropped = text.replace(
        "\nllm -> chat, config, distributed, engine, ", "\nllm -> chat, config, distributed, ", 1
    )
    assert dropped != text
    assert any(
        m.startswith("not in the table: llm -> engine ")
        for m in table_mismatch(documented_edges(dropped), edges)
    )
    added = text.replace("\nerrors -> nothing", "\nerrors -> engine", 1)
    assert added != text
    assert "in the table, not the code: errors -> engine" in table_mismatch(documented_edges(added), edges)
