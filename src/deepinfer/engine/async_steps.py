"""Asynchronous scheduling's steps: launched on one worker thread, run in launch order.

A step whose tokens are sampled on the device (``DeviceSampling``) lets the next step launch
before the host has read them: the next step's missing input tokens are filled from the
device tensor of sampled tokens on the worker, just before its forward (``ModelRunner.feed``),
while the engine's thread reads the tokens back and processes the step. The host then never
waits for the device before launching, except after a step whose rows need the host first
(a grammar mask, a logits processor reading the output so far): that step's successor is
launched after its processing, with its ids from the host (``host_waits`` counts them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from deepinfer.cache.host_tensors import HostCopy
from deepinfer.config import EngineConfig
from deepinfer.engine.executor import Executor, StepOutput
from deepinfer.engine.model_runner import ModelRunner, PreparedStep
from deepinfer.engine.step_processor import DeviceSampling
from deepinfer.models.base import CausalLM
from deepinfer.platforms import Platform
from deepinfer.speculative.decoder import SpeculativeDecoder

logger = logging.getLogger("deepinfer")

Run = Callable[[PreparedStep, torch.Tensor], StepOutput]


def run_step(
    run: Run, prepared: PreparedStep, input_ids: torch.Tensor, sampling: DeviceSampling | None
) -> StepOutput:
    """The forward, then the device-side sampling of its tokens where the step has a plan,
    and their copy to the host queued at once (before the next step's kernels)."""
    output = run(prepared, input_ids)
    if sampling is not None and sampling.chunks:
        tokens, wanted = sampling.sample(output.logits)
        output = output._replace(
            tokens=tokens,
            host_tokens=HostCopy(tokens),
            host_logits=None if wanted is None else HostCopy(wanted),
        )
    return output


@dataclass
class Launched:
    """A step handed to the worker: what processing it needs, and its result to come."""

    prepared: PreparedStep
    sampling: DeviceSampling | None
    future: Future[StepOutput]


class AsyncSteps:
    """The worker thread and the steps launched on it, oldest first (at most two: the one
    being processed and the one launched after it)."""

    def __init__(self, executor: Executor, runner: ModelRunner, fed_launches: bool) -> None:
        """``fed_launches``: a step may launch before the last step's tokens reach the host
        (off where the forward reads the host's token lists itself: tensor and data
        parallel steps, batch-invariant steps run chunk by chunk)."""
        self.executor = executor
        self.runner = runner
        self.fed_launches = fed_launches
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-step")
        self.launched: list[Launched] = []
        self.early_launches = 0  # steps launched before the last step was processed
        self.host_waits = 0  # steps launched after it, because a row needed the host

    def may_launch_after(self, last: Launched) -> bool:
        """Whether the next step can launch before ``last`` is processed."""
        return self.fed_launches and last.sampling is not None

    def launch(
        self, prepared: PreparedStep, sampling: DeviceSampling | None, after: Launched | None = None
    ) -> None:
        """Hand ``prepared`` to the worker; ``after``: the unprocessed step whose device
        tokens fill this one's missing input ids."""
        if after is None or after.sampling is None:
            ids = self.runner.input_ids(prepared)
            future = self.worker.submit(self._run, prepared, ids, sampling)
        else:
            ids, pairs = self.runner.fed_input_ids(prepared, after.sampling.slots(after.prepared.chunks))
            future = self.worker.submit(self._run_fed, prepared, ids, pairs, after.future, sampling)
            self.early_launches += 1
        self.launched.append(Launched(prepared, sampling, future))

    def launch_after_processing(self, prepared: PreparedStep, sampling: DeviceSampling | None) -> None:
        """Launch ``prepared`` once the last step was processed, because it could not launch
        before (its ids come from the host's lists)."""
        self.host_waits += 1
        self.launch(prepared, sampling)

    def _run(self, prepared: PreparedStep, ids: torch.Tensor, sampling: DeviceSampling | None) -> StepOutput:
        return run_step(self.executor.run, prepared, ids, sampling)

    def _run_fed(
        self,
        prepared: PreparedStep,
        ids: torch.Tensor,
        pairs: torch.Tensor,
        previous: Future[StepOutput],
        sampling: DeviceSampling | None,
    ) -> StepOutput:
        # the worker runs steps in order: the previous one has returned (or raised, and so
        # does this one)
        tokens = previous.result().tokens
        if pairs.shape[1]:
            assert tokens is not None
            ids = self.runner.feed(ids, pairs, tokens)
        return self._run(prepared, ids, sampling)

    def wait_oldest(self) -> tuple[Launched, StepOutput]:
        """The oldest launched step and its output, once it has run."""
        launched = self.launched.pop(0)
        return launched, launched.future.result()

    def settle(self) -> None:
        """Wait for every launched step to end, raising or not, and forget them (after a
        failed step: their blocks may be freed only once nothing writes them)."""
        for launched in self.launched:
            launched.future.exception()
        self.launched.clear()

    def shutdown(self) -> None:
        for launched in self.launched:
            launched.future.result()
        self.launched.clear()
        self.worker.shutdown(wait=True)


def asks_async(config: EngineConfig, platform: Platform) -> bool:
    """Whether asynchronous scheduling is asked for: the option, or the platform's default."""
    return platform.name == "cuda" if config.async_scheduling is None else config.async_scheduling


def async_steps(
    config: EngineConfig,
    asked: bool,
    spec: SpeculativeDecoder | None,
    executor: Executor,
    runner: ModelRunner,
    model: CausalLM,
) -> AsyncSteps | None:
    """The asynchronous worker where asked for, unless drafting (it reads each step's tokens
    on the host: a fallback, logged) or EPLB (experts move between steps) rules it out."""
    if config.async_scheduling and spec is not None:
        logger.warning("async_scheduling=True with speculative_config: steps run synchronously")
    if not asked or spec is not None or config.enable_eplb:
        return None
    # tensor/data parallel and chunk-by-chunk steps read the host's token lists themselves
    return AsyncSteps(
        executor, runner, executor.tp is None and not (config.batch_invariant and not model.invariant_rows)
    )
