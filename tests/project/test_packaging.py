"""A regular (non-editable) install ships every subpackage and every C++ source: pyproject's
explicit package list must name each folder with an ``__init__.py``, and its package data each
``.cpp`` / ``.h``, or ``pip install .`` silently drops them."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def packages_on_disk(package_dir: dict[str, str]) -> set[str]:
    """Every importable package under the folders pyproject maps, by dotted name."""
    found = set()
    for name, folder in package_dir.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" in rel.parts:
                continue
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_subpackage_is_listed_for_install() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = packages_on_disk(config["package-dir"])
    assert on_disk - listed == set(), f"missing from [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"listed but absent: {sorted(listed - on_disk)}"


def test_the_check_sees_a_dropped_package() -> None:
    """Mutation check: a list without one package is caught."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = packages_on_disk(config["package-dir"])
    assert "deepinfer.chat" in on_disk and "deepinfer.kernels" in on_disk
    assert on_disk - (set(config["packages"]) - {"deepinfer.chat"}) == {"deepinfer.chat"}


def sources_not_shipped(config: dict) -> set[str]:
    """C++ sources (``.cpp``, ``.h``) under a package folder that no ``package-data`` pattern
    of their package names: ``pip install .`` would leave them out and the kernels unbuilt."""
    data = config.get("package-data", {})
    missing = set()
    for name, folder in config["package-dir"].items():
        base = ROOT / folder
        for path in [*base.rglob("*.cpp"), *base.rglob("*.h")]:
            package = ".".join([name, *path.parent.relative_to(base).parts])
            if not any(fnmatch.fnmatch(path.name, pattern) for pattern in data.get(package, [])):
                missing.add(str(path.relative_to(ROOT)))
    return missing


def test_every_cpp_source_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert (ROOT / "kernels" / "cpu" / "step_ops.cpp").is_file()
    assert sources_not_shipped(config) == set(), "add them to [tool.setuptools.package-data]"


def test_the_check_sees_an_unshipped_source() -> None:
    """Mutation check: without the CPU kernels' entry their sources are reported."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    config["package-data"] = {k: v for k, v in config["package-data"].items() if k != "deepinfer.kernels.cpu"}
    missing = sources_not_shipped(config)
    assert "kernels/cpu/step_ops.cpp" in missing and "kernels/cpu/fp8.h" in missing
