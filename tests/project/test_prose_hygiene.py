"""The project's own prose says why, not when or how fast: no work diary in comments or docs.

Comments, docstrings and documentation describe the code as it is. Session ordinals, dates,
issue numbers, measured timings and machine-specific remarks belong in the benchmark log
(benchmarks/RESULTS.md), where each figure keeps its date, machine and command; prose points
there by topic. This test scans Python comments and string literals (``tokenize``), C/C++
sources and markdown as whole text, and lists every offending line per category. In ``tests/``
only comments and docstrings are prose: the other string literals there are test data (a
sample benchmark log's dates, this file's own dirty examples).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED_DIRS = (
    "src",
    "kernels",
    "compile_passes",
    "docs",
    "benchmarks",
    "examples",
    "gpu_tests",
    "tests",
)
# the benchmark log is where dates and figures belong
NOT_SCANNED = ("benchmarks/RESULTS.md",)
# benchmark scripts, examples and tests state their method (a timed window, a ratio's format, a
# bound such as "within 1.5x" or "within 100 ms"), so only the diary categories apply there, not
# the timing one; a remark about the machine a figure came from is still caught there, by the
# machine-specific category
METHOD_DIRS = ("benchmarks", "examples", "gpu_tests", "tests")
# where a Python string literal that is not a docstring is test data rather than prose
TEST_DATA_DIRS = ("tests",)
SCANNED_FILES = ("README.md",)
SUFFIXES = {".py", ".cpp", ".h", ".c", ".md"}
# README.md only: the current benchmark table, copied from benchmarks/RESULTS.md (another test
# checks that copy), sits between these two lines and is not prose
FIGURES_BEGIN = "<!-- figures:begin -->"
FIGURES_END = "<!-- figures:end -->"

_ORDINAL_UNIT = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
# "tenth" and beyond: nobody counts a loop's or a cache's runs that far in prose, but a diary
# does; "the first run" of a compiled graph is ordinary prose, an ordinal before "session",
# "lease" or "wave" is not
_HIGH_ORDINAL = (
    r"(?:tenth|eleventh|twelfth|[a-z]+teenth|twentieth|thirtieth|fortieth"
    rf"|(?:twenty|thirty|forty)[- ]?{_ORDINAL_UNIT})"
)
_ORDINAL = rf"(?:{_ORDINAL_UNIT}|{_HIGH_ORDINAL})"
_MONTH = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?"
    r"|sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)"
)
_NUMBER = r"\d[\d,.]*(?:\s?-\s?\d[\d,.]*)?"  # 3.5, 1,024 or a range 11-15
_SMALL_COUNT = r"(?:\d+|one|two|three|four|six|eight|sixteen)"

PATTERNS: dict[str, re.Pattern[str]] = {
    "session-diary": re.compile(
        rf"\b{_ORDINAL}\s+(?:sessions?|leases?|waves?)\b"
        rf"|\b{_HIGH_ORDINAL}\s+runs?\b"
        # a demonstrative before "session" names a span of work in a diary;
        # ``cache.session.Session``'s prose speaks of an object that holds, keeps or frees
        # things, and of its blocks or capacity
        r"|\b(?:this|that|same|earlier|previous|last|work)\s+session\b"
        r"(?!'s\s+(?:blocks?|tables?|cache|capacity|sequences?|pages?|pools?|rows?|slots?)\b"
        r"|\s+(?:holds?|has|owns?|keeps?|frees?|stores?|capacity|object|instance)\b)",
        re.IGNORECASE,
    ),
    "date": re.compile(
        r"\b20\d\d-\d\d-\d\d\b"
        rf"|\b{_MONTH}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+20\d\d\b"
        rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+{_MONTH}\.?,?\s+20\d\d\b",
        re.IGNORECASE,
    ),
    "issue-number": re.compile(
        r"\bissues?\s+#?\d+\b"
        r"|\bPRs?\s+#?\d+\b"
        r"|\bpull\s+requests?\s+#?\d+"
        r"|(?<![\w&/#])#\d{1,5}\b",
        re.IGNORECASE,
    ),
    "timing-figure": re.compile(
        # a duration
        rf"{_NUMBER}\s?(?:ms|µs|us|ns)\b"
        rf"|\b(?:took|takes|paid|pays|spent|spends|ran\s+in|in)\s+(?:~|about\s+|under\s+|over\s+)?"
        rf"{_NUMBER}\s?"
        r"(?:s|secs?|seconds?|mins?|minutes?)\b"
        rf"|{_NUMBER}\s?(?:s|secs?|seconds?|mins?|minutes?)\s+(?:a|per)\s+step\b"
        # a throughput
        rf"|{_NUMBER}\s?(?:tok|tokens)/s\b"
        rf"|{_NUMBER}\s?(?:[KMGT]B|GMAC|GFLOP|TFLOP)S?/s\b"
        # a speed ratio
        r"|\b\d+\.\d+[x×]\b"
        r"|\b\d[\d.]*\s?-\s?\d[\d.]*[x×]\b"
        r"|\b\d+(?:\.\d+)?[x×]\s+(?:faster|slower|eager|the)\b"
        # a percentage speed claim, or a measured share of a step's time or profile
        r"|\b\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?\s?%\s+(?:faster|slower)\b"
        r"|\b\d+(?:\.\d+)?\s?%\s+of\s+(?:[\w'-]+\s+){0,4}?(?:steps?|step's|samples|time|prefill|runs?)\b",
        re.IGNORECASE,
    ),
    "machine-specific": re.compile(
        r"\bthis\s+project's\s+(?:[\w-]+\s+){0,3}?machines?\b"
        rf"|\b{_SMALL_COUNT}-core\b"
        rf"|\bon\s+{_SMALL_COUNT}\s+(?:CPU\s+|physical\s+)?cores\b"
        # the CPU a figure or a crash came from; "AVX2 (AMD Zen 2/3)" naming which CPUs take a
        # code path is not a remark about one machine, so only "on [a] ... <model>" fires
        r"|\bon\s+(?:(?:a|an|the|this|our|one)\s+)?(?:[\w-]+\s+){0,2}?"
        r"(?:Zen\s?\d|EPYC|Xeon|Ryzen|Threadripper|Graviton|Sapphire\s+Rapids)\b"
        # a rough duration on the machine at hand (a tilde or "about", a figure and a unit, then
        # "here"), where tests/ skip the timing category; a stated wait ("sleeps 2 s here")
        # carries no tilde or "about"
        rf"|(?:~|\babout\s+|\baround\s+|\broughly\s+){_NUMBER}\s?(?:s|secs?|seconds?|mins?|minutes?|hours?)"
        r"\s+(?:here|on\s+this\s+(?:machine|box|host))\b",
        re.IGNORECASE,
    ),
    # texts that live outside this repository (a design sketch and reference notes kept beside
    # it, a file on one machine): a user cannot follow the pointer, so prose cites our own pages
    # or the published source instead. ``docs/guide/serving.md`` is ours, so a bare
    # ``serving.md`` fires only under ``shared/`` or ``reference/``; the other names fire
    # anywhere. A section sign alone in parentheses names no document: it pointed into one of
    # those texts ("DSpark paper §5.4" names its source). A path under ``/tmp/`` fires only as
    # a cited document (a ``.md``, ``.txt`` or ``.log`` file): ``OUT=/tmp/gpu`` in a command is
    # an example, not a source
    "outside-reference": re.compile(
        r"\.\./shared\b"
        r"|(?:DESIGN|model_spec|techniques|peers)\.md\b"
        r"|\b(?:shared|reference)/serving\.md\b"
        r"|\bsteering\s+repo(?:sitory)?\b"
        r"|\(§"
        r"|(?<![\w.~/$-])/(?:work|home|root)/"
        r"|(?<![\w.~/$-])/tmp/[\w./-]*\.(?:md|txt|log)\b",
        re.IGNORECASE,
    ),
}


# Python 3.12 splits f-strings into parts; their literal text is FSTRING_MIDDLE
_PYTHON_PROSE_TOKENS = {
    tokenize.COMMENT,
    tokenize.STRING,
    getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING),
}


def _docstring_lines(text: str) -> set[int]:
    """Lines on which a string statement starts or continues: docstrings, and bare strings
    used as block comments."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _python_prose(text: str, docstrings_only: bool = False) -> Iterator[tuple[int, str]]:
    """(first line, text) of every comment and string literal in a Python source; with
    ``docstrings_only``, of its comments and docstrings (other strings are data)."""
    keep = _docstring_lines(text) if docstrings_only else None
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
        elif token.type in _PYTHON_PROSE_TOKENS and (keep is None or token.start[0] in keep):
            yield token.start[0], token.string


