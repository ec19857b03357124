"""Errors a user meets speak of what to change, never of the project's history: no raised
message says a mode is refused "so far", a part is "not built yet" or works "for now"."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "deepinfer"
HISTORY = re.compile(r"\bso far\b|\bnot (?:built|supported|implemented) yet\b|\bnot yet\b|\bfor now\b", re.I)


def history_in_raises(source: str) -> list[tuple[int, str]]:
    """(line, text) of each string in a ``raise`` statement that speaks of the project's history."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for part in ast.walk(node.exc):
                if (
                    isinstance(part, ast.Constant)
                    and isinstance(part.value, str)
                    and HISTORY.search(part.value)
                ):
                    found.append((part.lineno, part.value))
    return found


def test_no_raised_message_speaks_of_history():
    found = {
        f"{path.relative_to(PACKAGE)}:{line}": text
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in history_in_raises(path.read_text())
    }
    assert not found, found


def test_the_scan_finds_history_in_a_raise():
    source = (
        'def f(x):\n    if x:\n        raise ValueError(f"enable_lora=True runs eager steps so far: {x}")\n'
    )
    assert [line for line, _ in history_in_raises(source)] == [3]
    assert history_in_raises('def f():\n    raise ValueError("set compile=False")\n') == []
