"""The one driver of an engine's loop: stepping, pausing, sleep, and the lock that keeps
weight writes between steps.

``LLM`` steps through it on the caller's thread and ``AsyncLLM`` on its engine thread; both
pause and sleep the same way, so there is one switch for each and no other code sets fields
on the engine's parts. The lock is held while a step runs and by whatever must happen
between two steps (weight updates, sleep, waking); ``pause`` returns once a step in progress
on another thread has ended.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from deepinfer.engine.engine import Engine
from deepinfer.engine.memory import cache_tensors
from deepinfer.engine.request import Request
from deepinfer.engine.sleep import release_tensors, release_weights


class EngineDriver:
    """Owns when ``engine`` steps: paused or not, asleep or not, and the step lock."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = threading.RLock()  # held while a step runs, and between steps by writers
        self.running = threading.Event()  # cleared by ``pause``
        self.running.set()
        self.sleep_level = 0  # 0: awake

    def step(self) -> list[Request]:
        """One engine step, once generation is not paused (waits while it is). An engine
        over a trainer's module first applies what the trainer wrote since the last step."""
        self.running.wait()
        with self.lock:
            if self.engine.weights.follow:
                self._apply_writes(None, None)
            return self.engine.step()

    def apply_weight_writes(self, changed: list[int] | None = None, version: str | None = None) -> str:
        """Between steps: the parameters ``changed`` (indices into ``engine.weights.params``;
        None: those whose version counters moved) were written in place. Their derived copies
        are made again, running requests recompute and the computed cache is forgotten; the
        weight version moves on (to ``version`` when given). Returns the weight version."""
        with self.lock:
            self._apply_writes(changed, version)
        return self.engine.weights.version

    def _apply_writes(self, changed: list[int] | None, version: str | None) -> None:
        engine, weights = self.engine, self.engine.weights
        changed = weights.changed() if changed is None else changed
        if not changed and version is None:
            return
        engine.drain()  # the step in flight ends with the old weights
        weights.check_in_place(changed)
        engine.forget_computed_cache()
        weights.refresh(changed, version)

    def closed_batch(self) -> contextlib.AbstractContextManager[None]:
        """No request arrives until the block ends (``LLM.generate``): the speculative decoder
        plans for the batch it holds."""
        spec = self.engine.spec
        return spec.closed() if spec is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """Hold the step lock: no step runs inside the block (a launched asynchronous step
        is waited for and processed first)."""
        with self.lock:
            self.engine.drain()
            yield

    # ---- pausing ----------------------------------------------------------------------------

    def pause(self) -> None:
        """Run no step until ``resume``; returns once a step in progress has ended."""
        self.running.clear()
        with self.lock:
            pass

    def resume(self) -> None:
        self.running.set()

    @property
    def paused(self) -> bool:
        return not self.running.is_set()

    # ---- sleep ------------------------------------------------------------------------------

    def sleep(self, level: int, free_parameters: bool) -> None:
        """Give the K/V cache's pages back (level 1), and the weights' too (level 2; the
        parameters themselves only with ``free_parameters``). Refused while requests are
        unfinished."""
        engine = self.engine
        with self.lock:
            if engine.has_unfinished():
                raise RuntimeError("sleep: requests are unfinished; let them finish or abort them first")
            release_tensors(cache_tensors(engine.runner.pools))
            engine.scheduler.forget_computed()  # the zeroed blocks no longer hold what their hashes name
            if level == 2:
                release_weights(engine.model, free_parameters)
            self.sleep_level = max(self.sleep_level, level)

    def wake_up(self, write_parameters: Callable[[], None] | None, version: str | None) -> None:
        """Take requests again. After level 2, ``write_parameters`` (if given) writes the
        parameters back first, then every derived copy is made again and the weights are
        those of ``version`` (None: unchanged)."""
        if self.sleep_level == 2:
            with self.lock:
                if write_parameters is not None:
                    write_parameters()
                self.engine.weights.refresh_all(version)
        self.sleep_level = 0

    @property
    def asleep(self) -> bool:
        return self.sleep_level > 0