def _markdown_prose(text: str, skip_figures: bool) -> Iterator[tuple[int, str]]:
    """(first line, text) of a markdown file, less README's figures block when asked. A begin
    line without its end line skips nothing: the rest of the file is still prose."""
    if not skip_figures:
        yield 1, text
        return
    lines = text.splitlines(keepends=True)
    start, begin = 0, None
    for index, line in enumerate(lines):
        if begin is None and line.strip() == FIGURES_BEGIN:
            yield start + 1, "".join(lines[start:index])
            begin = index
        elif begin is not None and line.strip() == FIGURES_END:
            start, begin = index + 1, None
    if begin is not None:
        start = begin
    yield start + 1, "".join(lines[start:])


def prose_chunks(path: Path, text: str) -> Iterator[tuple[int, str]]:
    """(first line, text) of the prose in one file, by its kind."""
    if path.suffix == ".py":
        data = path.relative_to(ROOT).parts[0] in TEST_DATA_DIRS
        yield from _python_prose(text, docstrings_only=data)
    elif path.suffix == ".md":
        yield from _markdown_prose(text, skip_figures=path.name == "README.md")
    else:
        yield 1, text


def scan_text(chunks: Iterator[tuple[int, str]]) -> Iterator[tuple[str, int, str]]:
    """(category, line, matched line's text) for every forbidden phrase in the chunks."""
    for first_line, chunk in chunks:
        for category, pattern in PATTERNS.items():
            for match in pattern.finditer(chunk):
                line = first_line + chunk.count("\n", 0, match.start())
                line_start = chunk.rfind("\n", 0, match.start()) + 1
                line_end = chunk.find("\n", match.end())
                excerpt = chunk[line_start : line_end if line_end >= 0 else len(chunk)]
                yield category, line, " ".join(excerpt.split())


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for directory in SCANNED_DIRS:
        files += sorted(
            path
            for path in (ROOT / directory).rglob("*")
            if path.suffix in SUFFIXES
            and path.is_file()
            and "__pycache__" not in path.parts
            and path.relative_to(ROOT).as_posix() not in NOT_SCANNED
        )
    return files


