"""How an engine is built, decided once before its first step: which execution modes the step
uses (compiled, captured graphs), how the weights are prepared for the CPU, how many cache
blocks fit the memory budget, and the worker ranks of tensor, expert or data parallelism.

These are the policy decisions of construction; ``Engine.__init__`` applies them in order and
keeps only the objects they produce.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.cache.pools import CacheLayout
from deepinfer.cache.tiers import KVTiers
from deepinfer.cache.tiers.codec import BlockCodec
from deepinfer.cache.tiers.fingerprint import checkpoint_fingerprint, module_fingerprint, namespace
from deepinfer.config import EngineConfig
from deepinfer.distributed.tensor_parallel import check_divisible
from deepinfer.distributed.tiers import TensorParallelTiers, TierSetup, tier_group
from deepinfer.distributed.workers import CacheSetup, TensorParallelGroup, parallel_mode, shard
from deepinfer.engine import lora_setup
from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.cpu_decode import OneCallDecode, one_call_decode
from deepinfer.engine.dp_scheduler import DataParallelScheduler
from deepinfer.engine.graph_runner import measure_step_memory
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.kernels.huge_pages import HugePageArena
from deepinfer.lora.registry import LoraRegistry
from deepinfer.models import prepare
from deepinfer.models.base import CausalLM
from deepinfer.models.dspark_head import load_head
from deepinfer.models.llama import LlamaForCausalLM
from deepinfer.platforms import Platform
from deepinfer.platforms.cpu import tune_malloc
from deepinfer.speculative.decoder import SpeculativeDecoder
from deepinfer.speculative.drafter import Drafter, feature_offsets_for
from deepinfer.speculative.drafters import build_drafter
from deepinfer.speculative.rollback import Rollback

logger = logging.getLogger("deepinfer")


@dataclass(frozen=True)
class ExecutionModes:
    """How the engine's steps run. ``compile_missing``: a step variant with no saved compiled
    form is compiled when first met (False: the CPU default, which runs such steps eagerly
    until they have cost about one compile, ``cpu_compile_after_s``)."""

    compile: bool
    graphs: bool
    compile_missing: bool


def execution_modes(
    config: EngineConfig, model: CausalLM, platform: Platform, checkpoint: Path | None
) -> ExecutionModes:
    """Compile the step or not, and replay decode steps from captured graphs or not, from the
    options or the platform's defaults; refuses what the platform or the model cannot do."""
    if config.world_size > 1:
        use_compile, use_graphs = False, False  # tensor and data parallel run eager steps
    else:
        use_compile = platform.compile_by_default if config.compile is None else config.compile
        use_graphs = platform.capture is not None if config.capture_graphs is None else config.capture_graphs
        if config.enable_lora:
            use_compile, use_graphs = lora_setup.step_modes(config, model, use_compile, use_graphs)
        if use_graphs and platform.capture is None:
            raise ValueError(
                f"capture_graphs=True: the {platform.name} platform has no graph mode "
                "(capture_graphs=False or None runs its steps uncaptured)"
            )
        if config.ced_prefill and model.ced_split is None:
            raise ValueError(f"ced_prefill: {type(model).__name__} has no causal encoder/decoder split")
    # compile=None on the CPU, where compiling pays: saved variants run, and a step none
    # covers runs eagerly until such steps have taken cpu_compile_after_s (then compiles)
    compile_missing = not (config.compile is None and not use_compile)
    if not compile_missing:
        use_compile = cpu_default_compiles(config, model, platform, checkpoint)
    if use_graphs and not use_compile:  # no Inductor compile before the first step
        logger.info("decode graphs are captured over the eager step (compile off)")
    return ExecutionModes(use_compile, use_graphs, compile_missing)


def cpu_default_compiles(
    config: EngineConfig, model: CausalLM, platform: Platform, checkpoint: Path | None
) -> bool:
    """Whether ``compile=None`` runs the step through saved compiled variants: on the CPU, for
    a model whose compiled step measured faster than eager (``cpu_compile_pays``), when an
    earlier process saved a variant of this configuration or when missing ones may be compiled
    once eager steps have cost about a compile (``cpu_compile_after_s``, ski rental:
    ``PrecompiledStep``). A first compile of a variant costs more than a short run gains;
    loading a saved one costs a small fraction of that."""
    if (
        platform.name != "cpu"
        or not model.cpu_compile_pays
        or config.compile_backend != "inductor"
        or config.world_size > 1
        or config.batch_invariant  # eager steps by definition
        or config.enable_return_routed_experts
        or config.enable_lora
    ):
        return False
    if config.cpu_compile_after_s is not None:
        return True
    from deepinfer.compile.precompiled import PrecompiledStep

    cache_dir = compile_cache_dir(config, checkpoint)
    saved = PrecompiledStep(model, cache_dir).has_saved_variants()
    if saved:
        logger.info("compile=None: running the compiled step saved in %s", cache_dir)
    return saved


