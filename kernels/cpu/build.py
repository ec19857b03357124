"""Builds the C++ CPU kernels from their sources beside this module (``*.cpp``, and ``*.h``
for code several share; ``source`` reads them). ``load``: plain C functions with Inductor's
compiler driver (``CppCodeCache``): the flags, vector-ISA pick and on-disk cache Inductor uses
for its own generated kernels, so a kernel is compiled once per machine and loaded from the
cache afterwards. ``load_op_library``: ops registered with PyTorch's dispatcher (a compiled
step's C++ wrapper calls them without going through Python), built by
``torch.utils.cpp_extension`` for the vector ISA Inductor picks. Sources use ATen's portable
``at::vec::Vectorized`` (AVX2, AVX-512, NEON or scalar).

A build that fails falls back to PyTorch's kernels either way, but the two causes are told
apart: no C++ compiler on the machine is a warning (the fallback is what such a machine gets),
while a failure with a compiler present (a compile error in a source) is logged as an error
with the compiler's output and kept in ``errors()``; tests skip only where ``compiler()`` is
None, so a compile error fails them instead of skipping them."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

# A build takes well under a minute; a lock this old was left by a build that was killed, and
# PyTorch's builder would wait on it forever.
STALE_LOCK_S = 600.0

# the kernels' C++ sources (package data of ``deepinfer.kernels.cpu``)
SOURCE_DIR = Path(__file__).resolve().parent

_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_C_SHIM = re.compile(r'extern "C"\s+(AOTITorchError\s+aoti_torch_cpu_(\w+)\s*\([^)]*\))')

_OP_LIBRARY_LOCK = threading.Lock()
_OP_LIBRARIES: dict[str, bool] = {}  # prefix -> registered in this process
_ERRORS: list[str] = []  # builds that failed with a compiler present, in this process


@functools.cache
def compiler() -> str | None:
    """The C++ compiler the builds use (Inductor's pick for ``load``, which
    ``torch.utils.cpp_extension`` also finds on ``PATH`` for ``load_op_library``), or None
    where the machine has none: the one case in which a failed build is expected."""
    from torch._inductor import cpp_builder

    try:
        found = cpp_builder.get_cpp_compiler()
    except Exception:  # Inductor's InvalidCxxCompiler, or a compiler that does not run
        return None
    return shutil.which(found) or found


def errors() -> list[str]:
    """The failures of builds tried in this process while ``compiler()`` existed (empty
    where every build worked): what a test reports when a kernel is unavailable."""
    return list(_ERRORS)


def _failed(what: str, exc: BaseException) -> None:
    """Log a failed build: a warning where no compiler exists, else an error kept in
    ``errors()`` (the fallback then hides a broken source, so it must be loud)."""
    if compiler() is None:
        logger.warning("%s: no C++ compiler (%s)", what, exc)
        return
    message = f"{what}: the build failed with the compiler {compiler()} present: {exc}"
    _ERRORS.append(message)
    logger.error("%s", message)


def source(*names: str) -> str:
    """The text the compiler gets for the files ``names`` (in ``SOURCE_DIR``), one after another
    as one translation unit, each ``#include "file"`` of a file there written in place (once).
    Both build caches key on this text, so an edit of any file it reads builds anew."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        seen.add(name)
        text = (SOURCE_DIR / name).read_text()
        return _LOCAL_INCLUDE.sub(lambda m: "" if m.group(1) in seen else expand(m.group(1)), text)

    return "".join(expand(name) for name in names)


def define_flags(defines: Mapping[str, int]) -> tuple[str, ...]:
    """``-DNAME=value`` for each constant a source takes from Python."""
    return tuple(f"-D{name}={value}" for name, value in defines.items())


def c_shims(name: str) -> dict[str, str]:
    """The C shims ``name`` defines (``extern "C" AOTITorchError aoti_torch_cpu_<op>(...)``,
    Inductor's calling convention): op name -> signature on one line, as
    ``aot_inductor.custom_ops_to_c_shims`` declares it to a compiled step's wrapper."""
    return {m.group(2): " ".join(m.group(1).split()) for m in _C_SHIM.finditer(source(name))}


