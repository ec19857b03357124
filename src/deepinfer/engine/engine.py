"""The engine loop: add requests, step, collect outputs.

With ``async_scheduling`` the model runs step N on a worker thread while this thread
schedules and prepares step N+1 (torch releases the GIL inside kernels). Tokens sampled by
step N reach step N+1's inputs just before it launches, so outputs equal synchronous mode.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from deepinfer.cache import kv_dtypes
from deepinfer.cache.pools import CacheLayout
from deepinfer.config import EngineConfig
from deepinfer.distributed.eplb import (
    ExpertLoadWindow,
    ExpertPlacement,
    identity_placement,
    moe_lb,
    rebalance_experts,
)
from deepinfer.distributed.tensor_parallel import check_divisible
from deepinfer.distributed.workers import (
    CacheSetup,
    TensorParallelGroup,
    gather_rows,
    reduce_expert_load,
    shard,
)
from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.dp_scheduler import DataParallelScheduler
from deepinfer.engine.graph_runner import measure_step_memory
from deepinfer.engine.memory import kv_bytes_per_token, pool_bytes
from deepinfer.engine.model_runner import ModelRunner, PreparedStep
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import ScheduledChunk, Scheduler
from deepinfer.engine.structured_requests import StructuredRequests
from deepinfer.errors import EngineDeadError
from deepinfer.kernels import huge_pages
from deepinfer.models.base import CausalLM
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.platforms import Platform, platform_for
from deepinfer.platforms.cpu import tune_malloc
from deepinfer.sampling.sampler import INVALID_ROW, SamplingRow, make_generator, sample
from deepinfer.sampling_params import SamplingParams
from deepinfer.speculative.config import SpeculativeConfig
from deepinfer.speculative.decoder import SpeculativeDecoder, VerifiedChunk, build_drafter
from deepinfer.speculative.drafter import Drafter, feature_offsets_for
from deepinfer.speculative.rollback import Rollback

logger = logging.getLogger("deepinfer")


def available_memory_bytes(device: torch.device) -> int:
    """Free memory where the cache will live: device memory on CUDA, MemAvailable on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


