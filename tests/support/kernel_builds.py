"""When tests of the C++ CPU kernels may skip: only where the machine has no C++ compiler
(``build.compiler()``). Where one exists, a kernel that did not build is a compile error in
its source or flags; the engine then falls back to PyTorch's kernels quietly, so the tests
must fail, with the compiler's message, rather than skip."""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Callable
from pathlib import Path

import deepinfer.kernels
import pytest
from deepinfer.kernels.cpu import build as cpu_build

import deepinfer

needs_compiler = pytest.mark.skipif(
    cpu_build.compiler() is None,
    reason="no C++ compiler for the CPU kernels (apt-get install g++); with one, a compile error fails",
)


def require(built: bool, what: str) -> None:
    """Fail the calling test or fixture where ``what`` did not build although a compiler exists."""
    if not built:
        pytest.fail(
            f"{what} did not build with the C++ compiler {cpu_build.compiler()} present: "
            f"{cpu_build.errors() or 'no build error recorded'}"
        )


def kernel_sources() -> list[str]:
    """Every C++ kernel source beside ``build.py`` (the directory, not a list kept by hand)."""
    return sorted(path.name for path in cpu_build.SOURCE_DIR.glob("*.cpp"))


def _module_name(path: Path) -> str:
    for package, prefix in ((deepinfer.kernels, "deepinfer.kernels"), (deepinfer, "deepinfer")):
        root = Path(package.__file__).resolve().parent
        if path.is_relative_to(root):
            return ".".join([prefix, *path.relative_to(root).with_suffix("").parts])
    raise AssertionError(path)


def builders(name: str) -> list[str]:
    """The modules that build the source ``name``: those of the package that name it (a
    ``build.source("name")`` call or an op library's ``SOURCES``)."""
    roots = {Path(deepinfer.kernels.__file__).resolve().parent, Path(deepinfer.__file__).resolve().parent}
    found = {
        _module_name(path)
        for root in roots
        for path in root.rglob("*.py")
        if path.name != "build.py" and f'"{name}"' in path.read_text()
    }
    return sorted(found)


def builds_of(module_name: str, name: str, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each build of ``name`` that ``module_name`` makes succeeds: an op library
    (``SOURCES`` naming it) registers its ops; a ``ctypes`` library (``library()``) is
    loaded, whether or not this CPU then runs it (``int4_vnni`` answers None on CPUs without
    its instructions, though it built)."""
    module = importlib.import_module(module_name)
    if name in getattr(module, "SOURCES", ()):
        return [module.available()]
    loads: list[tuple[str, ctypes.CDLL | None]] = []
    real: Callable = cpu_build.load

    def recorded(text: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
        lib = real(text, flags)
        loads.append((text, lib))
        return lib

    with monkeypatch.context() as patch:
        patch.setattr(cpu_build, "load", recorded)
        module.library.__wrapped__()  # past its cache: the build itself is cached by ``load``
    wanted = cpu_build.source(name)
    return [lib is not None for text, lib in loads if text == wanted]