def _findings() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {category: [] for category in PATTERNS}
    for path in scanned_files():
        text = path.read_text(encoding="utf-8")
        method = path.relative_to(ROOT).parts[0] in METHOD_DIRS
        for category, line, excerpt in scan_text(prose_chunks(path, text)):
            if method and category == "timing-figure":
                continue
            found[category].append(f"{path.relative_to(ROOT)}:{line}: {category}: {excerpt}")
    return found


_FINDINGS: dict[str, list[str]] | None = None


def findings() -> dict[str, list[str]]:
    global _FINDINGS
    if _FINDINGS is None:
        _FINDINGS = _findings()
    return _FINDINGS


def test_scope_is_found():
    files = {str(path.relative_to(ROOT)) for path in scanned_files()}
    assert "src/deepinfer/__init__.py" in files
    assert "kernels/__init__.py" in files
    assert "compile_passes/__init__.py" in files
    assert "tests/conftest.py" in files


@pytest.mark.parametrize("category", sorted(PATTERNS))
def test_no_diary_prose(category: str):
    offending = findings()[category]
    assert not offending, (
        f"{len(offending)} line(s) of {category} prose; say why in a sentence and point to "
        "benchmarks/RESULTS.md by topic instead:\n" + "\n".join(offending)
    )


SYNTHETIC_DIRTY = {
    "session-diary": [
        "# measured in the twenty-first session",
        "# (fourteenth session)",
        "# RESULTS.md, eleventh session",
        "# as found earlier this session",
        "# No GPU was lent this session.",
        "# (same machine, same session)",
        "# against the previous session's runs",
        "# 1,100-1,300 last session",
        "# the thirty-second run showed it",
        "# (the pattern the first wave used)",
    ],
    "date": [
        "# (RESULTS.md, 2026-12-01)",
        "# measured December 4, 2026",
        "# measured 4 Dec 2026",
    ],
    "issue-number": [
        "# still to come (issue 19)",
        "# see PR #42",
        "# fixed by pull request 7",
        "# as in #123",
    ],
    "timing-figure": [
        "# 256 rows 3.748 -> 3.628 ms",
        "# 861 us against 2,025 us",
        "# compiling took 126 s",
        "# ~180 us a step",
        "# 2 s per step",
        "# prefill 1,375-1,450 -> 1,700-1,736 tok/s",
        "# about ~18 GB/s",
        "# 486-651 GMAC/s",
        "# 2.32x eager at bs 1",
        "# 1.2-2.2x faster than oneDNN",
        "# 3x faster",
        "# 7-19% faster on a Zen 4",
        "# a fresh process paid 11-15 s before its first step",
        "# the collector had 2.8% of the host thread's perf samples",
        "# ~40% of a 256-sequence decode step's loop",
    ],
    "machine-specific": [
        "# as on this project's 2-core machine",
        "# measured on a 2-core machine",
        "# slower on 2 cores",
        "# slower on two cores",
        "# four dynamo traces, ~2 min on a 2-core Zen 4",
        "# Inductor on 2 CPU cores takes about a minute per graph",
        "# a segfault, which we hit with Q8_0 on an AMX Xeon",
        "# measured on EPYC",
        "# four traces, ~2 min here",
        "# about 40 s on this machine",
    ],
    "outside-reference": [
        "# see DESIGN.md §2",
        "# (model_spec.md §2.10)",
        "# techniques.md §1.5",
        "# as ../shared/reference/peers.md lists them",
        "# built as cpu_peers.md describes",
        "# field names follow ``../shared/reference/serving.md``",
        "# field names follow reference/serving.md",
        "# the design sketch in the steering repo",
        "# see ../shared for the plan",
        "# (shared/DESIGN.md, 'The cache')",
        "# written from reference/model_spec.md alone",
        "# YaRN of the compressed layers (§1.1 ``rope_scaling``)",
        "# as /work/shared/reference/cpu_peers.md lists them",
        "# copied from /home/user/notes/plan.txt",
        "# see ``/root/bench.log``",
        "# the figures in /tmp/results.md",
    ],
}

