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


TESTS = ROOT / "tests"
TEST_LAYERS = {
    "models",
    "kernels",
    "compile",
    "cache",
    "engine",
    "rl",
    "sampling",
    "server",
    "frontends",
    "project",
}


def misplaced_test_files(tests: Path) -> list[str]:
    """Test files outside a layer folder, and helpers outside ``support/`` (docs/contributing.md)."""
    wrong = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if rel == Path("conftest.py") or "__pycache__" in rel.parts:
            continue
        folder = rel.parts[0] if len(rel.parts) == 2 else None
        is_test = path.name.startswith("test_")
        if (is_test and folder not in TEST_LAYERS) or (not is_test and folder != "support"):
            wrong.append(str(rel))
    return wrong


def test_tests_sit_in_their_layer_and_helpers_in_support():
    assert not misplaced_test_files(TESTS)
    assert {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"} == TEST_LAYERS | {
        "support"
    }


def test_a_loose_test_file_is_found(tmp_path):
    """Mutation check: a test file at the top and a helper beside the tests are reported."""
    (tmp_path / "engine").mkdir()
    (tmp_path / "support").mkdir()
    for rel in ("conftest.py", "test_loose.py", "engine/test_ok.py", "engine/helper.py", "support/ok.py"):
        (tmp_path / rel).write_text("")
    assert misplaced_test_files(tmp_path) == ["engine/helper.py", "test_loose.py"]
