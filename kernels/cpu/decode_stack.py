"""A whole Llama decoder stack's decode step in one call on the CPU.

With every piece of a small decode step in C++ (``gemv``, ``attention``,
``rope_store``, ``norm_act``), what remained outside the weight reads was Python: about
nine kernel calls per layer, each building tensors and marshalling pointers, a sizeable share of a
SmolLM2 step at batch 1 (benchmarks/RESULTS.md). This driver runs the layer loop in C++
and calls the very same kernel entry points, through their addresses, in the same order with
the same arguments, so its results are bitwise those of the per-layer path (tested); Python
calls it once per step.

Per layer: RMSNorm, fused q/k/v projection, RoPE + cache writes, decode attention over the
paged pools, output projection, residual add + RMSNorm, fused gate/up projection, SwiGLU, down
projection, residual add; a step's prefill spans (short prompts) attend through
``prefill_attention`` beside the decode rows. fp32 activations; fp32 and int8 weights run
the packed copies ``PackedLinear`` / ``WeightOnlyLinear`` run, through ``packed_gemm``, at
up to ``MAX_ROWS`` (64) rows (at 32 rows the layer path's Python still cost a visible share
of a SmolLM2 step); int4 through ``int4_vnni`` up to 64 rows, or ``gemv``'s widening
loop up to 4;
fp32, bf16, fp16 or fp8 pools.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch
from deepinfer.kernels import weight_only
from deepinfer.kernels.cpu import (
    attention,
    build,
    fp8,
    gemv,
    int4_vnni,
    norm_act,
    packed_gemm,
    prefill_attention,
    rope_store,
)
from deepinfer.kernels.cpu import lora as cpu_lora

_ARGS = (
    [ctypes.c_void_p] * 2
    + [ctypes.c_int64]
    + [ctypes.c_void_p] * 8
    + [ctypes.c_int64] * 8
    + [ctypes.c_float] * 2
    + [ctypes.c_void_p] * 3
    + [ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
)


class StepLora(ctypes.Structure):
    """The driver's ``Lora``: a step's served-adapter terms (``LoraTerms.struct``)."""

    _fields_ = [
        ("table", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("group_slot", ctypes.c_void_p),
        ("group_start", ctypes.c_void_p),
        ("groups", ctypes.c_int64),
        ("sgmv", ctypes.c_void_p),
    ]


LORA_FIELDS = 6  # per projection: A, rank, linears, B pointers, output widths, total width
# rows up to which int4 projections run in the stack's widening loop (CPUs without VNNI): above,
# PyTorch's kernel (bf16 activations) beats it (RESULTS.md)
QUANTIZED_MAX_ROWS = weight_only.QUANTIZED_SMALL_ROWS
VNNI_PACKED = 1  # the driver's marker (its offset slot) for an int4 weight packed for VNNI
F32_PACKED = 2  # the marker for an fp32 weight whose ``packed_gemm`` copy sits in the scale slot
I8_PACKED = 3  # the marker for int8 weights in ``packed_gemm``'s layout (3-D), scale as usual
# rows up to which packed fp32 / int8 and VNNI int4 steps run in the stack: those kernels take
# any row count, the per-layer path runs the stack's norm kernels up to here
MAX_ROWS = norm_act.MAX_ROWS


@functools.cache
def library() -> ctypes.CDLL | None:
    parts = (
        gemv.library(),
        norm_act.library(),
        rope_store.library(),
        attention.library(),
        packed_gemm.library(),
        prefill_attention.library(),
        cpu_lora.library(),
    )
    if any(p is None for p in parts):
        return None
    lib = build.load(build.source("decode_stack.cpp"))
    if lib is not None:
        build.bind(lib, "llama_decode_stack", _ARGS)
    return lib


def available() -> bool:
    return library() is not None


def _address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


@functools.cache
def _functions(pool_dtype: torch.dtype) -> torch.Tensor:
    """The kernels' entry points for pools of ``pool_dtype``, in the driver's order."""
    p = fp8.POOL_NAMES[pool_dtype]
    addresses = [
        _address(gemv.library(), "gemv_i4"),
        _address(norm_act.library(), "add_rms_norm_f32"),
        _address(norm_act.library(), "silu_mul_f32"),
        _address(rope_store.library(), f"rope_store_f32_{p}"),
        _address(attention.library(), attention.ENTRY[pool_dtype]),
        _address(int4_vnni.library(), "gemm_i4_i8") if int4_vnni.available() else 0,
        _address(packed_gemm.library(), "packed_gemm_f32"),
        _address(packed_gemm.library(), "packed_gemm_i8"),
        _address(prefill_attention.library(), prefill_attention.ENTRY[pool_dtype]),
    ]
    return torch.tensor(addresses, dtype=torch.int64)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# weight, bias, scale (int8 per row, int4 per group), offset (int4 per group)
Projection = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class LlamaDecodeStack:
    """The stack's weights as the driver's table; pools are filled in per step (cached while
    they stay the same tensors). Holds references to every tensor whose address it keeps."""

    def __init__(
        self,
        layers: list[dict[str, torch.Tensor | Projection]],
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
    ) -> None:
        """``layers``: per layer ``norm1``, ``norm2`` (fp32 weights) and ``qkv``, ``o``,
        ``gate_up``, ``down`` as (weight, bias, scale, offset): fp32 weights with ``packed``,
        each projection's ``packed_gemm`` copy (``PackedLinear.packed``); int8 ones packed
        for ``packed_gemm`` ([tiles, in, T]) with their fp16 group scales (``packed_gemm.pack_scales``); or packed int4
        ones (uint8) with their fp32 per-group scale and offset (``gemv.small_gemm_int4``'s
        layout), optionally with ``vnni``: each int4 projection's copy packed for
        ``int4_vnni``, which then runs every step. Raises ValueError for anything else."""
        kinds = {torch.float32: (False, False), torch.int8: (True, False), torch.uint8: (True, True)}
        self.tensors: list[list[torch.Tensor | None]] = []
        quantized = False
        for layer in layers:
            row: list[torch.Tensor | None] = [layer["norm1"]]  # type: ignore[list-item]
            for name in _PROJECTIONS:
                weight, bias, scale, offset = layer[name]  # type: ignore[misc]
                if kinds.get(weight.dtype) != (scale is not None, offset is not None):
                    raise ValueError(
                        f"LlamaDecodeStack: {name} must be fp32, int8 + scale or int4 + scale, offset"
                    )
                quantized |= scale is not None
                row += [weight, bias, scale, offset]
            row.append(layer["norm2"])  # type: ignore[arg-type]
            self.tensors.append(row)
        for row in self.tensors:
            for t in row:
                if t is not None and (
                    t.dtype not in (*kinds, torch.float16) or not t.is_contiguous() or t.device.type != "cpu"
                ):
                    raise ValueError(
                        "LlamaDecodeStack needs contiguous fp32 / int8 / uint8 CPU tensors (fp16: int8 scales)"
                    )
        self.weights = torch.tensor([[_ptr(t) for t in row] for row in self.tensors], dtype=torch.int64)
        self.weights_vnni = self._vnni_table(layers) if quantized else None
        packed_int8 = self._mark_packed_int8()
        if not quantized and not self._add_packed_copies(layers):
            raise ValueError("LlamaDecodeStack: fp32 projections need their packed_gemm copies")
        widening = quantized and not packed_int8 and self.weights_vnni is None
        self.max_rows = QUANTIZED_MAX_ROWS if widening else MAX_ROWS
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.intermediate, self.eps = intermediate, eps
        self.hidden = self.tensors[0][0].shape[0]
        self._pools: tuple[int, ...] = ()
        self._tables: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def _mark_packed_int8(self) -> bool:
        """Mark the int8 weights, which must come in ``packed_gemm``'s layout (3-D: [tiles,
        K, T]); the driver runs them at every row count as ``WeightOnlyLinear`` does. False
        where there are none."""
        found = False
        for r, row in enumerate(self.tensors):
            for j in range(len(_PROJECTIONS)):
                weight = row[1 + 4 * j]
                assert weight is not None
                if weight.dtype != torch.int8:
                    continue
                if weight.dim() != 3 or weight.shape[2] != packed_gemm.width():
                    raise ValueError("LlamaDecodeStack: int8 weights must be packed for packed_gemm")
                self.weights[r, 1 + 4 * j + 3] = I8_PACKED
                found = True
        return found

    def _add_packed_copies(self, layers: list[dict]) -> bool:
        """Point the fp32 table's projections at their packed copies (``packed``: each
        ``PackedLinear.packed`` in ``packed_gemm``'s layout), which the driver runs at every
        row count as ``PackedLinear`` does. False (table unchanged) unless every projection has
        such a copy."""
        copies = [[layer.get("packed", {}).get(name) for name in _PROJECTIONS] for layer in layers]
        for row, tensors in zip(copies, self.tensors, strict=True):
            for j, copy in enumerate(row):
                weight = tensors[1 + 4 * j]
                if copy is None or copy.is_mkldnn or copy.dtype != torch.float32 or not copy.is_contiguous():
                    return False
                if copy.dim() != 3 or copy.shape[1:] != (weight.shape[1], packed_gemm.width()):
                    return False
        for r, row in enumerate(copies):
            for j, copy in enumerate(row):
                self.weights[r, 1 + 4 * j + 2] = copy.data_ptr()
                self.weights[r, 1 + 4 * j + 3] = F32_PACKED
        self.packed_tensors = copies  # the table holds their addresses
        return True

    def _vnni_table(self, layers: list[dict]) -> torch.Tensor | None:
        """The weight table with every projection swapped for its VNNI-packed int4 copy (None
        unless each projection is int4 with such a copy and the kernel built)."""
        if not int4_vnni.available():
            return None
        rows, keep = [], []
        for layer, row in zip(layers, self.tensors, strict=True):
            packed = layer.get("vnni") or {}
            out = [_ptr(row[0])]
            for name in _PROJECTIONS:
                weight, bias, _, offset = layer[name]
                copy = packed.get(name)
                if copy is None or offset is None or bias is not None:
                    return None
                out += [_ptr(copy), 0, 0, VNNI_PACKED]
                keep.append(copy)
            rows.append(out + [_ptr(row[-1])])
        self.vnni_tensors = keep  # the table holds their addresses
        return torch.tensor(rows, dtype=torch.int64)

    def supports(
        self, h: torch.Tensor, pools: list[tuple[torch.Tensor, torch.Tensor]], spans: bool = False
    ) -> bool:
        """A decode-sized fp32 activation and pools the kernels read (with prefill ``spans``:
        pools and a head size ``prefill_attention`` takes, as the layer path would run)."""
        decode = h.dtype == torch.float32 and h.dim() == 2 and 0 < h.shape[0] <= self.max_rows
        if not decode or h.requires_grad or self._table_for(pools) is None:
            return False
        if spans:
            q = h.new_empty(0, self.heads, self.head_dim)
            return prefill_attention.supports(q, pools[0][0], pools[0][1])
        return True

    def _table_for(
        self, pools: list[tuple[torch.Tensor, torch.Tensor]], vnni: bool = False
    ) -> torch.Tensor | None:
        """The driver's table for these pools (None: pools the kernels cannot read), with the
        VNNI-packed int4 weights when ``vnni``; checked and built again only when the pools
        change."""
        key = tuple(p.data_ptr() for kv in pools for p in kv)
        if key != self._pools:
            dtype = pools[0][0].dtype
            readable = fp8.reads_heads(dtype, self.head_dim) and all(
                t.dtype == dtype and t.is_contiguous() for kv in pools for t in kv
            )
            addresses = torch.tensor(key, dtype=torch.int64).view(-1, 2)

            def table(weights: torch.Tensor | None) -> torch.Tensor | None:
                if weights is None or not readable:
                    return None
                return torch.cat([weights, addresses], dim=1).contiguous()

            self._tables = (table(self.weights), table(self.weights_vnni))
            self._pools = key
        return self._tables[1 if vnni else 0]

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        write_rows: torch.Tensor,
        decode_rows: torch.Tensor,
        decode_kv: torch.Tensor,
        decode_valid: torch.Tensor,
        pools: list[tuple[torch.Tensor, torch.Tensor]],
        span_meta: torch.Tensor | None = None,
        span_kv_rows: torch.Tensor | None = None,
        layers: tuple[int, int] | None = None,
        lora: LoraTerms | None = None,
    ) -> torch.Tensor:
        """Run every layer (``layers``: those in ``[first, end)``) on ``h`` [M, D] (updated in
        place and returned); ``cos``/``sin``
        [M, head_dim / 2], ``write_rows`` [M] pool rows, the decode metadata of the step, and
        its prefill spans as ``paged_attention_reference`` takes them (None: none; spans of 0
        tokens are skipped); ``lora``: the step's served-adapter terms, added after each
        projection as the layer loop adds them."""
        lib = library()
        assert lib is not None
        m, d = h.shape
        a, i = self.heads * self.head_dim, self.intermediate
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        work = torch.empty(m * (d + qkv + a + d + d + 2 * i + i + d) + (m + 1) * a, dtype=torch.float32)
        c = cos.reshape(m, -1).float().contiguous()
        s = sin.reshape(m, -1).float().contiguous()
        rows, kv, valid = write_rows.contiguous(), decode_kv.contiguous(), decode_valid.contiguous()
        dec = decode_rows.contiguous()
        spans = (torch.zeros(0, 4) if span_meta is None else span_meta).to(torch.int64).contiguous()
        span_rows = (torch.zeros(1) if span_kv_rows is None else span_kv_rows).to(torch.int64).contiguous()
        vnni = self.weights_vnni is not None  # every row count, as WeightOnlyLinear runs it
        table = self._table_for(pools, vnni)
        assert table is not None, "pools the kernels cannot read (check supports() first)"
        first, end = layers if layers is not None else (0, len(self.tensors))
        table = table[first:end]  # rows of the table are layers; a slice is a view
        widest = max(d, a, i)  # int4_vnni's int8 activations and their per-group scales
        scratch = torch.empty(m * widest + 8 * m * (widest // 32), dtype=torch.uint8) if vnni else None
        lib.llama_decode_stack(
            _functions(pools[0][0].dtype).data_ptr(),
            table.data_ptr(),
            end - first,
            h.data_ptr(),
            work.data_ptr(),
            c.data_ptr(),
            s.data_ptr(),
            rows.data_ptr(),
            dec.data_ptr(),
            kv.data_ptr(),
            valid.data_ptr(),
            m,
            d,
            self.heads,
            self.kv_heads,
            self.head_dim,
            i,
            kv.shape[0],
            kv.shape[1],
            self.eps,
            1.0 / math.sqrt(self.head_dim),
            None if scratch is None else scratch.data_ptr(),
            spans.data_ptr(),
            span_rows.data_ptr(),
            spans.shape[0],
            torch.get_num_threads(),
            None if lora is None else ctypes.byref(lora.struct(first, end)),
        )
        return h


class LoraTerms:
    """A step's served-adapter terms as the driver reads them: per layer and projection
    (qkv, o, gate_up, down) the slot stack's addresses, zero where no adapter of the step
    touches it, and the step's adapter rows grouped by slot (``LoraStep``'s CPU form)."""

    def __init__(
        self,
        stacks: list[list[object | None]],
        active: frozenset[int],
        order: torch.Tensor,
        group_slots: torch.Tensor,
        group_starts: torch.Tensor,
    ) -> None:
        """``stacks``: per layer the four projections' ``LinearStack`` (None: no slots)."""
        none = [0] * LORA_FIELDS
        rows = [
            [
                field
                for stack in layer
                for field in (
                    stack.matrices.driver_fields  # type: ignore[attr-defined]
                    if stack is not None and stack.filled & active  # type: ignore[attr-defined]
                    else none
                )
            ]
            for layer in stacks
        ]
        self.table = torch.tensor(rows, dtype=torch.int64)
        self.order, self.group_slots, self.group_starts = order, group_slots, group_starts
        self.any = bool(self.table[:, 0::LORA_FIELDS].any())

    def struct(self, first: int, end: int) -> StepLora:
        """The driver's view of layers ``[first, end)`` (the table's rows are layers)."""
        self._rows = self.table[first:end].contiguous()
        return StepLora(
            self._rows.data_ptr(),
            self.order.data_ptr(),
            self.group_slots.data_ptr(),
            self.group_starts.data_ptr(),
            self.group_slots.shape[0],
            cpu_lora.sgmv_address(),
        )
