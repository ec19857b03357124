"""The README's performance table and plot, made from the newest entry of the benchmark log.

The newest entry of ``benchmarks/RESULTS.md`` (the first ``## YYYY-MM-DD`` heading) carries its
fields (``**Commit:**``, ``**Machine:**``, ``**Software:**``, ``**Command:**``) and, after the
line ``<!-- headline -->``, a table whose last column is the ratio against the peer. This script
copies that table with its date, commit, machine and command into README.md between
``<!-- figures:begin -->`` and ``<!-- figures:end -->`` and draws the ratios to
``docs/assets/headline.png``, so the README never holds a figure the log does not.

Run: ``python benchmarks/headline.py`` (rewrite), ``--check`` (exit 1 when README.md is stale).
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "benchmarks" / "RESULTS.md"
README = ROOT / "README.md"
PLOT = ROOT / "docs" / "assets" / "headline.png"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
TABLE_MARK = "<!-- headline -->"
_ENTRY = re.compile(r"^## (\d{4}-\d{2}-\d{2}) — (.+?)(?:\s*\{\s*#([\w-]+)\s*\})?\s*$")
_FIELD = re.compile(r"^- \*\*(Commit|Machine|Software|Command):\*\*\s*(.+)$")


@dataclass
class Headline:
    """The newest log entry's identity and its headline table (header row first)."""

    date: str
    title: str
    anchor: str | None
    fields: dict[str, str]
    rows: list[list[str]]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_newest(log_text: str) -> Headline:
    """The first dated entry of the log; raises ValueError naming what is missing."""
    lines = log_text.splitlines()
    start = next((i for i, line in enumerate(lines) if _ENTRY.match(line)), None)
    if start is None:
        raise ValueError("benchmark log: no '## YYYY-MM-DD — title' entry")
    date, title, anchor = _ENTRY.match(lines[start]).groups()
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = lines[start + 1 : end]
    fields = {m.group(1): m.group(2).strip() for m in map(_FIELD.match, body) if m}
    missing = [name for name in ("Commit", "Machine", "Command") if name not in fields]
    if missing:
        raise ValueError(f"benchmark log, entry {date}: missing field(s) {missing}")
    if TABLE_MARK not in body:
        raise ValueError(f"benchmark log, entry {date}: no '{TABLE_MARK}' line before its table")
    table = []
    for line in body[body.index(TABLE_MARK) + 1 :]:
        if not line.strip() and not table:
            continue
        if not line.startswith("|"):
            break
        table.append(_cells(line))
    if len(table) < 3:
        raise ValueError(f"benchmark log, entry {date}: the headline table has no rows")
    rows = [table[0], *table[2:]]  # drop the |---| separator
    return Headline(date, title, anchor, fields, rows)


def ratio_of(cell: str) -> float:
    """``"1.59x"`` -> 1.59 (bold markers allowed)."""
    match = re.fullmatch(r"\**\s*(\d+(?:\.\d+)?)x\s*\**", cell)
    if match is None:
        raise ValueError(f"headline table: last column must be a ratio like '1.25x', got {cell!r}")
    return float(match.group(1))


def render_block(h: Headline) -> str:
    """The README's figures block, markers included: where and when, the commands that
    reproduce it (one per line), then the table and the plot."""
    link = "benchmarks/RESULTS.md" + (f"#{h.anchor}" if h.anchor else "")
    lead = (
        f"Newest entry of the [benchmark log]({link}): {h.date}, commit {h.fields['Commit']}, on "
        f"{h.fields['Machine'].rstrip('.')}."
    )
    commands = re.findall(r"`([^`]+)`", h.fields["Command"]) or [h.fields["Command"]]
    out = [BEGIN, textwrap.fill(lead, width=100, break_on_hyphens=False), "", "```bash", *commands, "```", ""]
    out += ["| " + " | ".join(h.rows[0]) + " |", "|" + "---|" * len(h.rows[0])]
    out += ["| " + " | ".join(row) + " |" for row in h.rows[1:]]
    out += ["", "![Ratios of the newest benchmark entry](docs/assets/headline.png)", END]
    return "\n".join(out)


def replace_block(readme_text: str, block: str) -> str:
    """README text with its figures block replaced; raises ValueError without the markers."""
    if readme_text.count(BEGIN) != 1 or readme_text.count(END) != 1:
        raise ValueError(f"README.md must hold exactly one {BEGIN} ... {END} block")
    head, rest = readme_text.split(BEGIN)
    _, tail = rest.split(END)
    return head + block + tail


def draw(h: Headline, path: Path) -> None:
    """Each row's ratio as a bar from parity (log scale, so 0.5x and 2x are equally far), ahead
    of the peer in blue, behind it in orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{row[0]}, B = {row[1]}" if row[1].isdigit() else f"{row[0]}, {row[1]}" for row in h.rows[1:]]
    ratios = [ratio_of(row[-1]) for row in h.rows[1:]]
    colors = ["#3b6ea5" if r >= 1.0 else "#d9822b" for r in ratios]
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(ratios) + 1.6), dpi=110)
    ax.barh(range(len(ratios)), [r - 1.0 for r in ratios], left=1.0, color=colors)
    ax.axvline(1.0, color="dimgray", linewidth=1)
    ax.set_xscale("log")
    low, high = min(ratios + [1.0]) / 1.4, max(ratios + [1.0]) * 1.6
    ax.set_xlim(low, high)
    ticks = [t for t in (0.25, 0.5, 1, 2, 5, 10, 20, 50) if low <= t <= high]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.set_yticks(range(len(ratios)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, r in enumerate(ratios):
        ax.text(
            r * (1.03 if r >= 1 else 0.97),
            i,
            f"{r:.2f}x",
            va="center",
            ha="left" if r >= 1 else "right",
            fontsize=8,
        )
    ax.set_xlabel("deepinfer / peer, same run (1x = parity)")
    title = f"{h.title} ({h.date}, commit {h.fields['Commit'].strip('`')})"
    fig.suptitle(textwrap.fill(title, width=90), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when README.md is not up to date")
    args = parser.parse_args(argv)
    headline = parse_newest(LOG.read_text())
    current = README.read_text()
    wanted = replace_block(current, render_block(headline))
    if args.check:
        if wanted != current:
            print(
                "README.md's figures differ from the benchmark log's newest entry; run benchmarks/headline.py"
            )
            return 1
        return 0
    README.write_text(wanted)
    draw(headline, PLOT)
    print(f"README.md and {PLOT.relative_to(ROOT)} from the entry of {headline.date}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