def compile_cache_dir(config: EngineConfig, checkpoint: Path | None) -> Path:
    """Where compiled steps are saved: the option, else beside the checkpoint when writable."""
    if config.compile_cache_dir is not None:
        return Path(config.compile_cache_dir)
    from deepinfer.compile.precompiled import default_cache_dir

    return default_cache_dir(checkpoint)


def huge_page_arena(config: EngineConfig) -> HugePageArena | None:
    """Where packed CPU weights go: huge-page memory unless ``cpu_huge_pages`` is off."""
    return HugePageArena() if config.cpu_huge_pages and config.device == "cpu" else None


def prepare_weights(model: CausalLM, config: EngineConfig, share: bool = True) -> None:
    """The engine's forms of the weights before sharding: fused projections, fp8 or
    weight-only int8/int4 (``models/prepare.py``). ``share=False``: the parameters stay as
    they are (a trainer's); fused weights are copies."""
    prepare.quantize(model, config.quantization, huge_page_arena(config), share)


def prepare_cpu_weights(model: CausalLM, config: EngineConfig, use_compile: bool) -> OneCallDecode | None:
    """On the CPU: the C library's allocation thresholds, the projections packed once for our
    GEMM kernels (in huge pages unless ``cpu_huge_pages`` is off; registered as
    ``packed_linear`` inputs when the step is compiled), and the one-call decode over them
    where the model has one. Applied from outside the model's forward, whose math the plain
    weights still define."""
    if config.tune_cpu_malloc:
        tune_malloc()
    prepare.pack_for_cpu(model, huge_page_arena(config))
    if use_compile:
        model.register_packed_projections()
        return None
    # batch_invariant steps compute as the research forward does, layer by layer
    return None if config.batch_invariant else one_call_decode(model)


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


def window_blocks(config: EngineConfig, layout: CacheLayout) -> int:
    """Window-pool blocks: every sequence's window between steps plus a step's chunks (a chunk
    of C tokens may add ceil(C / block_size) + 1 blocks), twice over: the second half keeps
    given-back window blocks as evictable prefix-cache entries."""
    active = config.max_num_seqs * (layout.window_blocks_per_sequence() + 1) + math.ceil(
        config.max_num_batched_tokens / layout.block_size
    )
    return 2 * active


def blocks_for_budget(
    config: EngineConfig,
    layout: CacheLayout,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    side_bytes: int = 0,
) -> int:
    """Blocks that fit the budget after the sequence slots, the null block and slot, and
    ``side_bytes`` (the captured graphs' memory pool, a drafter's own caches, the window
    pool)."""
    budget = config.kv_cache_memory_bytes or int(
        config.cache_memory_fraction * available_memory_bytes(device)
    )
    budget -= (config.max_num_seqs + 1) * layout.slot_bytes(dtype) + side_bytes
    block = layout.block_bytes(dtype)
    # never more than every slot filled to max_model_len needs (all of that when a block
    # costs nothing: sliding-window layers alone, their window bounded apart)
    most = config.max_num_seqs * math.ceil(max_model_len / layout.block_size)
    blocks = min((budget - block) // block, most) if block else most  # less the null block
    if blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is too small for one cache block"
        )
    return int(blocks)


def start_tensor_parallel(
    model: CausalLM, config: EngineConfig, device: torch.device, checkpoint: Path | None
) -> TensorParallelGroup:
    """Start ranks 1 .. N-1 (each loads the checkpoint and keeps its share) and shard this
    process's model as rank 0: Llama heads and MLP, DeepSeek attention heads and output
    groups, and with ``enable_expert_parallel`` a DeepSeek model's routed experts; under data
    parallel, whole replicas (their routed experts split with expert parallel)."""
    size = config.world_size
    experts = getattr(model.config, "n_routed_experts", 0)
    llama = isinstance(model, LlamaForCausalLM)
    mode = parallel_mode(llama, config.data_parallel_size, config.enable_expert_parallel)
    if config.enable_lora and mode != "llama":  # DeepSeek's adapted linears are cut otherwise
        raise ValueError(
            f"enable_lora=True with tensor_parallel_size > 1: {type(model).__name__}'s adapters are "
            "not cut across ranks; run on one rank (tensor_parallel_size=1)"
        )
    if mode.endswith("ep") and (not experts or experts % size):
        raise ValueError(f"expert parallel size {size} does not divide the {experts} routed experts")
    if mode == "llama":
        check_divisible(model.config, size)
    elif mode.startswith("deepseek"):
        heads, groups = model.config.num_attention_heads, model.config.o_groups
        if heads % size or groups % size:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide {heads} heads and {groups} output groups"
            )
    if checkpoint is None:
        raise ValueError(
            "tensor_parallel_size or data_parallel_size > 1 needs the checkpoint directory (Engine(..., checkpoint=))"
        )
    load_kwargs = {
        "path": str(checkpoint),
        "dtype": model.compute_dtype,
        "device": str(device),
        "fake_quant": config.fake_quant,
        "keep_quantized": config.quantization in (None, "fp8"),
    }
    group = TensorParallelGroup(size, mode, load_kwargs)
    shard(model, mode, 0, size)
    return group