@functools.cache
def load(source: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from ``source`` (text: see ``source()``) with the compiler ``flags``
    added to Inductor's, or None where building fails: callers fall back to PyTorch's kernels
    (a failure with a compiler present is logged as an error, see ``_failed``)."""
    try:
        from torch._inductor.codecache import CppCodeCache

        return CppCodeCache.load(source, extra_flags=flags)
    except Exception as exc:
        first = next((line for line in source.splitlines() if line.strip()), "")
        _failed(f"CPU kernels unavailable, using PyTorch's (source starting {first!r})", exc)
        return None


def bind(lib: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = None
    return fn


# What Inductor's own C++ builds use for floating point (``cpp_builder._get_ffast_math_flags``
# with its defaults): no FMA contraction the source did not write, so a kernel built here gives
# the bits the ``load`` build of the same source gives.
INDUCTOR_MATH_FLAGS = ("-fno-trapping-math", "-fno-signed-zeros", "-ffp-contract=off")


def load_op_library(
    prefix: str,
    sources: tuple[str, ...],
    register_fakes: Callable[[], None],
    unavailable: str,
    extra_flags: tuple[str, ...] = (),
) -> bool:
    """Whether the ops of ``source(*sources)`` are registered in this process: built (or loaded from
    PyTorch's extension cache, ``~/.cache/torch_extensions``) on the first call for ``prefix``,
    its ``TORCH_LIBRARY`` blocks registering the ops as it loads, then ``register_fakes()`` (their
    shapes for the compiler). The extension's name is ``prefix`` and a digest of the source and
    flags, so an edit builds anew. Its symbols are then made global: a compiled step's C++
    wrapper calls the ops' C shims (``extern "C" aoti_torch_cpu_<op>``) by name, and the
    dynamic loader resolves them when the step's library loads. Where the build fails it logs
    ``unavailable`` with the error (as an error where a compiler exists, see ``_failed``) and
    answers False, and callers keep their fallback."""
    found = _OP_LIBRARIES.get(prefix)
    if found is not None:
        return found
    with _OP_LIBRARY_LOCK:
        if prefix not in _OP_LIBRARIES:
            try:
                _build_op_library(prefix, source(*sources), extra_flags)
                register_fakes()
                _OP_LIBRARIES[prefix] = True
            except Exception as exc:
                _failed(f"{unavailable} ({prefix})", exc)
                _OP_LIBRARIES[prefix] = False
        return _OP_LIBRARIES[prefix]


def _build_op_library(prefix: str, source: str, extra_flags: tuple[str, ...]) -> None:
    path = _build_and_load(prefix, source, extra_flags)
    # torch.ops.load_library opened it RTLD_LOCAL; reopening it RTLD_GLOBAL | RTLD_NOLOAD
    # promotes the loaded copy (no second copy, no second registration of its ops)
    ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)


def _build_and_load(prefix: str, source: str, extra_flags: tuple[str, ...]) -> str:
    """Build (or find built) and load the extension; its path."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch.utils import cpp_extension

    isa = pick_vec_isa()
    flags = ["-O3", "-fopenmp", *str(isa.build_arch_flags()).split()]
    flags += [f"-D{macro}" for macro in isa.build_macro()]
    flags += extra_flags
    digest = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    name = f"{prefix}_{digest}"
    build_dir = Path(cpp_extension.get_default_build_root()) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    drop_stale_lock(build_dir / "lock")
    return cpp_extension.load_inline(
        name=name,
        cpp_sources=[source],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
    )


def drop_stale_lock(lock: Path) -> None:
    """Remove a build lock older than ``STALE_LOCK_S`` (its build was killed)."""
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            logger.warning("removed a stale build lock %s", lock)
    except FileNotFoundError:
        pass
