"""The asynchronous front end: many connections, one engine loop.

The engine is single-threaded by design (docs/architecture.md, 'The server'), so one
background thread owns it: it takes adds and aborts from a command queue, steps while work is
pending, and hands each request's outputs to the asyncio queue of the coroutine waiting for
them. Adds are validated in that thread and their errors travel back to the caller; a request
whose client goes away is aborted there, which frees its cache blocks at once. A request that
fails inside the engine (finish reason "error": its own row went wrong, or the step that held
it raised) reaches its caller as ``RequestFailedError``; the loop goes on serving the rest.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import EngineDeadError
from deepinfer.llm import LLM
from deepinfer.lora.request import LoRARequest
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer.server")


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queued_requests``: answer 429 and let the client retry."""


class RequestFailedError(RuntimeError):
    """This request alone failed inside the engine (finish reason "error"): answer 500."""


class EngineAsleepError(RuntimeError):
    """The engine sleeps (``/sleep``): new requests get 503 until ``/wake_up``."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down: new requests get 503, and requests still running when the
    grace period ends get this as their last event."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    """Runs ``llm.engine`` on a background thread for asyncio callers."""

    def __init__(self, llm: LLM, max_queued_requests: int = 256) -> None:
        if llm.config.data_parallel_replicas > 1:
            raise ValueError(
                "data_parallel_replicas > 1 splits LLM.generate's calls; the server runs one engine "
                "(start it with data_parallel_replicas=1)"
            )
        self.llm = llm
        self.engine = llm.engine
        self.driver = llm.driver  # stepping, pausing and sleep: the same switches as ``LLM``'s
        self.max_queued_requests = max_queued_requests
        self._commands: queue.Queue[tuple[str, Any, Future | None]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._stopping = False
        self._own_thread = False
        self._until: Callable[[], bool] = lambda: False
        self.healthy = True  # False once the engine loop has died
        self.shutting_down = False  # no new requests; running ones end by ``_drain_deadline``
        self._drain_deadline: float | None = None
        self.stats_callbacks: list[Any] = []  # called in the engine thread with each finished output

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Run the engine loop on a background thread."""
        self._own_thread = True
        self._thread.start()

    def run_here(self, until: Callable[[], bool]) -> None:
        """Run the engine loop in the calling thread until ``until()`` is true. ``deepinfer
        serve`` runs it in the main thread (and uvicorn on a background one): the thread
        that loaded the model has already started an OpenMP team, and a second thread driving
        the kernels measured markedly slower per step (benchmarks/RESULTS.md)."""
        self._until = until
        self._thread = threading.current_thread()
        self._run()

    def stop(self) -> None:
        """Ask the loop to end; wait for it when it runs on our own thread."""
        self._stopping = True
        self._commands.put(("noop", None, None))
        if self._thread.is_alive() and self._thread is not threading.current_thread() and self._own_thread:
            self._thread.join(timeout=30)

    def begin_shutdown(self, grace_s: float) -> None:
        """Take no new requests; those running may finish within ``grace_s`` seconds, after
        which each still running is aborted and its caller gets ``ShuttingDownError``. Safe
        from a signal handler (it only sets flags and queues a command)."""
        self.shutting_down = True
        self._commands.put(("drain", time.monotonic() + grace_s, None))

    @property
    def serving(self) -> bool:
        """The loop runs and takes new requests (``/health``)."""
        return self.healthy and self._thread.is_alive() and not self.shutting_down

    @property
    def drained(self) -> bool:
        """Shutting down and no request left to answer."""
        return self.shutting_down and not self._streams

    # ---- caller side (any thread, usually the event loop) ----------------------------------

    async def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed_offset: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request (``lora_request``: the adapter it runs with, None: the base model);
        once the engine took it, return the iterator of its outputs (the
        ``RequestOutput`` with the whole text so far, after every step that changed it; the
        last has ``finished=True``). Raises ``ValueError`` for a bad request and
        ``QueueFullError`` when the waiting queue is full. Leaving the iteration early (a
        disconnect) aborts the request; a caller that never iterates must ``abort`` it."""
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        added: Future = Future()
        payload = (request_id, prompt_ids, params, seed_offset, cache_salt, lora_request, stream)
        self._commands.put(("add", payload, added))
        await asyncio.wrap_future(added)
        return self._outputs(request_id, stream)

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))

    async def between_steps(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread between two steps (weight updates, sleep, pausing,
        loading and unloading adapters);
        its result or exception comes back to the caller."""
        done: Future = Future()
        self._commands.put(("call", fn, done))
        return await asyncio.wrap_future(done)

    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) as the engine thread last left them."""
        running = len(self.engine.queues()[0])
        return running, max(0, len(self._streams) - running)

    def queues(self) -> tuple[list[Any], list[Any]]:
        """Copies of the engine's running and waiting requests."""
        return self.engine.queues()

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM in `deepinfer serve`: a normal stop
            self.healthy = False
            raise
        except BaseException:  # the loop itself broke: /health answers 503 from now on
            self.healthy = False
            logger.exception("the engine loop stopped")
            raise

    def _loop(self) -> None:
        while not self._stopping and not self._until():
            if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                self._end_all(ShuttingDownError("the server is shutting down; this request was ended"))
            if not self.engine.has_unfinished() or self.driver.paused:  # idle: wait for a command
                try:
                    self._apply(self._commands.get(timeout=0.5))
                except queue.Empty:
                    continue
            while True:  # everything queued since, then one step
                try:
                    self._apply(self._commands.get_nowait())
                except queue.Empty:
                    break
            if self.engine.has_unfinished() and not self.driver.paused:
                self._step()

    def _apply(self, command: tuple[str, Any, Future | None]) -> None:
        kind, payload, done = command
        if kind == "noop":
            return
        if kind == "drain":
            self._drain_deadline = payload
            return
        if kind == "call":
            assert done is not None
            try:
                done.set_result(payload())
            except Exception as exc:  # the caller gets it; the loop goes on
                done.set_exception(exc)
            return
        if kind == "add":
            request_id, ids, params, offset, salt, lora, stream = payload
            try:
                if self.shutting_down:
                    raise ShuttingDownError("the server is shutting down")
                if self.llm.is_sleeping:
                    raise EngineAsleepError("the engine is asleep (/sleep); call /wake_up first")
                # requests past the running slots wait: 429 only once those fill the queue (a
                # request that arrived since the last step is not waiting while a slot is free)
                if len(self._streams) >= self.engine.config.max_num_seqs + self.max_queued_requests:
                    raise QueueFullError(f"the waiting queue is full ({self.max_queued_requests} requests)")
                self.engine.add_request(
                    request_id, ids, params, generator_offset=offset, cache_salt=salt, lora_request=lora
                )
            except Exception as exc:  # the caller gets it; the engine is untouched
                assert done is not None
                done.set_exception(exc)
                return
            self._streams[request_id] = stream
            assert done is not None
            done.set_result(None)
        elif kind == "abort":
            if payload in self._streams:
                self.engine.abort(payload)
                self._release(payload)

    def _step(self) -> None:
        try:
            updated = self.driver.step()
        except Exception as exc:  # the engine's own isolation failed: fail what was in flight
            logger.exception("engine step failed")
            self._end_all(RuntimeError(f"engine step failed: {exc}"))
            if isinstance(exc, EngineDeadError):  # no later step can succeed: /health says so
                self.healthy = False
                self._stopping = True
            return
        for req in updated:
            rid = req.request_id
            if rid not in self._streams:
                continue
            out = self.engine.make_output(req)
            failed = out.outputs[0].finish_reason == "error"
            self._deliver(
                rid, RequestFailedError(out.outputs[0].error or "request failed") if failed else out
            )
            if req.finished:
                for callback in self.stats_callbacks:
                    callback(out)
                self._release(rid)

    def _end_all(self, error: BaseException) -> None:
        """Abort every request with a caller and hand each caller ``error``."""
        for rid in list(self._streams):
            self.engine.abort(rid)
            self._deliver(rid, error)
            self._release(rid)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams[request_id]
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is gone
            pass

    def _release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if request_id in self.engine.requests and self.engine.requests[request_id].finished:
            self.engine.pop_finished(request_id)
