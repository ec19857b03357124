"""The engine loop: add requests, step, collect outputs.

A step is schedule (``Scheduler``), prepare (``ModelRunner.prepare``), run (``Executor.run``)
and, for plain rows, sampling on the device; then process: reading the tokens back,
speculative verification and outputs; ``engine/setup.py`` builds it.

With ``async_scheduling`` the model runs step N on a worker thread while this thread schedules
and prepares step N+1 (torch releases the GIL inside kernels), launches it with step N's
tokens still on the device as its input (``async_steps.py``), then processes step N. Each
draw is keyed by its request's seed and position, so outputs equal synchronous mode.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepinfer.cache import kv_dtypes
from deepinfer.cache.pools import CacheLayout
from deepinfer.config import EngineConfig
from deepinfer.distributed.workers import TensorParallelGroup
from deepinfer.engine import lora_setup, setup
from deepinfer.engine.admission import check_request
from deepinfer.engine.async_steps import asks_async, async_steps, run_step
from deepinfer.engine.executor import Executor, StepOutput
from deepinfer.engine.metrics_snapshot import cache_metrics, spec_metrics
from deepinfer.engine.model_runner import PreparedStep
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.step_processor import DeviceSampling, StepProcessor
from deepinfer.engine.structured_requests import StructuredRequests
from deepinfer.engine.weight_sync import WeightSync
from deepinfer.errors import EngineDeadError
from deepinfer.lora.registry import LoRARequest, adapter_for
from deepinfer.models.base import CausalLM
from deepinfer.outputs import Metric, RequestOutput
from deepinfer.platforms import platform_for
from deepinfer.sampling.sampler import make_generator
from deepinfer.sampling_params import SamplingParams
from deepinfer.speculative.decoder import SpeculativeDecoder

logger = logging.getLogger("deepinfer")


class Engine:
    """Requests in, outputs out: owns the scheduler, the block pools, the model runner and
    the speculative decoder, and runs one step at a time. ``EngineDriver`` steps it;
    ``LLM`` and the server add, abort and read requests."""

    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        tokenizer: Any = None,
        checkpoint: Path | None = None,
        follow_parameters: bool = False,
    ) -> None:
        """``checkpoint``: the directory the model came from; compiled steps are saved beside it
        unless ``config.compile_cache_dir`` says otherwise. ``follow_parameters``: the model is a
        trainer's, whose parameters stay as they are and change between steps (weight_sync.py)."""
        config.validate()
        self.model = model
        self.config = config
        mcfg = model.config
        self.vocab_size, self.eos_token_ids = mcfg.vocab_size, list(mcfg.eos_token_id)
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        self.device = next(model.parameters()).device
        dtype = self.kv_dtype = kv_dtypes.pool_dtype(config.kv_cache_dtype, model.compute_dtype)
        # tensor or expert parallel: start the worker ranks and keep rank 0's share, before
        # anything reads the model's (now local) shapes
        self.tp: TensorParallelGroup | None = None
        self.data_parallel = config.data_parallel_size > 1
        setup.prepare_weights(model, config, share=not follow_parameters)
        if config.world_size > 1:
            self.tp = setup.start_tensor_parallel(model, config, self.device, checkpoint)
            weakref.finalize(self, self.tp.close)
        self.layout = CacheLayout.from_specs(
            model.cache_spec(),
            config.block_size,
            bounded_window=config.bounded_window_cache,
            packed_kv=config.kv_cache_dtype == "auto",  # the trained precision where the model has one
        )
        platform = platform_for(self.device)
        modes = setup.execution_modes(config, model, platform, checkpoint)
        eager_step = None
        if self.device.type == "cpu":
            eager_step = setup.prepare_cpu_weights(model, config, modes.compile)
        drafter = setup.drafter_for(model, config)
        size = setup.cache_size(
            config,
            model,
            self.layout,
            dtype,
            self.device,
            self.max_model_len,
            drafter,
            setup.graph_batch_size(config) if modes.graphs else None,
        )
        self.lora = lora_setup.registry(model, config)
        self.runner = setup.model_runner(
            model,
            config,
            self.layout,
            dtype,
            platform,
            modes,
            size,
            drafter,
            self.max_model_len,
            checkpoint,
            eager_step,
            self.lora,
        )
        self.executor = Executor(self.runner, model, config, self.tp)
        tiers = setup.tier_setup(config, model, self.runner, dtype, checkpoint)
        if self.tp is not None:  # the worker ranks' caches, alike
            eplb = self.executor.eplb is not None
            setup.worker_caches(self.tp, config, self.layout, dtype, size, eplb, tiers)
        self.tiers = setup.kv_tiers(tiers, self.runner, self.tp)
        if self.runner.graphs is not None:
            # every bucket now, on this thread, before any step (and before the asynchronous
            # worker exists): a capture must never overlap the host preparing another step
            self.runner.graphs.capture_all()
        platform_async = asks_async(config, platform)
        self.spec: SpeculativeDecoder | None = None
        if config.speculative_config is not None and drafter is not None:
            self.spec = setup.speculative_decoder(
                config, drafter, self.layout, self.runner, self.max_model_len, lagged=platform_async
            )
        routing = self.executor.routing
        scheduling = setup.scheduling(
            config,
            self.layout,
            size,
            self.tiers,
            drafts_after_recompute=self.spec is not None and self.spec.rollback.drafts_after_recompute,
            block_published=routing.published if routing is not None else None,
        )
        # the cache's block bookkeeping per data-parallel rank (the K/V tensors: ``runner.pools``)
        self.scheduler, self.block_pools = scheduling.scheduler, scheduling.block_pools
        self.window_block_pools = scheduling.window_block_pools
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.structured = StructuredRequests(tokenizer, self.vocab_size, self.eos_token_ids)
        self._ended: list[Request] = []  # ended outside a step (reported by the next one)
        self.requests: dict[str, Request] = {}
        self.async_steps = async_steps(config, platform_async, self.spec, self.executor, self.runner, model)
        self.processor = StepProcessor(
            self.scheduler,
            self.output_processor,
            self.structured,
            self.spec,
            self.eos_token_ids,
            rowwise=config.batch_invariant,
            counts_in_flight=self.async_steps is not None,
        )
        self._open_steps: list[list[ScheduledChunk]] = []  # scheduled, not yet processed
        repack = model.register_packed_projections if self.device.type == "cpu" and modes.compile else None
        self.weights = WeightSync(model, follow_parameters, repack)

    def close(self) -> None:
        """Stop the grammar compiler's, the KV tiers' and the tensor-parallel workers' threads."""
        for part in (self.structured, self.tiers, self.tp):
            if part is not None:
                part.close()

    @property
    def num_blocks(self) -> int:
        return self.block_pools[0].num_blocks

    def queues(self) -> tuple[list[Request], list[Request]]:
        """Copies of the running and the waiting requests (safe to read on another thread)."""
        return list(self.scheduler.running), list(self.scheduler.waiting)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        generator_offset: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming the bad field.
        ``cache_salt`` (vLLM's): only requests with the same salt share prefix-cache blocks;
        ``lora_request``: the adapter it runs with (``enable_lora``)."""
        check_request(
            request_id,
            prompt_token_ids,
            params,
            cache_salt,
            in_use=request_id in self.requests if isinstance(request_id, str) else False,
            vocab_size=self.vocab_size,
            max_logprobs=self.config.max_logprobs,
            max_model_len=self.max_model_len,
            block_size=self.layout.block_size,
            num_blocks=self.num_blocks,
        )
        structured = params.structured_outputs
        if structured is not None:
            self.structured.check(structured)
        req = Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            generator=None if params.greedy else make_generator(params, self.device, generator_offset),
            arrival_time=time.perf_counter(),
            cache_salt=cache_salt,
            lora=adapter_for(self.lora, lora_request),
        )
        self.requests[request_id] = req
        if structured is not None:
            self.structured.submit(req, structured)
        else:
            self.scheduler.add(req)
        return req

    def _admit_compiled(self) -> None:
        """Schedule the structured requests whose grammar is ready (waiting for one when
        nothing else could run); a grammar that failed to compile aborts its request."""
        idle = self.scheduler.num_unfinished == 0 and not self.in_flight
        done, failed = self.structured.ready(idle)
        for req in done:
            self.scheduler.add(req)
        for req in failed:
            req.finish_reason = "abort"
            self.processor.finish(req)
            self._ended.append(req)

    def abort(self, request_id: str) -> None:
        """Stop a request now; its cache is freed and its output finishes with 'abort'."""
        req = self.requests.get(request_id)
        if req is not None:
            self.processor.end_now(req, "abort")

    def fail(self, request: Request, error: str) -> None:
        """End one request that went wrong (finish reason "error", ``error`` saying why); its
        cache is freed unpublished and the other requests go on."""
        self.processor.fail(request, error)

    @property
    def in_flight(self) -> bool:
        """A step runs on the asynchronous worker."""
        return self.async_steps is not None and bool(self.async_steps.launched)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.in_flight or bool(self.structured.compiling)

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; return the requests that got new tokens or finished.

        A request whose own row goes wrong (a NaN distribution, an exception in its own
        output processing) fails alone. An exception in the step itself fails the requests
        the step (and, under asynchronous scheduling, the step scheduled after it) held,
        with finish reason "error"; requests outside them go on. ``EngineDeadError`` (the
        engine cannot step again, or a step failed before holding any request, which no
        retry would change) is raised."""
        updated = self._guarded(self._step)
        if self._ended:  # a request drained before this step may have moved again in it
            seen = {id(r) for r in updated}
            updated, self._ended = [r for r in self._ended if id(r) not in seen] + updated, []
        return updated

    def drain(self) -> None:
        """Process every launched step, scheduling none (a weight update applies between
        steps); the requests they updated are reported by the next ``step``."""
        while self.in_flight:
            self._ended += self._guarded(self._process_oldest)

    def _guarded(self, run: Callable[[], list[Request]]) -> list[Request]:
        try:
            return run()
        except EngineDeadError:
            raise
        except Exception as exc:
            logger.exception("engine step failed")
            if not self._open_steps and not self.in_flight:
                raise EngineDeadError(f"scheduling failed: {type(exc).__name__}: {exc}") from exc
            return self._fail_open_steps(f"engine step failed: {type(exc).__name__}: {exc}")

    def _process_oldest(self) -> list[Request]:
        assert self.async_steps is not None
        current, output = self.async_steps.wait_oldest()
        return self._process(current.prepared, output, current.sampling)

    def _step(self) -> list[Request]:
        steps = self.async_steps
        if steps is None:
            scheduled = self._schedule()
            if scheduled is None:
                return []
            prepared, sampling = scheduled
            ids = self.runner.input_ids(prepared)
            updated = self._process(prepared, run_step(self.executor.run, prepared, ids, sampling), sampling)
            self.executor.count_expert_load()
            return updated
        if not steps.launched:
            scheduled = self._schedule()
            if scheduled is None:
                return []
            steps.launch(*scheduled)
        last = steps.launched[0]
        upcoming = self._schedule()  # overlaps with the running step
        early = upcoming is not None and steps.may_launch_after(last)
        if upcoming is not None and early:
            steps.launch(*upcoming, after=last)  # its input: last's tokens, on the device
        updated = self._process_oldest()
        if upcoming is not None and not early:
            steps.launch_after_processing(*upcoming)
        self.executor.count_expert_load()
        return updated

    def _fail_open_steps(self, error: str) -> list[Request]:
        """After a step raised: fail every request of the steps scheduled, not processed."""
        if self.async_steps is not None:  # launched steps must end before their blocks are freed
            self.async_steps.settle()
        reported: dict[str, Request] = {}
        for chunks in self._open_steps:
            for chunk in chunks:
                req = chunk.request
                if not isinstance(req, Request) or self.requests.get(req.request_id) is not req:
                    continue  # aborted and collected already
                req.pending_tokens = 0
                self.fail(req, error)  # one that finished before the error is reported as it is
                reported[req.request_id] = req
        self._open_steps.clear()
        return list(reported.values())

    def _schedule(self) -> tuple[PreparedStep, DeviceSampling | None] | None:
        self._admit_compiled()
        drafts = None
        if self.spec is not None:  # planned as data before the scheduler runs
            budget = self.config.max_num_batched_tokens
            drafts = self.spec.step_drafts(self.scheduler.ranks, budget, self.structured.trim_draft)
        chunks = self.scheduler.schedule(drafts)
        if not chunks:
            return None
        self._open_steps.append(chunks)
        now = time.perf_counter()
        for c in chunks:
            if c.request.first_scheduled_time is None:
                c.request.first_scheduled_time = now
            if c.samples and self.async_steps is not None:
                c.request.pending_tokens += 1  # the token this step will sample
        if self.spec is not None:
            self.spec.before_step(chunks)
        prepared = self.runner.prepare(chunks, data_parallel=self.data_parallel)
        return prepared, self.processor.device_sampling(prepared)

    def _process(
        self, prepared: PreparedStep, output: StepOutput, sampling: DeviceSampling | None
    ) -> list[Request]:
        updated = self.processor.process(prepared, output, sampling)
        self._open_steps = [c for c in self._open_steps if c is not prepared.chunks]
        if self.tiers is not None:  # blocks that a step scheduled already writes wait for it
            self.tiers.flush(complete=not self._open_steps)
        return updated

    # ---- between steps -----------------------------------------------------------------------

    def forget_computed_cache(self) -> None:
        """Nothing computed is read again: running requests recompute from their first token,
        and no prefix cached in the pools, the tiers or the routing record is reused."""
        self.scheduler.forget_computed()
        if self.tiers is not None:
            self.tiers.weights_changed()
        if self.executor.routing is not None:
            self.executor.routing.forget()

    def metrics(self) -> list[Metric]:
        """The cache's and speculative decoding's metrics now (``metrics_snapshot.py``)."""
        return cache_metrics(self.block_pools, self.layout.block_size, self.tiers) + spec_metrics(
            self.spec and self.spec.stats
        )

    # ---- outputs --------------------------------------------------------------------------

    def make_output(self, req: Request) -> RequestOutput:
        out = self.output_processor.make_output(req)
        out.weight_version = self.weights.version
        if self.executor.routing is not None:
            out.routed_experts = self.executor.routing.rows_of(req)
        return out

    def shutdown(self) -> None:
        if self.async_steps is not None:
            self.async_steps.shutdown()
