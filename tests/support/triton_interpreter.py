"""Triton kernels tested on the CPU: a test file runs itself again in a child pytest with
``TRITON_INTERPRET=1`` (the interpreter is chosen when Triton first loads, so this process,
which may have imported Triton already, cannot switch). The tests marked ``interpreted_only``
run in that child; the parent's ``run_in_interpreter`` fails when any of them does."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreted child pytest")


def run_in_interpreter(test_file: str, timeout: int = 600) -> None:
    """Run ``test_file``'s tests under the interpreter in a child pytest; they must pass."""
    pytest.importorskip("triton")  # a dev dependency; absent only on platforms without wheels
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", test_file]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]


def load_module(path: Path, name: str) -> ModuleType:
    """A module from a file (a kernel's mutant written beside the test)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mutant_of(kernel_file: Path, line: str, wrong: str, folder: Path, name: str) -> ModuleType:
    """The kernel module with ``line`` (there exactly once) replaced by ``wrong``, its ops
    renamed ``deepinfer::{name}_...`` so they register beside the real ones: a mutation
    check's broken kernel."""
    source = kernel_file.read_text()
    assert source.count(line) == 1, line
    path = folder / f"{name}.py"
    path.write_text(source.replace(line, wrong).replace('"deepinfer::', f'"deepinfer::{name}_'))
    return load_module(path, f"_mutant_{name}")


def run_code_in_interpreter(code: str, timeout: int = 600) -> None:
    """Run a script under the interpreter in a child Python; it must end by printing "ok"
    (the checks of a kernel that a file runs as scripts rather than as a child pytest)."""
    pytest.importorskip("triton")  # a dev dependency; absent only on platforms without wheels
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-3000:]