SYNTHETIC_CLEAN = '''\
"""A Session holds one conversation's cache; session capacity bounds its blocks.

The default timeout is 600 seconds; the mask is 0x1f and the page colour #fff is unused.
Each request gets 30 s by default; 10% of the blocks are kept free.
Sessions are reused: the session's blocks stay, and ``Session(capacity=4)`` makes one.
The first run of a compiled graph records it; later runs replay it.
"""
# 1. read the config; 2. build the engine. #include <cstdint> lives in the C++ source.
session = Session(capacity=4)  # a new session per request
message = f"this session holds {n} sequences; this session's blocks stay until it is freed"
this_session = None
timeout_s = 600  # seconds; raise it for a slow disk; the server sleeps 2 s here
# docs/guide/serving.md and [Serving](guide/serving.md) describe the server; the shared
# reference counts of a design (docs/architecture.md, 'The cache') follow DeepSeek's reference.
# DSpark paper §3.2.2 and §5.2; AVX2 without VNNI (AMD Zen 2/3, Intel before Ice Lake) reads
# the blocks so; run GPU_CHECK_DRY_RUN=1 OUT=/tmp/gpu bash benchmarks/gpu_check.sh on a CPU;
# src/work/home/x and https://example.com/home/ are not a machine's paths; multi-core machines.
'''


@pytest.mark.parametrize("category", sorted(PATTERNS))
def test_each_category_fires_on_its_examples(category: str):
    for example in SYNTHETIC_DIRTY[category]:
        found = {cat for cat, _, _ in scan_text(_python_prose(example + "\n"))}
        assert category in found, f"{category} does not fire on {example!r}"
    markdown = "\n".join(line.removeprefix("# ") for line in SYNTHETIC_DIRTY[category])
    lines = {line for cat, line, _ in scan_text(_markdown_prose(markdown, False)) if cat == category}
    assert lines == set(range(1, len(SYNTHETIC_DIRTY[category]) + 1))


def test_one_text_fires_every_category():
    text = "\n".join(examples[0] for examples in SYNTHETIC_DIRTY.values()) + "\n"
    assert {cat for cat, _, _ in scan_text(_python_prose(text))} == set(PATTERNS)


def test_clean_text_fires_nothing():
    found = list(scan_text(_python_prose(SYNTHETIC_CLEAN)))
    assert not found, found
    cpp = "#include <cstdint>\n#if 0\n#define N 16  // 0x1f mask\n#endif\n"
    assert not list(scan_text(iter([(1, cpp)])))


def test_test_data_strings_are_not_prose():
    """In tests/, a string literal that is not a docstring is data: a sample log's date there
    fires nothing, while the same date in a comment or a docstring does."""
    text = '''"""Module docstring, 2026-12-01."""
LOG = "## 2026-12-01 headline"  # noted 2026-12-01


def f():
    """Docstring,
    2026-12-01."""
    return f"{LOG} 2026-12-01"
'''
    found = [(cat, line) for cat, line, _ in scan_text(_python_prose(text, docstrings_only=True))]
    assert found == [("date", 1), ("date", 2), ("date", 7)]
    everywhere = [line for _, line, _ in scan_text(_python_prose(text))]
    assert everywhere == [1, 2, 2, 7, 8]
    assert TEST_DATA_DIRS[0] in SCANNED_DIRS


def test_readme_figures_block_is_skipped():
    text = f"intro\n{FIGURES_BEGIN}\n| 3.2 ms | 120 tok/s |\n{FIGURES_END}\ntook 5 s\n"
    found = list(scan_text(_markdown_prose(text, skip_figures=True)))
    assert [(cat, line) for cat, line, _ in found] == [("timing-figure", 5)]
    assert [cat for cat, _, _ in scan_text(_markdown_prose(text, skip_figures=False))] == [
        "timing-figure",
        "timing-figure",
        "timing-figure",
    ]
    unterminated = f"intro\n{FIGURES_BEGIN}\n| 3.2 ms |\n"
    found = list(scan_text(_markdown_prose(unterminated, skip_figures=True)))
    assert [(cat, line) for cat, line, _ in found] == [("timing-figure", 3)]
