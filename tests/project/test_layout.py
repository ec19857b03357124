"""The layout stays one a contributor can read (docs/architecture.md): small modules, an engine
loop of a few hundred lines, few loose modules at the package's top, and a Llama file that is
the architecture alone (execution modes and the C++ driver live outside it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "deepinfer"
MAX_MODULE_LINES = 500
MAX_ENGINE_LINES = 400
MAX_LOOSE_MODULES = 12


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def oversized(folder: Path, limit: int) -> list[str]:
    """Modules under ``folder`` longer than ``limit`` lines."""
    return [f"{p}: {_lines(p)}" for p in sorted(folder.rglob("*.py")) if _lines(p) > limit]


def test_no_module_is_over_the_limit():
    assert not oversized(PACKAGE, MAX_MODULE_LINES)
    assert _lines(PACKAGE / "engine" / "engine.py") <= MAX_ENGINE_LINES


def test_the_limit_check_sees_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n")
    found = oversized(tmp_path, MAX_MODULE_LINES)
    assert len(found) == 1 and found[0].endswith(f"long.py: {MAX_MODULE_LINES + 1}")


def test_few_modules_are_loose_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def execution_mode_names(source: str) -> list[str]:
    """What a model file must not hold: ``torch.compiler.is_compiling`` calls, branches on the
    research binding (``.functional``) and imports of the CPU kernels."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("is_compiling", "functional"):
            found.append(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepinfer.kernels"):
            found.append(node.module or "")
    return found


def test_the_llama_file_is_the_architecture_alone():
    assert not execution_mode_names((PACKAGE / "models" / "llama.py").read_text())


def test_the_mode_check_sees_a_branch():
    branch = "import torch\nif torch.compiler.is_compiling() or batch.functional:\n    pass\n"
    kernel = "from deepinfer.kernels.cpu import norm_act\n"
    assert sorted(execution_mode_names(branch)) == ["functional", "is_compiling"]
    assert execution_mode_names(kernel) == ["deepinfer.kernels.cpu"]
