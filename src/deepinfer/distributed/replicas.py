"""Data-parallel replicas on one machine: whole engines in worker processes, each on its own
share of the CPU's threads, over which ``LLM.generate`` splits a call's requests.

Why: a small model's CPU step leaves cores idle. On the tiny V4 with two threads, the second
thread waited in OpenMP's barrier for about half of a throughput run, while the first ran
the host's Python (scheduling, metadata, sampling) and the step's serial parts (guards, the
wrapper, single-threaded kernels). Two engines with one thread each keep both cores busy,
host work included (benchmarks/RESULTS.md). This is SGLang's ``dp_size`` (a
controller placing requests on independent workers), not vLLM's data-parallel attention,
which this project has as ``data_parallel_size`` (ranks in lockstep, for expert parallel).

The caller (``LLM``) validates and queues every request of a call first, so a bad one fails
the whole call before any work starts; it then hands each worker its share as
``RequestSpec`` groups (one group per prompt, ``n`` siblings) and runs the lightest share
itself. This module owns the processes and the messages; it never imports the LLM (the
worker's entry point is passed in), so the package keeps importing downward."""

from __future__ import annotations

import contextlib
import heapq
import multiprocessing
import multiprocessing.connection
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.sampling_params import SamplingParams

JOIN_S = 10.0  # a closing worker gets this long before it is terminated
_FD_ENV = "DEEPINFER_REPLICA_FD"  # the worker's end of its socket pair
_CHILD = "from deepinfer.distributed.replicas import child_main; child_main()"


@dataclass(frozen=True)
class RequestSpec:
    """One request as a replica queues it: the caller's id, so outputs keep their ids, and the
    sibling index that offsets a seeded generator (``n`` > 1 gives each sibling its own)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    generator_offset: int


def balanced_shares(costs: Sequence[float], parts: int) -> list[list[int]]:
    """Indices of ``costs`` in ``parts`` shares of near-equal total cost: the costliest first,
    each to the share with the least so far (LPT, within 4/3 of the best split), every share
    in index order; the lightest share first (the caller runs it, beside its other work)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    heap = [(0.0, k) for k in range(parts)]
    shares: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, k = heapq.heappop(heap)
        shares[k].append(i)
        heapq.heappush(heap, (load + costs[i], k))
    totals = [sum(costs[i] for i in share) for share in shares]
    order = sorted(range(parts), key=lambda k: (totals[k], k))
    return [sorted(shares[k]) for k in order]


# a worker's task: (its share, a progress callback or None) -> its result. ``LLM``'s shares
# are ``RequestSpec`` groups and its results ``RequestOutput`` lists; the benchmark's peer
# replicas send batches of token ids (bench.workloads.PeerProcesses)
Runner = Callable[[Any, Callable[[int], None] | None], Any]


def serve(conn: multiprocessing.connection.Connection, start: Callable[[], Runner]) -> None:
    """A worker's loop: build the engine (``start``; its failure is reported, then the worker
    exits), say ready, then run each share it is sent until told to close or the pipe ends.
    A share that fails is reported and the worker keeps serving."""
    try:
        run = start()
    except BaseException as exc:  # the caller raises it, with this replica named
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the caller is gone
            return
        if message[0] == "close":
            return
        _, groups, report = message
        try:

            def progress(count: int) -> None:
                conn.send(("progress", count))

            conn.send(("done", run(groups, progress if report else None)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ReplicaPool:
    """``count`` worker processes, each running ``target(conn, *args)`` (a module-level function
    that calls ``serve``). Workers are numbered from 1: the caller's own engine is replica 0.

    Each worker is a fresh interpreter (``python -c``) that inherits one end of a socket pair
    and is sent ``target`` and ``args`` over it (pickled by name), so the caller's main module
    is never imported again: a script without an ``if __name__ == "__main__"`` guard, a
    notebook or a REPL can start replicas. A worker whose caller is gone sees its pipe end and
    exits."""

    def __init__(self, count: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[subprocess.Popen] = []
        self._ready = [False] * count
        self._pending: dict[int, tuple[str, Any]] = {}  # a result read early by drain_progress
        self._outstanding: set[int] = set()  # workers with a share whose result is unread
        for _ in range(count):
            mine, theirs = multiprocessing.Pipe()
            fd = theirs.fileno()
            env = {**os.environ, _FD_ENV: str(fd)}
            self.procs.append(subprocess.Popen([sys.executable, "-c", _CHILD], env=env, pass_fds=[fd]))
            theirs.close()
            mine.send((target, args))
            self.conns.append(mine)

    @property
    def size(self) -> int:
        return len(self.conns)

    def _receive(self, k: int) -> tuple[str, Any]:
        """The next message of worker ``k`` (0-based); a dead worker is an error naming it."""
        try:
            return self.conns[k].recv()
        except (EOFError, ConnectionError, OSError):
            try:
                code = self.procs[k].wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                code = None
            raise RuntimeError(f"replica {k + 1} exited (exit code {code}) before answering") from None

    def wait_ready(self) -> None:
        """Block until every worker has built its engine; raise the first one's failure."""
        for k in range(self.size):
            while not self._ready[k]:
                kind, payload = self._receive(k)
                if kind == "error":
                    raise RuntimeError(f"replica {k + 1} failed to start: {payload}")
                self._ready[k] = kind == "ready"

    def submit(self, k: int, share: Any, report_progress: bool) -> None:
        try:
            self.conns[k].send(("generate", share, report_progress))
        except (ConnectionError, OSError):
            self._receive(k)  # raises, naming the dead worker
            raise
        self._outstanding.add(k)

    def drain_progress(self, on_progress: Callable[[int], None]) -> None:
        """Count the progress messages already waiting (never blocks). Only progress is read
        here: the next message after it is a share's result, left for ``collect``."""
        for k, conn in enumerate(self.conns):
            while k not in self._pending and conn.poll():
                kind, payload = conn.recv()
                if kind != "progress":  # a result or an error: keep it for collect
                    self._pending[k] = (kind, payload)
                    break
                on_progress(payload)

    def collect(self, k: int, on_progress: Callable[[int], None] | None) -> Any:
        """Worker ``k``'s result for its share (blocking), counting its progress meanwhile."""
        while True:
            kind, payload = self._pending.pop(k, None) or self._receive(k)
            if kind == "progress":
                if on_progress is not None:
                    on_progress(payload)
                continue
            self._outstanding.discard(k)
            if kind == "error":
                raise RuntimeError(f"replica {k + 1} failed: {payload}")
            return payload

    def discard_results(self) -> None:
        """Wait for every share still out and drop its result or error (a call that failed
        here must not leave a result for the next call to read); dead workers are skipped."""
        for k in sorted(self._outstanding):
            try:
                self.collect(k, None)
            except RuntimeError:
                pass
        self._outstanding.clear()

    def close(self) -> None:
        """Tell every worker to stop, then wait for it (terminated after ``JOIN_S``)."""
        for conn in self.conns:
            try:
                conn.send(("close",))
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=JOIN_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


def child_main() -> None:
    """A worker process's start (``python -c``): read ``target`` and ``args`` from the
    inherited socket, then run ``target(conn, *args)``."""
    conn = multiprocessing.connection.Connection(int(os.environ.pop(_FD_ENV)))
    target, args = conn.recv()
    target(conn, *args)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """This process's torch threads set to ``count`` for the body (a replica's share of the
    CPU), restored afterwards."""
    previous = torch.get_num_threads()
    if count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
