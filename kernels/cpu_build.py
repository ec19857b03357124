"""Builds the C++ CPU kernels. ``load``: plain C functions with Inductor's compiler driver
(``CppCodeCache``): the flags, vector-ISA pick and on-disk cache Inductor uses for its own
generated kernels, so a kernel is compiled once per machine and loaded from the cache
afterwards. ``load_op_library``: ops registered with PyTorch's dispatcher (a compiled step's
C++ wrapper calls them without going through Python), built by ``torch.utils.cpp_extension`` for the vector
ISA Inductor picks. Sources use ATen's portable ``at::vec::Vectorized`` (AVX2, AVX-512, NEON or
scalar)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

# A build takes well under a minute; a lock this old was left by a build that was killed, and
# PyTorch's builder would wait on it forever.
STALE_LOCK_S = 600.0

_OP_LIBRARY_LOCK = threading.Lock()
_OP_LIBRARIES: dict[str, bool] = {}  # prefix -> registered in this process


@functools.cache
def load(source: str) -> ctypes.CDLL | None:
    """The built library, or None where building fails (no compiler): callers fall back to
    PyTorch's kernels."""
    try:
        from torch._inductor.codecache import CppCodeCache

        return CppCodeCache.load(source)
    except Exception as exc:
        logger.warning("CPU kernels unavailable (%s); using PyTorch's", exc)
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
    source: Callable[[], str],
    register_fakes: Callable[[], None],
    unavailable: str,
    extra_flags: tuple[str, ...] = (),
) -> bool:
    """Whether the ops of ``source()`` are registered in this process: built (or loaded from
    PyTorch's extension cache, ``~/.cache/torch_extensions``) on the first call for ``prefix``,
    its ``TORCH_LIBRARY`` blocks registering the ops as it loads, then ``register_fakes()`` (their
    shapes for the compiler). The extension's name is ``prefix`` and a digest of the source and
    flags, so an edit builds anew. Its symbols are then made global: a compiled step's C++
    wrapper calls the ops' C shims (``extern "C" aoti_torch_cpu_<op>``) by name, and the
    dynamic loader resolves them when the step's library loads. Where the build fails (no
    compiler) it logs ``unavailable`` with the error and answers False, and callers keep their
    fallback."""
    found = _OP_LIBRARIES.get(prefix)
    if found is not None:
        return found
    with _OP_LIBRARY_LOCK:
        if prefix not in _OP_LIBRARIES:
            try:
                _build_op_library(prefix, source(), extra_flags)
                register_fakes()
                _OP_LIBRARIES[prefix] = True
            except Exception as exc:
                logger.warning("%s (%s)", unavailable, exc)
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