def worker_caches(
    tp: TensorParallelGroup,
    config: EngineConfig,
    layout: CacheLayout,
    dtype: torch.dtype,
    size: CacheSize,
    eplb: bool,
    tiers: TierSetup | None,
) -> None:
    """Every worker rank allocates the pools rank 0 has (``eplb``: and counts expert load,
    under data parallel; ``tiers``: and makes its own KV cache tiers)."""
    tp.setup(
        CacheSetup(
            config.block_size,
            layout.bounded_window,
            layout.packed_kv,
            dtype,
            size.num_blocks,
            config.max_num_seqs,
            size.num_window_blocks,
            count_expert_load=eplb and config.data_parallel_size > 1,
            lora=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,
            tiers=tiers,
        )
    )


def drafter_for(model: CausalLM, config: EngineConfig) -> Drafter | None:
    """The drafter ``speculative_config`` asks for (None without speculative decoding)."""
    spec_config = config.speculative_config
    if spec_config is None:
        return None
    head_draft = None
    if spec_config.model is not None:  # a separately trained DSpark head beside the target
        device = next(model.parameters()).device
        head = load_head(spec_config.model, model.compute_dtype, device)
        head_draft = model.draft_head(head)
        if device.type == "cpu":
            head_draft.pack_for_cpu()
    drafter = build_drafter(model, spec_config, config.max_num_seqs, head_draft)
    if drafter.window and config.ced_prefill:
        raise ValueError(
            f"speculative_config.method={spec_config.method!r} reads every prompt row's "
            "features; it cannot run with ced_prefill (whose decoder skips rows)"
        )
    return drafter


def speculative_decoder(
    config: EngineConfig,
    drafter: Drafter,
    layout: CacheLayout,
    runner: ModelRunner,
    max_model_len: int,
    lagged: bool,
) -> SpeculativeDecoder:
    """The decoder over the runner: its rollback saves and restores the runner's slots, and the
    hardware schedule gets the runner's measured steps per second. ``lagged``: the production
    schedule (capacity known two steps ahead), which an asynchronous engine needs."""
    spec_config = config.speculative_config
    assert spec_config is not None
    # Compressors keep per-sequence state a rejected draft may have advanced: their ratios,
    # and those whose state includes the overlap (the last closed group)
    ratios = sorted({s.ratio for s in layout.specs if s.ratio})
    overlap_ratios = sorted({s.ratio for s in layout.specs if s.ratio and s.overlap})
    sps = None
    if spec_config.schedule == "hardware":
        sps = runner.steps_per_second(config.max_num_batched_tokens)
    rollback = Rollback(ratios, overlap_ratios, runner)
    return SpeculativeDecoder(spec_config, drafter, max_model_len, rollback, sps, lagged)


@dataclass(frozen=True)
class CacheSize:
    """Blocks of the paged cache and of a bounded window's pool (None: no bounded window),
    per data-parallel rank."""

    num_blocks: int
    num_window_blocks: int | None


def cache_size(
    config: EngineConfig,
    model: CausalLM,
    layout: CacheLayout,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    drafter: Drafter | None,
    graph_batch: int | None,
) -> CacheSize:
    """The cache's blocks for the budget left after what else the engine keeps on the device:
    the captured graphs' memory pool (about one largest-bucket step's activations, when
    ``graph_batch`` says graphs are captured), a model drafter's private window caches and
    a bounded window's pool."""
    side_bytes = drafter.cache_bytes if drafter is not None else 0
    if graph_batch is not None:
        side_bytes += measure_step_memory(model, layout, dtype, device, graph_batch, max_model_len)
    num_window_blocks = None
    if layout.bounded_window:
        num_window_blocks = window_blocks(config, layout)
        side_bytes += (num_window_blocks + 1) * layout.window_block_bytes(dtype)
    num_blocks = config.num_cache_blocks or blocks_for_budget(
        config, layout, dtype, device, max_model_len, side_bytes
    )
    block_mib = layout.block_bytes(dtype) / 2**20
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %.3f MiB/block)",
        num_blocks,
        layout.block_size,
        num_blocks * layout.block_size,
        num_blocks * block_mib,
        block_mib,
    )
    return CacheSize(num_blocks, num_window_blocks)


