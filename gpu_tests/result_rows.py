"""A pytest plugin (``-p result_rows``, with gpu_tests/ on ``PYTHONPATH``) that appends one
markdown row per test to ``$GPU_CHECK_RESULTS`` as each test ends, flushed at once: a stage
the GPU check's time limit kills keeps the outcome of every test that finished before."""

from __future__ import annotations

import os

import pytest


def _append(line: str) -> None:
    path = os.environ.get("GPU_CHECK_RESULTS")
    if not path:
        return
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def pytest_sessionstart(session: pytest.Session) -> None:
    _append("| test | outcome | s |\n|---|---|---:|")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # one row per test: its call, or the setup that failed or skipped it, or a failed teardown
    if report.when == "call" or (report.when == "setup" and not report.passed) or report.failed:
        outcome = report.outcome if report.when == "call" else f"{report.outcome} in {report.when}"
        _append(f"| {report.nodeid} | {outcome} | {report.duration:.1f} |")
