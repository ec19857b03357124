"""The engine's CPU projections: weight-only int8/int4/bf16 and packed float linears.

Decode at small batch reads every weight once per step, so fewer weight bytes is speed.
fp32, int8 and bf16 weights run ``cpu_packed_gemm`` on a copy packed once, at every row count
(int8 and bf16 widened to fp32 in registers: fp32 activations and sums, batch-invariant); where
that kernel did not build (no compiler), they multiply by the dequantized weight (slow:
PyTorch's int8 kernel takes one scale per output).

int8: symmetric, an fp16 scale per 32 inputs of an output (llama.cpp's Q8_0 blocks; on SmolLM2
per-output scales lost several times more, benchmarks/RESULTS.md). bf16: the weights rounded to
bf16, activations kept in fp32 (what llama.cpp computes for a BF16 file; ``dtype="bfloat16"``
rounds the activations too). int4: asymmetric per group of ``group`` input channels (the
kernel's ``(q - 8) * scale + zero`` form). On CPUs with AVX-512 VNNI or AVX2, int4 runs
``cpu_int4_vnni`` at every row count (activations rounded to int8 per group, as llama.cpp's
Q4_0 path does; its layout reads 0.625 bytes per weight, so a memory-bound B=1 step is faster
than with the widening loop's 0.75, benchmarks/RESULTS.md), and int4 results are then the
same whatever the batch size. Elsewhere int4 runs ``cpu_gemv``'s widening loop up to
``QUANTIZED_SMALL_ROWS`` rows (a second copy in that loop's layout) and PyTorch's kernel above,
so those results are not batch-invariant across that row count.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import weakref

import torch
import torch.nn.functional as F
from deepinfer.kernels import huge_pages
from deepinfer.kernels.cpu import gemv as cpu_gemv
from deepinfer.kernels.cpu import int4_vnni as cpu_int4_vnni
from deepinfer.kernels.cpu import packed_gemm as cpu_packed_gemm

INT4_GROUP = 32
INT8_GROUP = cpu_packed_gemm.GROUP  # inputs per int8 scale: the kernel's
# int4 rows up to which ``cpu_gemv``'s loop runs on CPUs without VNNI or AVX2 (PyTorch's kernel above)
QUANTIZED_SMALL_ROWS = 4
_INNER_K_TILES = 2
_INT4_ROWS = 16  # the int4 packing takes output rows in multiples of 16 (zero rows pad)


class WeightOnlyLinear:
    """``x @ W.T + b`` with ``W`` stored as int8, packed int4 or bf16 (not an ``nn.Module``: the
    engine's copy beside the model's float parameters, which research code keeps using)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        method: str,
        arena: huge_pages.HugePageArena | None = None,
    ) -> None:
        """``arena``: where the packed copies go (huge pages; None: ordinary memory)."""
        if method not in ("int8", "int4", "bf16"):
            raise ValueError(f"quantization must be 'int8', 'int4' or 'bf16', got {method!r}")
        w = weight.detach().float()
        self.method = method
        self.packed_vnni: torch.Tensor | None = None  # int4 x int8 on AVX-512 VNNI or AVX2 (below)
        self.packed8: torch.Tensor | None = None  # int8 or bf16 in ``cpu_packed_gemm``'s layout
        self.packed_scales: torch.Tensor | None = None  # its fp16 group scales, packed alike
        self.out_features, self.in_features = w.shape
        self.bias = None if bias is None else bias.detach().clone()
        if method == "bf16":  # rounded to nearest even; no scales
            self.qweight = w.bfloat16()
            self.scales = torch.empty(0)
            if cpu_packed_gemm.available():
                self.packed8, self.qweight = huge_pages.adopt(cpu_packed_gemm.pack(self.qweight), arena), None
        elif method == "int8":
            # symmetric, one scale per 32 inputs of an output (Q8_0's blocks; a last block may
            # be shorter), kept in fp16 as Q8_0 does: [out, ceil(in / 32)] fp32 values
            pad = -self.in_features % INT8_GROUP
            groups = F.pad(w, (0, pad)).view(self.out_features, -1, INT8_GROUP)
            fp16_max = torch.finfo(torch.float16).max  # larger weights saturate, never inf
            scale = (groups.abs().amax(dim=-1) / 127.0).clamp(max=fp16_max).half().float()
            q8 = torch.where(scale[..., None] > 0, groups / scale[..., None], 0.0).round().clamp(-127, 127)
            q8 = q8.view(self.out_features, -1)[:, : self.in_features].to(torch.int8)
            self.scales = scale
            # where the C++ kernels build, only the packed copy: fp32 activations at every row
            # count, and faster than the widening loop and PyTorch's bf16 kernel (RESULTS.md)
            self.qweight = q8
            if cpu_packed_gemm.available():
                self.packed8, self.qweight = huge_pages.adopt(cpu_packed_gemm.pack(q8), arena), None
                self.packed_scales = cpu_packed_gemm.pack_scales(scale)
        else:
            if self.in_features % INT4_GROUP:
                raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {self.in_features}")
            pad = -self.out_features % _INT4_ROWS
            if pad:
                w = torch.cat([w, w.new_zeros(pad, self.in_features)])
            groups = w.reshape(w.shape[0], -1, INT4_GROUP)
            low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
            scale = (high - low).clamp(min=1e-12) / 15.0
            q = ((groups - low) / scale).round().clamp(0, 15)
            zero = low + 8.0 * scale  # the kernel computes (q - 8) * scale + zero
            q4 = q.to(torch.int32).reshape(w.shape[0], self.in_features)
            self.qweight = torch._convert_weight_to_int4pack_for_cpu(q4, _INNER_K_TILES)
            # scale and zero in fp16 (Q4_1 stores its scale and minimum so: bf16's 8-bit
            # mantissa would move every weight of a group by a share of its step), kept as
            # the fp32 values every kernel computes with: [groups, out, 2], PyTorch's int4 form
            sz = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).half().float()  # [out, groups, 2]
            self.scales = sz.transpose(0, 1).contiguous()
            # ``cpu_gemv``'s layout of the same values for decode sizes: byte j of a group holds
            # q[j] and q[j + 16]; w = q * s + c with the same scale and zero
            rows = self.out_features
            g = q[:rows].to(torch.uint8)
            self.packed4 = (g[..., :16] | (g[..., 16:] << 4)).reshape(rows, -1).contiguous()
            sz_used = sz[:rows]
            self.scale4 = sz_used[..., 0].contiguous()
            self.offset4 = (sz_used[..., 1] - 8.0 * sz_used[..., 0]).contiguous()
            # int8 activations on AVX-512 VNNI or AVX2 where the CPU has either (a third copy
            # of the int4 values, in that kernel's layout)
            if cpu_int4_vnni.available():
                packed = cpu_int4_vnni.pack(q4[:rows], sz[:rows, :, 0], sz[:rows, :, 1])
                self.packed_vnni = huge_pages.adopt(packed, arena)

    def refresh(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Quantize new values of the same shape into this copy's own tensors, in place: the
        addresses the one-call decode stack and compiled steps hold stay valid."""
        fresh = WeightOnlyLinear(weight, bias, self.method)
        copy_tensors_into(self, fresh)

    @property
    def nbytes(self) -> int:
        """Bytes a step reads (weights and scales; int8 in ``cpu_packed_gemm``'s padded tiles
        where it built, else PyTorch's layout)."""
        q = self.qweight if self.packed8 is None else self.packed8
        assert q is not None
        scale_bytes = 2  # fp16, as the kernels store them
        return q.numel() * q.element_size() + self.scales.numel() * scale_bytes

    def int8_values(self) -> torch.Tensor:
        """int8 (or bf16) weights as [out, in] (from whichever copy is kept)."""
        if self.packed8 is not None:
            return cpu_packed_gemm.unpack(self.packed8, self.out_features)
        assert self.qweight is not None
        return self.qweight

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight the kernels compute with (for error reports and tests)."""
        if self.method == "bf16":
            return self.int8_values().float()
        if self.method == "int8":
            scales = self.scales.repeat_interleave(INT8_GROUP, dim=1)[:, : self.in_features]
            return self.int8_values().float() * scales
        eye = torch.eye(self.in_features)  # the kernel applied to each e_i, in fp32 (exact)
        cols = torch._weight_int4pack_mm_for_cpu(eye, self.qweight, INT4_GROUP, self.scales)
        return cols.float().T[: self.out_features]

    def _widening(self, flat: torch.Tensor) -> torch.Tensor | None:
        """fp32 ``flat @ W.T``: int8 on the packed kernel at any size (without it, through the
        dequantized weight: PyTorch's int8 kernel has no group scales); int4 on CPUs without
        VNNI or AVX2 through ``cpu_gemv``'s widening loop (what the one-call decode stack runs
        too) at decode sizes; None where PyTorch's kernels take over."""
        small = flat.shape[0] <= QUANTIZED_SMALL_ROWS
        if self.packed8 is not None:
            return cpu_packed_gemm.gemm(flat, self.packed8, self.out_features, None, self.packed_scales)
        if self.method in ("int8", "bf16"):
            return flat.float() @ self.dequantize().T
        if self.method == "int4" and small and cpu_gemv.available() and self.packed_vnni is None:
            return cpu_gemv.small_gemm_int4(flat, self.packed4, self.scale4, self.offset4)
        return None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        y = self._widening(flat) if flat.device.type == "cpu" else None
        if y is None and self.packed_vnni is not None and flat.device.type == "cpu":  # int4 only
            y = cpu_int4_vnni.gemm(flat, self.packed_vnni, self.out_features)
        if y is not None:
            y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        # int4 (int8 always widens): fp32, the fp16 scales and zeros exactly
        y = torch._weight_int4pack_mm_for_cpu(flat.float(), self.qweight, INT4_GROUP, self.scales)
        y = y[:, : self.out_features]
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)


# bf16 steps of at most this many rows run ``cpu_packed_gemm`` on a second packed copy (bf16
# widened exactly, fp32 sums) instead of oneDNN: on a CPU with AMX it beat oneDNN's AMX kernel
# on SmolLM2's bf16 projection stack up to 8 rows and lost from 12 (benchmarks/RESULTS.md,
# SmolLM2-135M in bf16)
BF16_PACKED_ROWS = 8


class PackedLinear:
    """``x @ W.T + b`` for the engine's CPU steps on a copy of ``W`` packed once: for fp32
    weights ``cpu_packed_gemm``'s layout (that kernel at every row count: faster than oneDNN's
    packed GEMM where measured, and a row's result the same at any batch size,
    benchmarks/RESULTS.md), for bf16 weights, or where the C++ kernels did not build, oneDNN's
    blocked layout (the kernel Inductor's CPU freezing uses; AMX where the CPU has it), plus
    for bf16 a ``cpu_packed_gemm`` copy for steps of at most ``BF16_PACKED_ROWS`` rows. Same
    precision as ``F.linear``, another summation order. Engine-only: the packed copies have no
    autograd and cost a second copy of the weights (bf16: a third) beside the parameters
    research code computes with."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        arena: huge_pages.HugePageArena | None = None,
    ) -> None:
        """``arena``: where the packed copies go (huge pages; None: ordinary memory)."""
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        fp32 = self.weight.dtype == torch.float32 and cpu_packed_gemm.supports(self.weight)
        if fp32:
            self.packed = huge_pages.adopt(cpu_packed_gemm.pack(self.weight), arena)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
        # bf16: a second packed copy for steps of few rows (see BF16_PACKED_ROWS)
        self.small = (
            huge_pages.adopt(cpu_packed_gemm.pack(self.weight), arena)
            if self.weight.dtype == torch.bfloat16 and cpu_packed_gemm.supports(self.weight)
            else None
        )
        _register_packed(self, self.weight, (self.packed, self.small))

    def refresh(self) -> None:
        """Pack the weight's current values again, in place where the copy is a plain tensor
        (its address, which the decode stack and the compiled op's registry hold, stays);
        oneDNN's opaque copy is rebuilt and registered again."""
        if self.packed.is_mkldnn:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
        else:
            self.packed.copy_(cpu_packed_gemm.pack(self.weight))
        if self.small is not None:
            self.small.copy_(cpu_packed_gemm.pack(self.weight))
        _PACKED[_packed_key(self.weight)] = (self.packed, self.small)

    @staticmethod
    def available(weight: torch.Tensor) -> bool:
        """Whether a packed copy can be built: fp32 everywhere oneDNN is, bf16 only where
        oneDNN's bf16 kernels run on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only
        CPU such as AMD Zen 3 has neither, and the bf16 projections stay on ``F.linear``)."""
        if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        if weight.dtype == torch.bfloat16:
            return _mkldnn_bf16()
        return weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():  # one op, the packed copy found at run time
            y = cpu_linear(flat, self.weight, self.bias)
        else:
            y = _packed_linear(flat, self.packed, self.small, self.out_features, self.bias).to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


def copy_tensors_into(target: object, fresh: object) -> None:
    """Copy every tensor attribute of ``fresh`` into ``target``'s tensor of the same name, in
    place (same shapes and dtypes: the same form built from new values)."""
    for name, value in vars(fresh).items():
        if isinstance(value, torch.Tensor):
            getattr(target, name).copy_(value)


@functools.cache
def _mkldnn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_bf16_kernel(rows: int = 32, width: int = 64) -> str | None:
    """The oneDNN implementation a bf16 ``PackedLinear`` of ``rows`` rows (more than
    ``BF16_PACKED_ROWS``; fewer run ``cpu_packed_gemm``) runs on this CPU
    (``brg_matmul:avx10_1_512_amx`` on a CPU with AMX, an ``avx512_core_bf16`` kernel without
    AMX), read from oneDNN's verbose log of one product; None where the bf16 path is not
    oneDNN's. Benchmarks print it: whether bf16 reached AMX is a fact about the run."""
    probe = torch.zeros(width, width, dtype=torch.bfloat16)
    if not PackedLinear.available(probe):
        return None
    layer = PackedLinear(probe, None)
    x = torch.zeros(rows, width, dtype=torch.bfloat16)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 1)  # oneDNN writes its log to the process's stdout
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                layer(x)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = log.read().splitlines()
    for line in lines:  # onednn_verbose,v1,primitive,exec,cpu,inner_product,<impl>,...
        fields = line.split(",")
        if "exec" in fields and "inner_product" in fields:
            return fields[fields.index("inner_product") + 1]
    return None


def _packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    small: torch.Tensor | None,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x @ W.T + b`` on ``W``'s packed copy, by the kernel its layout belongs to; bf16 steps of
    at most ``BF16_PACKED_ROWS`` rows on the ``cpu_packed_gemm`` copy ``small``."""
    if small is not None and x.shape[0] <= BF16_PACKED_ROWS:
        return cpu_packed_gemm.gemm(x, small, out_features, bias)
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return cpu_packed_gemm.gemm(x, packed, out_features, bias)


# Packed copies of live PackedLinear weights, for the compiled op (a traced graph cannot carry
# oneDNN's opaque tensors, and a packed copy is not a parameter of the traced module): keyed by
# the weight's address, shape and dtype, dropped when the owning PackedLinear, which keeps the
# weight alive, is collected.
_PACKED: dict[tuple[int, tuple[int, ...], torch.dtype], tuple[torch.Tensor, torch.Tensor | None]] = {}


def _packed_key(weight: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    return (weight.data_ptr(), tuple(weight.shape), weight.dtype)


def _register_packed(
    owner: object, weight: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor | None]
) -> None:
    key = _packed_key(weight)
    _PACKED[key] = packed
    weakref.finalize(owner, _PACKED.pop, key, None)


@torch.library.custom_op("deepinfer::cpu_linear", mutates_args=())
def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A ``PackedLinear`` inside a compiled step: ``x`` [M, K] by ``weight`` [N, K] on the
    weight's packed copy, as the eager class runs it, so one graph serves decode and prefill."""
    copies = _PACKED.get(_packed_key(weight))
    if copies is None:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    return _packed_linear(x, *copies, weight.shape[0], bias).to(x.dtype)


@cpu_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])
