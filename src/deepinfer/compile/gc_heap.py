"""Python's cyclic garbage collector and the engine's long-lived objects.

A loaded model and its compiled steps leave hundreds of thousands of objects (modules,
parameters' Python wrappers, dynamo's guards and artefacts) that live as long as the process.
Every older-generation collection walks them all again, a visible share of the host thread's
time in a ``perf`` profile of the tiny V4's offline batch. ``gc.freeze`` moves what is alive
now out of the collected generations (vLLM does the same after its warm-up): new garbage is still collected,
reference counting still frees frozen objects that are dropped, only cycles among frozen
objects are never looked at again. So it happens once per process, when the first compiled
step has been loaded or compiled (the end of the warm-up of the one engine a serving or
benchmark process runs), after a full collection (what the compile or load left in cycles is
freed first). Objects alive then stay out of the collector's reach: if that first engine is
dropped while part of a reference cycle, its memory is not reclaimed; engines built after it
are collected as usual."""

from __future__ import annotations

import gc

_frozen = False


def freeze_long_lived() -> None:
    """Exempt every object alive now from future collections, the first time this is called
    in the process; later calls do nothing."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()  # garbage a compile or load left in cycles is not frozen with the rest
        gc.freeze()