def model_runner(
    model: CausalLM,
    config: EngineConfig,
    layout: CacheLayout,
    dtype: torch.dtype,
    platform: Platform,
    modes: ExecutionModes,
    size: CacheSize,
    drafter: Drafter | None,
    max_model_len: int,
    checkpoint: Path | None,
    eager_step: Callable[..., Any] | None = None,
    lora: LoraRegistry | None = None,
) -> ModelRunner:
    """The runner for the modes and cache size decided above: its pools, its compiled step
    (saved beside the checkpoint) and its graph buckets; ``lora``: the served adapters."""
    return ModelRunner(
        model,
        layout,
        num_blocks=size.num_blocks,
        num_slots=config.max_num_seqs,
        device=next(model.parameters()).device,
        ced_replay=layout.window if config.ced_prefill else None,
        compile_model=modes.compile,
        compile_backend=config.compile_backend,
        graph_capture=platform.capture if modes.graphs else None,
        max_model_len=max_model_len,
        max_graph_batch=graph_batch_size(config),
        feature_offsets=feature_offsets_for(drafter) if drafter is not None else None,
        feature_layers=drafter.feature_layers if drafter is not None else (),
        kv_cache_dtype=dtype,
        compile_cache_dir=compile_cache_dir(config, checkpoint) if modes.compile else None,
        compile_missing=modes.compile_missing,
        compile_after_s=None if modes.compile_missing else config.cpu_compile_after_s,
        num_window_blocks=size.num_window_blocks,
        eager_step=eager_step,
        batch_invariant=config.batch_invariant,
        record_routing=config.enable_return_routed_experts,
        lora=lora,
    )


def graph_batch_size(config: EngineConfig) -> int:
    """The largest batch a captured decode graph covers."""
    return min(config.max_graph_batch_size, config.max_num_seqs)


def tier_setup(
    config: EngineConfig, model: CausalLM, runner: ModelRunner, dtype: torch.dtype, checkpoint: Path | None
) -> TierSetup | None:
    """The prefix cache's host and disk tiers, when configured. The disk tier's files are
    bound to the checkpoint's files (or, for a module with none, its parameters), the cache
    layout and its element type."""
    if not config.kv_tiers:
        return None
    model_id = checkpoint_fingerprint(checkpoint) if checkpoint is not None else module_fingerprint(model)
    disk_dir = None if config.kv_cache_dir is None else str(config.kv_cache_dir)
    entry_bytes = BlockCodec(runner.layout, runner.pools).entry_bytes
    name = namespace(model_id, runner.layout, dtype, entry_bytes)
    return TierSetup(config.kv_offload_bytes, disk_dir, config.kv_disk_bytes, name)


def kv_tiers(tiers: TierSetup | None, runner: ModelRunner, tp: TensorParallelGroup | None) -> KVTiers | None:
    """This process's tiers over its pools; under tensor parallel, rank 0's, which the workers
    follow (``distributed/tiers.py``: the group is made on every rank after the workers' cache
    setup)."""
    if tiers is None:
        return None
    codec = BlockCodec(runner.layout, runner.pools)
    if tp is None:
        return KVTiers(codec, tiers.host_bytes, tiers.disk_dir, tiers.disk_bytes, tiers.namespace)
    made = tiers.tiers(codec, 0, tp.size, tier_group())
    assert isinstance(made, TensorParallelTiers)
    tp.tiers = made
    return made


@dataclass
class Scheduling:
    """The block pools of every data-parallel rank and the scheduler over them."""

    scheduler: Scheduler | DataParallelScheduler
    block_pools: list[BlockPool]  # one per data-parallel rank
    window_block_pools: list[BlockPool] | None  # likewise, with a bounded window cache


def scheduling(
    config: EngineConfig,
    layout: CacheLayout,
    size: CacheSize,
    tiers: KVTiers | None,
    drafts_after_recompute: bool,
    block_published: Callable[[Request, int, bytes], None] | None,
) -> Scheduling:
    """One block pool (and window pool) and one scheduler per data-parallel rank, each rank's
    cache its own; ``block_published`` hears of rank 0's published blocks (the routing record)."""
    ranks = config.data_parallel_size
    pools = [BlockPool(size.num_blocks) for _ in range(ranks)]
    windows = size.num_window_blocks
    window_pools = None if windows is None else [BlockPool(windows) for _ in range(ranks)]
    schedulers = [
        Scheduler(
            config,
            pools[rank],
            layout.block_size,
            config.max_num_seqs,
            drafts_after_recompute=drafts_after_recompute,
            window_pool=window_pools[rank] if window_pools is not None else None,
            window=layout.window,
            tiers=tiers,
            block_published=block_published if rank == 0 else None,
        )
        for rank in range(ranks)
    ]
    scheduler = DataParallelScheduler(schedulers) if ranks > 1 else schedulers[0]
    return Scheduling(scheduler, pools, window_pools)
