"""A regular (non-editable) install ships every subpackage: pyproject's explicit package list
must name each folder with an ``__init__.py``, or ``pip install .`` silently drops it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
