"""C++ lives in ``.cpp`` and ``.h`` files (``kernels/cpu/``), never in Python strings: a kernel
is read, diffed and edited as C++, and the build code names the files it compiles."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from deepinfer.kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]
PYTHON_ROOTS = ("src", "kernels", "compile_passes")

# what only C or C++ source has: an include line, a pybind / dispatcher registration block, an
# extern "C" function definition
_CPP = (
    re.compile(r'^\s*#\s*include\s*[<"][\w./]+[>"]', re.MULTILINE),
    re.compile(r"\b(PYBIND11_MODULE|TORCH_LIBRARY(_FRAGMENT|_IMPL)?)\s*\("),
    re.compile(r'extern\s+"C"[^\n`]*\)\s*\{'),
)
_SOURCE_NAME = re.compile(r"^[\w./-]+\.(cpp|h)$")


def _python_files() -> list[Path]:
    return sorted(
        p for root in PYTHON_ROOTS for p in (ROOT / root).rglob("*.py") if "__pycache__" not in p.parts
    )


def _strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal in ``path``, f-strings' literal parts included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def _cpp_strings(path: Path) -> list[int]:
    return [line for line, text in _strings(path) if any(marker.search(text) for marker in _CPP)]


def test_no_python_string_holds_cpp_source() -> None:
    found = {str(p.relative_to(ROOT)): lines for p in _python_files() if (lines := _cpp_strings(p))}
    assert found == {}, (
        f"C++ source in Python strings (file: lines); move it to a .cpp under kernels/cpu/: {found}"
    )


def test_the_check_sees_cpp_in_a_string(tmp_path: Path) -> None:
    """Mutation check: a module holding a kernel's source as a string is caught."""
    module = tmp_path / "inline.py"
    source = (build.SOURCE_DIR / "norm_act.cpp").read_text()
    module.write_text(f"_SOURCE = r'''\n{source}'''\n")
    assert _cpp_strings(module) == [1]


def test_every_named_source_exists_and_compiles_as_one_text() -> None:
    """Each ``.cpp`` / ``.h`` a Python module names is a file beside it or in ``kernels/cpu``,
    and each of those files' local includes resolves (``build.source``)."""
    named = {
        (path, text) for path in _python_files() for _, text in _strings(path) if _SOURCE_NAME.match(text)
    }
    assert any(text == "step_ops.cpp" for _, text in named)
    missing = [
        f"{path.relative_to(ROOT)}: {text}"
        for path, text in sorted(named)
        if not (build.SOURCE_DIR / text).is_file() and not (path.parent / text).is_file()
    ]
    assert missing == []
    for source in sorted(build.SOURCE_DIR.glob("*.cpp")):
        text = build.source(source.name)
        assert not re.search(r'^\s*#\s*include\s*"', text, re.MULTILINE), source.name


def test_an_edited_header_changes_the_text_the_build_caches_key_on() -> None:
    """Both build caches key on ``build.source``'s text: a header's lines are in it."""
    header = (build.SOURCE_DIR / "fp8.h").read_text()
    assert header in build.source("attention.cpp")
    assert build.source("attention.cpp").count("DEEPINFER_KERNELS_CPU_FP8_H") == 3  # written in once


def test_c_shims_read_from_the_source() -> None:
    """The shim signatures a compiled step's wrapper declares are the ones the source defines."""
    shims = build.c_shims("step_ops.cpp")
    assert set(shims) == {
        "routed_experts_cpu",
        "sinkhorn_cpu",
        "rope_cpu",
        "indexer_topk_cpu",
        "sink_attention_rows_cpu",
    }
    assert shims["sinkhorn_cpu"] == (
        "AOTITorchError aoti_torch_cpu_sinkhorn_cpu(AtenTensorHandle comb, int64_t iters, double eps, "
        "AtenTensorHandle* ret0)"
    )
    assert list(build.c_shims("linear_op.cpp")) == ["packed_linear"]
