"""The pytest-benchmark suite's workload sizes: the published ones by default, and with
``DEEPINFER_BENCH_SMOKE=1`` the smallest that still runs every benchmark's path (the test
suite's smoke run checks that the suite works, not how fast)."""

from __future__ import annotations

import os

SMOKE = os.environ.get("DEEPINFER_BENCH_SMOKE") == "1"


def size(full: int, smoke: int) -> int:
    """``full``, or ``smoke`` in a smoke run."""
    return smoke if SMOKE else full
