"""The README's performance table is the benchmark log's newest entry, made by
``benchmarks/headline.py``: it is checked against the log, and an edit to either side is seen."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("headline", ROOT / "benchmarks" / "headline.py")
headline = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("headline", headline)  # dataclasses look their module up there
_spec.loader.exec_module(headline)

ENTRY = """# Benchmark results

## 2030-01-02 — Headline figures { #headline }

- **Commit:** `abc1234`
- **Machine:** Some CPU, 2 cores, AVX2
- **Command:** `deepinfer bench batched`

<!-- headline -->
| benchmark | B | deepinfer | peer | ratio |
|---|---|---|---|---|
| decode | 1 | 48.2 | 43.2 | 1.11x |
| decode | 32 | 540.4 | 340.4 | **1.59x** |

Notes.

## 2029-12-31 — an older entry { #old }

- **Commit:** `0000000`
"""


def test_readme_figures_are_the_newest_log_entry() -> None:
    assert headline.main(["--check"]) == 0


def test_readme_block_holds_date_commit_machine_and_command() -> None:
    h = headline.parse_newest((ROOT / "benchmarks" / "RESULTS.md").read_text())
    readme = (ROOT / "README.md").read_text()
    block = readme.split(headline.BEGIN)[1].split(headline.END)[0]
    flat = " ".join(block.split())  # the lead sentence is wrapped
    for text in (h.date, h.fields["Commit"], h.fields["Machine"].rstrip(".")):
        assert " ".join(text.split()) in flat
    commands = re.findall(r"`([^`]+)`", h.fields["Command"])
    assert commands and all(f"\n{command}\n" in block for command in commands)
    assert len(h.rows) > 1 and all(headline.ratio_of(row[-1]) > 0 for row in h.rows[1:])


def test_parse_reads_only_the_newest_entry() -> None:
    h = headline.parse_newest(ENTRY)
    assert (h.date, h.anchor, h.fields["Commit"]) == ("2030-01-02", "headline", "`abc1234`")
    assert h.rows == [
        ["benchmark", "B", "deepinfer", "peer", "ratio"],
        ["decode", "1", "48.2", "43.2", "1.11x"],
        ["decode", "32", "540.4", "340.4", "**1.59x**"],
    ]
    assert [headline.ratio_of(r[-1]) for r in h.rows[1:]] == [1.11, 1.59]


def test_a_changed_figure_makes_the_readme_stale() -> None:
    """Mutation check: the comparison sees a one-digit change in the log."""
    readme = "intro\n" + headline.BEGIN + "\nold\n" + headline.END + "\nrest\n"
    fresh = headline.replace_block(readme, headline.render_block(headline.parse_newest(ENTRY)))
    mutated = ENTRY.replace("540.4", "540.5")
    assert headline.replace_block(fresh, headline.render_block(headline.parse_newest(mutated))) != fresh
    assert headline.replace_block(fresh, headline.render_block(headline.parse_newest(ENTRY))) == fresh
    assert fresh.startswith("intro\n") and fresh.endswith("\nrest\n")


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (ENTRY.replace("- **Commit:** `abc1234`\n", ""), "Commit"),
        (ENTRY.replace("<!-- headline -->\n", ""), "headline"),
        (ENTRY.replace("1.11x", "fast"), "ratio"),
        ("# Benchmark results\n\nno entries\n", "entry"),
    ],
)
def test_a_malformed_entry_is_refused_by_name(broken: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        h = headline.parse_newest(broken)
        [headline.ratio_of(r[-1]) for r in h.rows[1:]]


def test_readme_needs_exactly_one_block() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        headline.replace_block("no markers here", "x")


def test_plot_is_drawn_from_the_entry(tmp_path: Path) -> None:
    out = tmp_path / "headline.png"
    headline.draw(headline.parse_newest(ENTRY), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