class Engine:
    """Requests in, outputs out: owns the scheduler, the block pool, the model runner and
    (with ``speculative_config``) the speculative decoder, and runs one step at a time
    (docs/architecture.md, 'The flow of one engine step'). ``LLM`` and the server drive it
    through ``add_request``, ``step``, ``abort`` and ``make_output``; with ``async_scheduling``
    the model runs a step on a worker thread while this thread prepares the next."""

    def __init__(
        self, model: CausalLM, config: EngineConfig, tokenizer: Any = None, checkpoint: Path | None = None
    ) -> None:
        """``checkpoint``: the directory the model came from; compiled steps are saved beside
        it unless ``config.compile_cache_dir`` says otherwise."""
        config.validate()
        self.model = model
        self.config = config
        mcfg = model.config
        self.vocab_size = mcfg.vocab_size
        self.eos_token_ids = list(mcfg.eos_token_id)
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        self.device = next(model.parameters()).device
        dtype = kv_dtypes.pool_dtype(config.kv_cache_dtype, model.compute_dtype)
        # tensor or expert parallel: start the worker ranks and keep rank 0's share, before
        # anything reads the model's (now local) shapes
        self.tp: TensorParallelGroup | None = None
        self.data_parallel = config.data_parallel_size > 1
        if config.world_size > 1:
            self.tp = self._start_tensor_parallel(checkpoint)
            weakref.finalize(self, self.tp.close)
        self.kv_dtype = dtype
        self.layout = CacheLayout.from_specs(
            model.cache_spec(),
            config.block_size,
            bounded_window=config.bounded_window_cache,
            packed_kv=config.kv_cache_dtype == "auto",  # the trained precision where the model has one
        )
        platform = platform_for(self.device)
        use_compile, use_graphs = self._execution_modes(platform)
        # compile=None on the CPU, where compiling pays: saved variants run, and a step none
        # covers runs eagerly until such steps have taken cpu_compile_after_s (then compiles)
        compile_missing = not (config.compile is None and not use_compile)
        if not compile_missing:
            use_compile = self._cpu_default_compiles(platform, checkpoint)
        if self.device.type == "cpu":
            if config.tune_cpu_malloc:
                tune_malloc()
            huge_pages.set_enabled(config.cpu_huge_pages)
            model.pack_weights()  # CPU projections packed once (cpu_packed_gemm; bf16: oneDNN too)
            if use_compile:  # compiled steps' projections on packed copies (deepinfer::packed_linear)
                model.register_packed_projections()
        drafter = self._drafter()
        graph_batch = min(config.max_graph_batch_size, config.max_num_seqs)
        # the graphs' memory pool holds about one largest-bucket step's activations, and a
        # model drafter's private window caches come out of the same budget
        side_bytes = (drafter.cache_bytes if drafter is not None else 0) + (
            measure_step_memory(model, self.layout, dtype, self.device, graph_batch, self.max_model_len)
            if use_graphs
            else 0
        )
        ranks = config.data_parallel_size  # each data-parallel rank has pools of its own
        self.window_pools: list[BlockPool] | None = None
        num_window_blocks = None
        if self.layout.bounded_window:
            num_window_blocks = self._window_blocks()
            self.window_pools = [BlockPool(num_window_blocks) for _ in range(ranks)]
            side_bytes += (num_window_blocks + 1) * self.layout.window_block_bytes(dtype)
        self.window_pool = self.window_pools[0] if self.window_pools is not None else None
        num_blocks = config.num_cache_blocks or self._blocks_for_budget(dtype, side_bytes)
        self.pools = [BlockPool(num_blocks) for _ in range(ranks)]
        self.pool = self.pools[0]
        self.runner = ModelRunner(
            model,
            self.layout,
            num_blocks=num_blocks,
            num_slots=config.max_num_seqs,
            device=self.device,
            ced_replay=self.layout.window if config.ced_prefill else None,
            compile_model=use_compile,
            compile_backend=config.compile_backend,
            graph_capture=platform.capture if use_graphs else None,
            max_model_len=self.max_model_len,
            max_graph_batch=graph_batch,
            feature_offsets=feature_offsets_for(drafter) if drafter is not None else None,
            kv_cache_dtype=dtype,
            compile_cache_dir=self._compile_cache_dir(checkpoint) if use_compile else None,
            compile_missing=compile_missing,
            compile_after_s=None if compile_missing else config.cpu_compile_after_s,
            num_window_blocks=num_window_blocks,
        )
        # EPLB: count each expert's tokens (rank 0 routes every token) and re-place periodically
        self.eplb: ExpertLoadWindow | None = None
        self.placement: ExpertPlacement | None = None
        self._eplb_steps = 0
        if config.enable_eplb:
            self.eplb = ExpertLoadWindow(model, config.eplb_window_size)
        if self.tp is not None:
            self.tp.setup(
                CacheSetup(
                    config.block_size,
                    self.layout.bounded_window,
                    self.layout.packed_kv,
                    dtype,
                    num_blocks,
                    config.max_num_seqs,
                    num_window_blocks,
                    count_expert_load=self.eplb is not None and self.data_parallel,
                )
            )
        if self.runner.graphs is not None:
            # every bucket now, on this thread, before any step (and before the asynchronous
            # worker exists): a capture must never overlap the host preparing another step
            self.runner.graphs.capture_all()
        platform_async = (
            platform.name == "cuda" if config.async_scheduling is None else config.async_scheduling
        )
        self.spec: SpeculativeDecoder | None = None
        if config.speculative_config is not None and drafter is not None:
            self.spec = self._speculative_decoder(config.speculative_config, drafter, lagged=platform_async)
        schedulers = [
            Scheduler(
                config,
                self.pools[rank],
                self.layout.block_size,
                config.max_num_seqs,
                self._draft if self.spec is not None else None,
                self.spec.plan if self.spec is not None else None,
                drafts_after_recompute=self.spec is not None and self.spec.rollback.drafts_after_recompute,
                window_pool=self.window_pools[rank] if self.window_pools is not None else None,
                window=self.layout.window,
            )
            for rank in range(ranks)
        ]
        self.scheduler: Scheduler | DataParallelScheduler = (
            DataParallelScheduler(schedulers) if self.data_parallel else schedulers[0]
        )
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.structured = StructuredRequests(tokenizer, self.vocab_size, self.eos_token_ids)
        self._ended: list[Request] = []  # ended outside a step (reported by the next one)
        self.requests: dict[str, Request] = {}
        # drafting needs the previous step's tokens; EPLB moves experts between steps
        use_async = platform_async and self.spec is None and not config.enable_eplb
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-step") if use_async else None
        self._inflight: tuple[PreparedStep, Future] | None = None
        self._open_steps: list[list[ScheduledChunk]] = []  # scheduled, not yet processed
        block_mib = self.layout.block_bytes(dtype) / 2**20
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %.3f MiB/block)",
            num_blocks,
            self.layout.block_size,
            num_blocks * self.layout.block_size,
            num_blocks * block_mib,
            block_mib,
        )

    def _start_tensor_parallel(self, checkpoint: Path | None) -> TensorParallelGroup:
        """Start ranks 1 .. N-1 (each loads the checkpoint and keeps its share) and shard this
        process's model as rank 0: Llama heads and MLP, DeepSeek attention heads and output
        groups, and with ``enable_expert_parallel`` a DeepSeek model's routed experts; under
        data parallel, whole replicas (their routed experts split with expert parallel)."""
        size, model = self.config.world_size, self.model
        experts = getattr(model.config, "n_routed_experts", 0)
        if self.data_parallel:
            mode = "data+ep" if self.config.enable_expert_parallel else "data"
            if self.config.enable_expert_parallel and (not experts or experts % size):
                raise ValueError(f"expert parallel size {size} does not divide the {experts} routed experts")
        elif isinstance(model, LlamaForCausalLM):
            mode = "llama"
            check_divisible(model.config, size)
        else:
            mode = "deepseek+ep" if self.config.enable_expert_parallel else "deepseek"
            if self.config.enable_expert_parallel and (not experts or experts % size):
                raise ValueError(f"expert parallel size {size} does not divide the {experts} routed experts")
            heads, groups = model.config.num_attention_heads, model.config.o_groups
            if heads % size or groups % size:
                raise ValueError(
                    f"tensor_parallel_size={size} does not divide {heads} heads and {groups} output groups"
                )
        if checkpoint is None:
            raise ValueError(
                "tensor_parallel_size or data_parallel_size > 1 needs the checkpoint directory "
                "(Engine(..., checkpoint=))"
            )
        load_kwargs = {
            "path": str(checkpoint),
            "dtype": model.compute_dtype,
            "device": str(self.device),
            "fake_quant": self.config.fake_quant,
            "keep_quantized": self.config.quantization in (None, "fp8"),
        }
        group = TensorParallelGroup(size, mode, load_kwargs)
        shard(model, mode, 0, size)
        return group

    def close(self) -> None:
        """Stop the tensor-parallel workers and the grammar compiler's thread."""
        self.structured.close()
        if self.tp is not None:
            self.tp.close()

    def _execute(self, prepared: PreparedStep, input_ids: torch.Tensor):
        """Run a step, timed on the CPU (where the forward's wall time is its cost; the
        hardware verification schedule reads it)."""
        if self.runner.device.type != "cpu":
            return self._execute_step(prepared, input_ids)
        start = time.perf_counter()
        out = self._execute_step(prepared, input_ids)
        prepared.forward_s = time.perf_counter() - start
        return out

    def _execute_step(self, prepared: PreparedStep, input_ids: torch.Tensor):
        """Run a step: on every rank when tensor parallel (its chunks broadcast first); under
        data parallel each rank runs its own chunks and rank 0 gathers the logits."""
        if self.tp is None:
            if self.config.batch_invariant and len(prepared.chunks) > 1:
                return self._execute_each(prepared)
            return self.runner.execute(prepared, input_ids)
        tp = self.tp
        if self.data_parallel:
            return self._execute_data_parallel(tp, prepared, input_ids)
        tp.step(prepared.seq_chunks or [], input_ids, prepared.padding)
        return tp.checked(lambda: self.runner.execute(prepared, input_ids))

    def _execute_each(self, prepared: PreparedStep) -> tuple[torch.Tensor, None]:
        """``batch_invariant``: every chunk as a forward of its own (the kernels then see
        the shapes the chunk alone would give them), logits rows joined in chunk order."""
        parts = []
        for chunk in prepared.chunks:
            alone = self.runner.prepare([chunk])
            logits, _ = self.runner.execute(alone, self.runner.input_ids(alone))
            rows = len(alone.seq_chunks[0].logits_offsets) if alone.seq_chunks else 0
            parts.append(logits[:rows])
        return torch.cat(parts), None

    def _execute_data_parallel(
        self, tp: TensorParallelGroup, prepared: PreparedStep, input_ids: torch.Tensor
    ):
        """Every rank its chunks (ids read now, at launch), rank 0's part here, then every
        rank's logits rows joined in rank order (the step's chunks are grouped by rank)."""
        seq_chunks = prepared.seq_chunks or []
        parts, rows = [], []
        for rank in range(tp.size):
            mine = prepared.on_rank(rank)
            rows.append(sum(len(seq_chunks[i].logits_offsets) for i in mine))
            if rank == 0:  # runs here
                parts.append(([], None))
            else:
                parts.append(([seq_chunks[i] for i in mine], self.runner.input_ids(prepared, rank).cpu()))
        tp.data_parallel_step(parts, rows)

        def run_here() -> torch.Tensor:
            logits, _ = self.runner.execute(prepared, input_ids)
            joined = gather_rows(logits, rows)
            if self.eplb is not None:
                reduce_expert_load(self.eplb.layers, idle=not prepared.on_rank(0))
            assert joined is not None
            return joined

        return tp.checked(run_here), None

    def _execution_modes(self, platform: Platform) -> tuple[bool, bool]:
        """(compile the step, replay decode steps from captured graphs), from the options or
        the platform's defaults; refuses what the platform or the model cannot do."""
        config = self.config
        if config.world_size > 1:
            return False, False  # tensor and data parallel run eager steps so far
        use_compile = platform.compile_by_default if config.compile is None else config.compile
        use_graphs = platform.capture is not None if config.capture_graphs is None else config.capture_graphs
        if use_graphs and platform.capture is None:
            raise ValueError(f"capture_graphs=True: the {platform.name} platform has no graph mode")
        if config.ced_prefill and self.model.ced_split is None:
            raise ValueError(f"ced_prefill: {type(self.model).__name__} has no causal encoder/decoder split")
        return use_compile, use_graphs

    def _cpu_default_compiles(self, platform: Platform, checkpoint: Path | None) -> bool:
        """Whether ``compile=None`` runs the step through saved compiled variants: on the CPU,
        for a model whose compiled step measured faster than eager (``cpu_compile_pays``),
        when an earlier process saved a variant of this configuration or when missing ones
        may be compiled once eager steps have cost about a compile (``cpu_compile_after_s``,
        ski rental: ``PrecompiledStep``). A first compile of a variant costs more than a short
        run gains; loading a saved one costs a small fraction of that."""
        config = self.config
        if (
            platform.name != "cpu"
            or not self.model.cpu_compile_pays
            or config.compile_backend != "inductor"
            or config.world_size > 1
            or config.batch_invariant  # eager steps by definition
        ):
            return False
        if config.cpu_compile_after_s is not None:
            return True
        from deepinfer.compile.precompiled import PrecompiledStep

        cache_dir = self._compile_cache_dir(checkpoint)
        saved = PrecompiledStep(self.model, cache_dir).has_saved_variants()
        if saved:
            logger.info("compile=None: running the compiled step saved in %s", cache_dir)
        return saved

    def _compile_cache_dir(self, checkpoint: Path | None) -> Path:
        if self.config.compile_cache_dir is not None:
            return Path(self.config.compile_cache_dir)
        from deepinfer.compile.precompiled import default_cache_dir

        return default_cache_dir(checkpoint)

    def _drafter(self) -> Drafter | None:
        """The drafter ``speculative_config`` asks for (None without speculative decoding)."""
        spec_config = self.config.speculative_config
        if spec_config is None:
            return None
        drafter = build_drafter(self.model, spec_config, self.config.max_num_seqs)
        if drafter.window and self.config.ced_prefill:
            raise ValueError(
                f"speculative_config.method={spec_config.method!r} reads every prompt row's "
                "features; it cannot run with ced_prefill (whose decoder skips rows)"
            )
        return drafter

    def _speculative_decoder(
        self, config: SpeculativeConfig, drafter: Drafter, lagged: bool
    ) -> SpeculativeDecoder:
        """The decoder over the runner: its rollback saves and restores the runner's slots,
        and the hardware schedule gets the runner's measured steps per second. ``lagged``:
        the production schedule (capacity known two steps ahead), which an asynchronous
        engine needs."""
        specs = self.layout.specs
        # Compressors keep per-sequence state a rejected draft may have advanced: their
        # ratios, and those whose state includes the overlap (the last closed group)
        ratios = sorted({s.ratio for s in specs if s.ratio})
        overlap_ratios = sorted({s.ratio for s in specs if s.ratio and s.overlap})
        sps = None
        if config.schedule == "hardware":
            sps = self.runner.steps_per_second(self.config.max_num_batched_tokens)
        rollback = Rollback(ratios, overlap_ratios, self.runner)
        return SpeculativeDecoder(config, drafter, self.max_model_len, rollback, sps, lagged)

    def _window_blocks(self) -> int:
        """Window-pool blocks: every sequence's window between steps plus a step's chunks
        (a chunk of C tokens may add ceil(C / block_size) + 1 blocks), twice over: the second
        half keeps given-back window blocks as evictable prefix-cache entries."""
        cfg, layout = self.config, self.layout
        active = cfg.max_num_seqs * (layout.window_blocks_per_sequence() + 1) + math.ceil(
            cfg.max_num_batched_tokens / layout.block_size
        )
        return 2 * active

    def _blocks_for_budget(self, dtype: torch.dtype, graph_bytes: int = 0) -> int:
        """Blocks that fit the budget after the sequence slots, the null block and slot, and
        ``graph_bytes`` (the captured graphs' memory pool, a drafter's own caches)."""
        cfg = self.config
        budget = cfg.kv_cache_memory_bytes or int(
            cfg.cache_memory_fraction * available_memory_bytes(self.device)
        )
        budget -= (cfg.max_num_seqs + 1) * self.layout.slot_bytes(dtype) + graph_bytes
        block = self.layout.block_bytes(dtype)
        # never more than every slot filled to max_model_len needs (all of that when a block
        # costs nothing: sliding-window layers alone, their window bounded apart)
        most = cfg.max_num_seqs * math.ceil(self.max_model_len / self.layout.block_size)
        blocks = min((budget - block) // block, most) if block else most  # less the null block
        if blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} is too small for one cache block"
            )
        return int(blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def memory_report(self) -> dict[str, Any]:
        """The KV cache: bytes allocated (every pool tensor; on the CPU pages are touched as
        blocks fill) and in use (blocks some request holds), and what a token costs per
        layer kind (``LLM.memory_report``). Under data parallel: per rank (every rank has
        pools of this size), with blocks in use summed over the ranks."""
        block = self.layout.block_bytes(self.kv_dtype)
        in_use = sum(1 for pool in self.pools for refs in pool.ref_count if refs > 0)
        window = {}
        if self.window_pool is not None and self.window_pools is not None:
            window_block = self.layout.window_block_bytes(self.kv_dtype)
            window_in_use = sum(1 for pool in self.window_pools for refs in pool.ref_count if refs > 0)
            window = {
                "window_blocks": self.window_pool.num_blocks,
                "window_block_bytes": window_block,
                "window_blocks_in_use": window_in_use,
                "window_in_use_bytes": window_in_use * window_block,
            }
        return {
            "dtype": str(self.kv_dtype).removeprefix("torch."),
            "allocated_bytes": pool_bytes(self.runner.pools),
            "block_size": self.layout.block_size,
            "block_bytes": block,
            "blocks": self.num_blocks,
            "blocks_in_use": in_use,
            "in_use_bytes": in_use * block + window.get("window_in_use_bytes", 0),
            "slot_bytes": self.layout.slot_bytes(self.kv_dtype),
            "bytes_per_token": block / self.layout.block_size,
            "by_layer_kind": kv_bytes_per_token(self.layout, self.kv_dtype),
            "bounded_window": self.layout.bounded_window,
            "data_parallel_size": self.config.data_parallel_size,
            **window,
        }

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        generator_offset: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and queue a request; raises ValueError naming the bad field.
        ``cache_salt`` (vLLM's): only requests with the same salt share prefix-cache blocks."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError("the engine runs n=1 requests; LLM.generate expands n > 1 into siblings")
        params.check_vocab(self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name}: {value} is above max_logprobs={self.config.max_logprobs}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if not isinstance(prompt_token_ids, list | tuple) or not prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of integers")
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt_token_ids: token id {t!r} is not an integer in [0, {self.vocab_size})"
                )
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}"
            )
        longest = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        if math.ceil(longest / self.layout.block_size) > self.num_blocks:
            raise ValueError(
                f"max_tokens: this request may reach {longest} tokens but the cache holds "
                f"{self.num_blocks * self.layout.block_size}; lower max_tokens or grow the cache"
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
        idle = self.scheduler.num_unfinished == 0 and self._inflight is None
        done, failed = self.structured.ready(idle)
        for req in done:
            self.scheduler.add(req)
        for req in failed:
            req.finish_reason = "abort"
            self._finish(req)
            self._ended.append(req)

    def abort(self, request_id: str) -> None:
        """Stop a request now; its cache is freed and its output finishes with 'abort'."""
        req = self.requests.get(request_id)
        if req is not None:
            self._end_now(req, "abort")

    def fail(self, request: Request, error: str) -> None:
        """End one request that went wrong (finish reason "error", ``error`` saying why); its
        cache is freed unpublished and the other requests go on."""
        if not request.finished:
            logger.error("request %s failed: %s", request.request_id, error)
            request.error = error
            self._end_now(request, "error")

    def _end_now(self, request: Request, reason: str) -> None:
        """Finish a request before its end (an abort, a failure): nothing it computed is
        published to the prefix cache."""
        if request.finished:
            return
        request.finish_reason = reason
        self.structured.forget(request)
        self._finish(request)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.num_unfinished > 0 or self._inflight is not None or bool(self.structured.compiling)
        )

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one step; return the requests that got new tokens or finished.

        A request whose own row goes wrong (a NaN distribution, an exception in its own
        output processing) fails alone. An exception in the step itself fails the requests
        the step (and, under asynchronous scheduling, the step scheduled after it) held,
        with finish reason "error"; requests outside them go on. ``EngineDeadError`` (the
        engine cannot step again) is raised."""
        try:
            updated = self._step()
        except EngineDeadError:
            raise
        except Exception as exc:
            logger.exception("engine step failed")
            updated = self._fail_open_steps(f"engine step failed: {type(exc).__name__}: {exc}")
        if self._ended:
            updated, self._ended = self._ended + updated, []
        return updated

    def _step(self) -> list[Request]:
        if self._executor is None:
            prepared = self._schedule()
            if prepared is None:
                return []
            logits, features = self._execute(prepared, self.runner.input_ids(prepared))
            updated = self._process(prepared, logits, features)
            self._count_expert_load()
            return updated
        if self._inflight is None:
            prepared = self._schedule()
            if prepared is None:
                return []
            self._launch(prepared)
        assert self._inflight is not None
        current, future = self._inflight
        upcoming = self._schedule()  # overlaps with the running step
        logits, features = future.result()
        self._inflight = None
        updated = self._process(current, logits, features)
        if upcoming is not None:
            self._launch(upcoming)
        self._count_expert_load()
        return updated

    def _fail_open_steps(self, error: str) -> list[Request]:
        """After a step raised: fail every request of the steps scheduled and not processed
        (their computed counts moved ahead of what their caches hold)."""
        if self._inflight is not None:
            self._inflight[1].exception()  # the launched step must end before its blocks are freed
            self._inflight = None
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

    def _count_expert_load(self) -> None:
        """EPLB: move the step's expert counts into the window; re-place every interval."""
        if self.eplb is None:
            return
        self.eplb.snapshot()
        self._eplb_steps += 1
        if self._eplb_steps % self.config.eplb_step_interval == 0:
            self.rebalance_experts()

    def rebalance_experts(self) -> ExpertPlacement:
        """Re-place the experts over the ranks for the load counted in the window (EPLB,
        with ``num_redundant_experts`` replicas of hot experts), moving weights between
        ranks in place; returns the new placement."""
        if self.eplb is None or self.tp is None:
            raise ValueError("rebalance_experts needs enable_eplb=True (expert parallel over several ranks)")
        load = self.eplb.total().float()
        experts = load.shape[1]
        placement = rebalance_experts(load, experts + self.config.num_redundant_experts, self.tp.size)
        before = self.moe_lb()
        self.tp.rebalance(self.model, placement)
        self.placement = placement
        logger.info("EPLB: moe_lb %.3f -> %.3f over the last window", before, self.moe_lb())
        return placement

    def moe_lb(self) -> float:
        """Slowest rank / mean rank of the counted expert load under the current placement
        (``deepinfer:moe_lb``; 1.0 before anything was counted)."""
        if self.eplb is None or self.tp is None:
            return 1.0
        load = self.eplb.total()
        if not load.any():
            return 1.0
        placement = self.placement or identity_placement(load.shape[0], load.shape[1], self.tp.size)
        return moe_lb(placement, load)

    def _draft(self, request: Request, room: int) -> list[int]:
        """The speculative decoder's draft, cut where the request's grammar rejects it."""
        assert self.spec is not None
        return self.structured.trim_draft(request, self.spec.draft(request, room))

    def _schedule(self) -> PreparedStep | None:
        self._admit_compiled()
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        self._open_steps.append(chunks)
        now = time.perf_counter()
        for c in chunks:
            if c.request.first_scheduled_time is None:
                c.request.first_scheduled_time = now
            if c.samples and self._executor is not None:
                c.request.pending_tokens += 1  # the token this step will sample
        if self.spec is not None:
            self.spec.before_step(chunks)
        return self.runner.prepare(chunks, data_parallel=self.data_parallel)

    def _launch(self, prepared: PreparedStep) -> None:
        assert self._executor is not None
        input_ids = self.runner.input_ids(prepared)
        self._inflight = (prepared, self._executor.submit(self._execute, prepared, input_ids))

    def _process(
        self, prepared: PreparedStep, logits: torch.Tensor, features: torch.Tensor | None = None
    ) -> list[Request]:
        """Turn a finished step's logits into tokens: prompt logprobs, sampling, verification
        of drafted chunks, prefix-cache publishing, then the drafter's turn."""
        chunks = prepared.chunks
        live = [(c, row) for c, row in zip(chunks, prepared.sample_rows, strict=True) if row >= 0]
        if self._executor is not None:  # only an asynchronous engine counts in-flight tokens
            for c, _ in live:
                c.request.pending_tokens = max(0, c.request.pending_tokens - 1)
        live = [(c, row) for c, row in live if not c.request.finished]
        self._prompt_logprobs(prepared, logits)
        updated = self._sample([(c, row) for c, row in live if not c.draft], logits)
        if self.spec is not None:
            drafted = [(c, logits[row : row + len(c.draft) + 1]) for c, row in live if c.draft]
            checked = [(c, self.structured.mask_drafted(c.request, c.draft, rows)) for c, rows in drafted]
            verified = self.spec.verify(checked)
            for v, (_, raw) in zip(verified, drafted, strict=True):
                v.logits = raw  # logprobs are reported from the raw distribution
            updated += [self._append_verified(v) for v in verified]
        # published first, then trimmed: trimmed blocks stay cached
        self.scheduler.after_step([c.request for c in chunks])
        if self.spec is not None:
            if prepared.forward_s is not None and all(c.num_tokens == 1 + len(c.draft) for c in chunks):
                self.spec.observe_step(sum(c.num_tokens for c in chunks), prepared.forward_s)
            featured = [
                (c, rows)
                for c, rows in zip(chunks, prepared.feature_rows or [], strict=False)
                if c.request.status is Status.RUNNING
            ]
            ready = [r for r in self.scheduler.running if self.scheduler.may_draft(r)]
            self.spec.after_step(featured, features, ready)
        self._open_steps = [c for c in self._open_steps if c is not chunks]
        return updated

    def _prompt_logprobs(self, prepared: PreparedStep, logits: torch.Tensor) -> None:
        for c, (first, count) in zip(prepared.chunks, prepared.prompt_rows, strict=True):
            req = c.request
            if count and not req.finished:
                entries = self.output_processor.prompt_logprobs(
                    req, logits[first : first + count], c.start, count
                )
                have = req.prompt_logprobs or [None]  # entry i is for prompt token i
                have += entries[len(have) - c.start - 1 :]  # a recompute after preemption adds none twice
                req.prompt_logprobs = have

    def _sample(self, live: list[tuple[ScheduledChunk, int]], logits: torch.Tensor) -> list[Request]:
        """One token for each chunk that reached its sequence's end (``live``: chunk and its
        logits row), with stop checks."""
        if not live:
            return []
        rows = [c.request.sampling_row or self._sampling_row(c.request) for c, _ in live]
        indices = [row for _, row in live]
        if indices == list(range(len(indices))):  # the usual step: rows 0..n-1, no gather
            sampled_logits = logits[: len(indices)]
        else:
            sampled_logits = logits[torch.tensor(indices)]
        allowed = self.structured.mask_rows(sampled_logits, [c.request for c, _ in live])
        tokens = sample(allowed, rows, rowwise=self.config.batch_invariant)
        now = time.perf_counter()
        updated = []
        for i, ((c, _), token) in enumerate(zip(live, tokens, strict=True)):
            req = c.request
            updated.append(req)
            if token == INVALID_ROW:
                self.fail(req, "the model's distribution for this request was not finite (NaN)")
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            try:
                # a row's logits are read only for its logprobs: no view made for the others
                self._append(req, token, sampled_logits[i] if req.params.logprobs is not None else None)
            except Exception as exc:  # this request's own post-processing: it fails alone
                logger.exception("request %s failed after sampling", req.request_id)
                self.fail(req, f"{type(exc).__name__}: {exc}")
                continue
            if req.finish_reason is not None:  # the token just sampled has no row yet (an
                # asynchronous engine may count the next step's row already)
                self._finish(req, computed=min(req.num_computed_tokens, req.num_tokens - 1))
        return updated

    def _sampling_row(self, request: Request) -> SamplingRow:
        """What the sampler reads of ``request``, made once: its params, generator and token
        lists never change identity (the lists grow in place)."""
        request.sampling_row = SamplingRow(
            request.params,
            request.generator,
            request.prompt_token_ids,
            request.output_token_ids,
            self.eos_token_ids,
        )
        return request.sampling_row

    def _append_verified(self, verified: VerifiedChunk) -> Request:
        """Append a drafted chunk's verified tokens one by one (stop checks apply to each),
        then let the speculative decoder roll the computed count back to the valid rows."""
        req = verified.chunk.request
        assert isinstance(req, Request)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        for j, token in enumerate(verified.tokens):
            self._append(req, token, verified.logits[j])
            if req.finish_reason is not None:  # rows up to the anchor and accepted drafts are valid
                self._finish(req, computed=verified.anchor + j + 1)
                return req
        assert self.spec is not None
        self.spec.roll_back(verified)
        return req

    def _append(self, req: Request, token: int, row_logits: torch.Tensor | None) -> None:
        """Append a sampled token (stop checks) and advance the request's grammar, whose end
        (its stop token accepted) ends the request."""
        self.output_processor.append_token(req, token, row_logits)
        reason = self.structured.accept(req, token)
        if reason is not None and req.finish_reason is None:
            req.finish_reason = reason

    def _finish(self, req: Request, computed: int | None = None) -> None:
        """``computed``: positions whose cache rows this request has validly written; their
        full blocks are published to the prefix cache before the blocks are freed (None: an
        abort, nothing published)."""
        req.finished_time = time.perf_counter()
        if self.spec is not None:
            self.spec.forget(req.request_id)
        self.scheduler.finish(req, computed)

    # ---- outputs --------------------------------------------------------------------------

    def make_output(self, req: Request) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.output_processor.text_of(req),
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=req.logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            error=req.error,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            num_generated_tokens=len(req.output_token_ids),
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[completion],
            finished=req.finished,
            prompt_logprobs=req.prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens,
            metrics=metrics,
        )

    def shutdown(self) -> None:
        if self._inflight is not None:
            self._inflight[1].result()
            self._inflight = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
