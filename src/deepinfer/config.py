"""``EngineConfig``: the engine's knobs, validated once. Each model's own
configuration lives with the model (``deepinfer.models``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.cache import kv_dtypes
from deepinfer.feature_modes import check_config as check_feature_modes
from deepinfer.speculative.config import SpeculativeConfig

KV_CACHE_DTYPES = ("auto", *kv_dtypes.KV_CACHE_DTYPES)
QUANTIZATIONS = (None, "none", "fp8", "int8", "int4", "bf16")
COMPILE_AFTER_ENV = "DEEPINFER_CPU_COMPILE_AFTER_S"
KV_CACHE_SPACE_ENV = "DEEPINFER_KV_CACHE_SPACE_GB"


def _env_kv_cache_bytes() -> int | None:
    """``kv_cache_memory_bytes``'s default: ``$DEEPINFER_KV_CACHE_SPACE_GB`` GiB when set (as
    vLLM's CPU backend sizes its cache by ``VLLM_CPU_KVCACHE_SPACE``), else None: a fraction of
    free memory. Processes that share a machine (test workers, replicas) set it, since each
    would otherwise claim the same free memory."""
    raw = os.environ.get(KV_CACHE_SPACE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        raise ValueError(f"${KV_CACHE_SPACE_ENV} must be a number of GiB, got {raw!r}") from None
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"${KV_CACHE_SPACE_ENV} must be a positive number of GiB, got {raw!r}")
    return int(gib * (1 << 30))


def _env_compile_after() -> float | None:
    """``cpu_compile_after_s``'s default: ``$DEEPINFER_CPU_COMPILE_AFTER_S`` (seconds, or
    "none"), else 30 s (about what one tiny-V4 compile costs)."""
    raw = os.environ.get(COMPILE_AFTER_ENV, "").strip()
    if not raw:
        return 30.0
    if raw.lower() in ("none", "off"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${COMPILE_AFTER_ENV} must be a number of seconds or 'none', got {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"${COMPILE_AFTER_ENV} must be >= 0, got {raw!r}")
    return value


@dataclass
class EngineConfig:
    """Engine knobs, passed as ``LLM(path, **EngineConfig fields)``."""

    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16  # rounded up to a multiple of every compression ratio
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # KV budget; default: $DEEPINFER_KV_CACHE_SPACE_GB GiB when set, else a fraction of free memory
    kv_cache_memory_bytes: int | None = field(default_factory=_env_kv_cache_bytes)
    cache_memory_fraction: float = 0.25
    num_cache_blocks: int | None = None  # exact block count (overrides the budget); tests
    enable_prefix_caching: bool = True
    # the most logprobs (and prompt logprobs) a request may ask for per token (vLLM's option
    # and default): a request for the whole vocabulary per token would be a cheap way to
    # exhaust a server
    max_logprobs: int = 20
    # None = auto: on for CUDA (the GPU computes while the CPU schedules), off on CPU, where
    # the model and the scheduler compete for the same cores (benchmarks/RESULTS.md)
    async_scheduling: bool | None = None
    fake_quant: bool | None = None  # None: the model's default (V4 off, V4.1 on)
    # Weights in memory (vLLM's option name). None: as the checkpoint stores them (fp8-block
    # linears and fp4 routed experts stay resident, dequantized a tile at a time in the
    # matmul: kernels/quantized.py); "none": dequantize fp8/fp4 to ``dtype`` on load; "fp8":
    # also quantize the float linears the release format stores in fp8 (DeepSeek models);
    # "int8" per channel / "int4" per group of 32: weight-only copies of a dense model's
    # projections for CPU decode (kernels/weight_only.py)
    quantization: str | None = None
    # dtype of the paged K/V cache (vLLM's option name): "auto" = the precision the model was
    # trained for where it has one (QAT fake-quant on: window K=V in fp8, compressed entries
    # and indexer keys in fp4, with their scales; cache/kv_formats.py), else its compute
    # dtype; "float32" / "bfloat16" / "float16" force that dtype everywhere (compressor
    # state stays fp32); "fp8" (= "fp8_e4m3") / "fp8_e5m2" store K/V rows in fp8 with a scale
    # of 1, saturated (cache/kv_dtypes.py)
    kv_cache_dtype: str = "auto"
    # Tensor parallelism (vLLM's option name): ranks 1 .. T-1 run in worker processes the
    # engine starts (distributed/workers.py); Llama and DeepSeek models, eager steps
    tensor_parallel_size: int = 1
    # Data-parallel attention (vLLM's option name): D ranks, each running attention for its
    # own requests over its own KV cache (one scheduler per rank); with
    # enable_expert_parallel the routed experts are split over the D ranks and reached by
    # all-to-all, else each rank holds the whole model. tensor_parallel_size must then be 1
    data_parallel_size: int = 1
    # Whole engines over one machine's CPU threads (SGLang's dp_size, not vLLM's
    # data-parallel attention above): LLM.generate splits a call's requests over N engines,
    # N - 1 of them in worker processes, each on 1/N of torch.get_num_threads()
    # (replicas.py). CPU only; tensor_parallel_size and data_parallel_size must be 1
    data_parallel_replicas: int = 1
    # with tensor_parallel_size > 1 on a MoE model: split the routed experts over the ranks
    # (vLLM's option name); attention and the shared expert run whole on every rank
    enable_expert_parallel: bool = False
    # EPLB with expert parallel (vLLM's names): count each expert's tokens over the last
    # eplb_window_size steps and re-place the experts every eplb_step_interval steps, with
    # num_redundant_experts extra replicas of hot experts (a multiple of the ranks)
    enable_eplb: bool = False
    eplb_window_size: int = 1000
    eplb_step_interval: int = 3000
    num_redundant_experts: int = 0
    # Sliding-window layers keep their K=V in a pool of their own, of which a sequence holds
    # only the blocks its window covers (older ones become evictable prefix-cache entries):
    # window memory stays ~window tokens per sequence. False: every token's window row stays
    # in the paged blocks for the whole sequence (the earlier layout, for comparison)
    bounded_window_cache: bool = True
    # V4.1's causal encoder/decoder prefill: decoder layers run only over
    # each prompt's last window; approximate (not the reference forward), so off by default
    ced_prefill: bool = False
    # A request's logits independent of the rest of the batch, of its place in it and of the
    # token budget that chunks its prefill (SGLang/vLLM's option name): each sequence's chunk
    # runs as a forward of its own, and prefill chunks fall on a fixed grid of 32 positions
    # (engine/scheduler.grid_size), so every row is computed by the same kernels on the same
    # shapes whatever else is scheduled. Eager steps on one rank; costs batching (RESULTS.md)
    batch_invariant: bool = False
    # Each output carries the routed experts every token it read went through, per MoE layer
    # (``RequestOutput.routed_experts``; vLLM's and SGLang's option), so a trainer replays the
    # rollout's routing (``model(..., routed_experts=...)``). On one rank, in every step mode
    # (``feature_modes``); prefix-cache hits report the routing their blocks were computed with
    enable_return_routed_experts: bool = False
    # Serve LoRA adapters (PEFT's format) per request, many in one batch (vLLM's names):
    # up to max_loras adapters run at once, each of rank <= max_lora_rank, and max_cpu_loras
    # are kept loaded by name (lora/). Which step modes take them: ``feature_modes``
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # Prefix-cache tiers below the KV pool (cache/tiers): every full block the prefix cache
    # publishes is also kept in a host tier of kv_offload_bytes (pinned memory on CUDA) and in
    # files under kv_cache_dir, bounded by kv_disk_bytes (least recently used out first); a
    # prompt whose prefix the pool evicted is loaded back from them, and the files serve later
    # processes over the same weights. 0 / None: no such tier. Under tensor parallel, per rank
    kv_offload_bytes: int = 0
    kv_cache_dir: str | None = None
    kv_disk_bytes: int = 16 << 30
    # Prefill/decode disaggregation (deepinfer.disagg): "prefill" keeps every prompt's blocks
    # in its host or disk tier for a decode server to take; "decode" takes blocks its prefill
    # peer offers through the tiers' remote source. None: neither
    kv_role: str | None = None
    # torch.compile the model step (compilation.py). None = the platform's default: on for
    # CUDA; on the CPU, for models whose compiled step beats eager (V4, V4.1), the compiled
    # step an earlier run saved, and a step no saved variant covers runs eagerly until such
    # steps have taken cpu_compile_after_s, then compiles (and saves) a variant; other
    # models eager (compile vs eager: benchmarks/RESULTS.md)
    compile: bool | None = None
    # The CPU default's eager budget before it compiles a missing step variant (seconds of
    # eager steps since the last compile; ski rental: about one compile's cost). None: the
    # default never compiles, it only loads saved steps.
    # Default from $DEEPINFER_CPU_COMPILE_AFTER_S ("none" to turn it off), else 30
    cpu_compile_after_s: float | None = field(default_factory=_env_compile_after)
    compile_backend: str = "inductor"  # any torch.compile backend ("eager" checks guards fast)
    # Where a CPU step compiled by Inductor is saved and loaded by later processes
    # (precompiled.py). None: beside the checkpoint when writable, else ~/.cache/deepinfer
    compile_cache_dir: str | None = None
    # CPU, glibc: keep the step's large buffers (up to 32 MiB each) in the heap and freed heap
    # memory mapped (up to 1 GiB), instead of mmap/munmap per buffer: every step otherwise pays
    # page faults on fresh activations (measured on SmolLM2's prefill: benchmarks/RESULTS.md).
    # Process-wide and applied once at engine start; False leaves the C library's defaults
    tune_cpu_malloc: bool = True
    # CPU, Linux: packed weight copies of 1 MiB and more live in 2 MiB-aligned memory advised
    # for transparent huge pages (kernels/huge_pages.py): a decode step streams them, and 4 KiB
    # pages cost a TLB miss each and stop the prefetchers (measured on SmolLM2's projections
    # at one row: benchmarks/RESULTS.md). Process-wide, set when an engine packs its weights
    cpu_huge_pages: bool = True
    # Replay pure-decode steps from captured graphs (CUDA graphs; NPU graph mode) in batch-size
    # buckets up to max_graph_batch_size. None = on where the platform has a graph mode.
    # With compile=False the graphs record the eager step: no Inductor compile at start
    capture_graphs: bool | None = None
    max_graph_batch_size: int = 64
    # Speculative decoding (vLLM's name): None, or a SpeculativeConfig / dict of its fields.
    # Drafting reads the previous step's tokens, so speculative steps run synchronously; with
    # async_scheduling on (or auto on CUDA) the hardware schedule takes its production form,
    # whose verify capacity is known two steps ahead (lagged_topk_schedule)
    speculative_config: Any = None

    @property
    def world_size(self) -> int:
        """Ranks the engine runs on (tensor x data parallel)."""
        return self.tensor_parallel_size * self.data_parallel_size

    def _validate_lora(self, positive_int: Callable[[str], None]) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a bool, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            positive_int(name)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        positive_int("max_cpu_loras")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if not self.enable_lora:
            return
        if self.ced_prefill:
            raise ValueError(
                "enable_lora=True with ced_prefill=True is refused: its prefill passes run without the adapters"
            )
        if self.enable_return_routed_experts:
            raise ValueError(
                "enable_lora=True with enable_return_routed_experts=True is refused: turn one of them off"
            )
        if self.data_parallel_replicas > 1:
            raise ValueError(
                "enable_lora=True with data_parallel_replicas > 1 is refused: run one replica (the "
                "adapters' slots are this process's)"
            )

    @property
    def kv_tiers(self) -> bool:
        """Whether the prefix cache has a host or disk tier, or (a decode server) a remote one."""
        return self.kv_offload_bytes > 0 or self.kv_cache_dir is not None or self.kv_role == "decode"

    def _validate_tiers(self) -> None:
        for name in ("kv_offload_bytes", "kv_disk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
        if self.kv_cache_dir is not None and not isinstance(self.kv_cache_dir, (str, os.PathLike)):
            raise ValueError(f"kv_cache_dir must be a directory path or None, got {self.kv_cache_dir!r}")
        self._validate_kv_role()
        if not self.kv_tiers:
            return
        if self.kv_cache_dir is not None and self.kv_disk_bytes == 0:
            raise ValueError("kv_disk_bytes must be > 0 with kv_cache_dir set")
        if not self.enable_prefix_caching:
            raise ValueError(
                "kv_offload_bytes / kv_cache_dir tier the prefix cache: enable_prefix_caching must be True"
            )
        if self.enable_return_routed_experts:
            raise ValueError(
                "kv_offload_bytes / kv_cache_dir with enable_return_routed_experts=True is refused: a tier "
                "restores K/V but not the routing record of its positions"
            )

    def _validate_kv_role(self) -> None:
        if self.kv_role not in (None, "prefill", "decode"):
            raise ValueError(f"kv_role must be 'prefill', 'decode' or None, got {self.kv_role!r}")
        if self.kv_role is None:
            return
        if self.kv_role == "prefill" and not (self.kv_offload_bytes > 0 or self.kv_cache_dir is not None):
            raise ValueError(
                "kv_role='prefill' hands its blocks over from its host or disk tier: set kv_offload_bytes "
                "(or kv_cache_dir)"
            )
        if self.world_size > 1:
            raise ValueError(f"kv_role={self.kv_role!r}: run on one rank (tensor_parallel_size=1)")
        if self.enable_lora:
            raise ValueError(
                f"kv_role={self.kv_role!r} with enable_lora=True is refused: turn one of them off"
            )

    def validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def positive_int(name: str) -> None:
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, "an integer >= 1"
            )

        for name in (
            "block_size",
            "tensor_parallel_size",
            "data_parallel_size",
            "data_parallel_replicas",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_graph_batch_size",
            "max_logprobs",
        ):
            positive_int(name)
        for name in ("max_model_len", "kv_cache_memory_bytes", "num_cache_blocks"):
            if getattr(self, name) is not None:
                positive_int(name)
        frac = self.cache_memory_fraction
        need(isinstance(frac, float | int) and 0 < frac <= 1, "cache_memory_fraction", "in (0, 1]")
        need(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "a bool")
        need(isinstance(self.ced_prefill, bool), "ced_prefill", "a bool")
        need(isinstance(self.batch_invariant, bool), "batch_invariant", "a bool")
        need(isinstance(self.enable_return_routed_experts, bool), "enable_return_routed_experts", "a bool")
        if self.enable_return_routed_experts and self.ced_prefill:
            raise ValueError(
                "enable_return_routed_experts=True with ced_prefill=True is refused: its prefill passes "
                "record no routing; set ced_prefill=False"
            )
        self._validate_lora(positive_int)
        self._validate_tiers()
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        check_feature_modes(self)
        if self.batch_invariant:
            for name in (
                "compile",
                "capture_graphs",
                "async_scheduling",
                "ced_prefill",
            ):
                if getattr(self, name):
                    raise ValueError(f"batch_invariant=True runs eager synchronous steps: turn {name} off")
            if self.world_size > 1:
                raise ValueError(
                    "batch_invariant=True runs on one rank (tensor/data parallel sum across ranks)"
                )
            if self.max_num_batched_tokens < 32:
                raise ValueError(
                    "batch_invariant=True cuts prefills on a grid of up to 32 positions: "
                    f"max_num_batched_tokens must be >= 32, got {self.max_num_batched_tokens}"
                )
        need(isinstance(self.bounded_window_cache, bool), "bounded_window_cache", "a bool")
        need(isinstance(self.tune_cpu_malloc, bool), "tune_cpu_malloc", "a bool")
        need(isinstance(self.cpu_huge_pages, bool), "cpu_huge_pages", "a bool")
        need(isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel", "a bool")
        need(isinstance(self.enable_eplb, bool), "enable_eplb", "a bool")
        for name in ("eplb_window_size", "eplb_step_interval"):
            positive_int(name)
        need(
            isinstance(self.num_redundant_experts, int) and self.num_redundant_experts >= 0,
            "num_redundant_experts",
            "an integer >= 0",
        )
        if self.data_parallel_size > 1 and self.tensor_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1 with tensor_parallel_size > 1 is refused: "
                "use one of them (data-parallel attention runs whole attention per rank)"
            )
        if self.data_parallel_replicas > 1:
            if self.device != "cpu":
                raise ValueError(
                    f"data_parallel_replicas > 1 splits the CPU's threads; device={self.device!r} "
                    "has no replicas (they split one CPU's threads)"
                )
            if self.world_size > 1:
                raise ValueError(
                    "data_parallel_replicas > 1 with tensor_parallel_size or data_parallel_size > 1 "
                    "is refused: use one of them"
                )
        if self.enable_eplb and not (self.enable_expert_parallel and self.world_size > 1):
            raise ValueError(
                "enable_eplb needs enable_expert_parallel=True and tensor_parallel_size or "
                "data_parallel_size > 1"
            )
        if self.enable_eplb and self.async_scheduling:
            raise ValueError("enable_eplb moves experts between steps: it needs async_scheduling off")
        if self.num_redundant_experts % self.world_size:
            raise ValueError(
                f"num_redundant_experts={self.num_redundant_experts} must be a multiple of "
                f"the {self.world_size} ranks"
            )
        need(
            isinstance(self.compile_backend, str) and bool(self.compile_backend), "compile_backend", "a name"
        )
        need(
            self.cpu_compile_after_s is None
            or (
                isinstance(self.cpu_compile_after_s, int | float)
                and not isinstance(self.cpu_compile_after_s, bool)
                and self.cpu_compile_after_s >= 0
            ),
            "cpu_compile_after_s",
            "None or a number of seconds >= 0",
        )
        need(
            self.compile_cache_dir is None or isinstance(self.compile_cache_dir, str | Path),
            "compile_cache_dir",
            "None or a directory path",
        )
        if self.ced_prefill and self.enable_prefix_caching:
            raise ValueError(
                "ced_prefill=True needs enable_prefix_caching=False: a cached prefix holds no decoder "
                "window for positions its own prompt never replayed"
            )
        need(
            self.quantization in QUANTIZATIONS,
            "quantization",
            f"one of {', '.join(repr(q) for q in QUANTIZATIONS)}",
        )
        need(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"one of {', '.join(repr(k) for k in KV_CACHE_DTYPES)}",
        )
        if self.quantization in ("int8", "int4", "bf16") and self.device != "cpu":
            raise ValueError(
                f"quantization={self.quantization!r} runs on the CPU only, got device={self.device!r}"
            )
        for name in ("async_scheduling", "fake_quant", "compile", "capture_graphs"):
            need(getattr(self, name) in (None, True, False), name, "None (auto) or a bool")
        for option in ("tensor_parallel_size", "data_parallel_size"):
            if getattr(self, option) == 1:
                continue
            for name in ("compile", "capture_graphs"):
                if getattr(self, name):
                    raise ValueError(f"{option} > 1 runs eager steps: set {name}=False")
            if self.quantization in ("int8", "int4", "bf16"):
                raise ValueError(f"{option} > 1 with quantization={self.quantization!r} is not supported")
