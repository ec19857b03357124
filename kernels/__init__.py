"""Custom ops (import name ``deepinfer.kernels``), each registered with ``torch.library``: a
schema, a fake implementation for tracing, a PyTorch reference implementation that runs on
every device, and a faster implementation where one exists (CUDA kernels registered per
device type; Triton when installed).

Importing the package registers these seven:

| op | what | faster implementation |
|---|---|---|
| ``routed_experts`` | sorted dispatch, clamped SwiGLU experts, weighted combine | CUDA: sync-free ``_grouped_mm`` |
| ``fused_moe`` | gate scores + selection + weights + ``routed_experts`` | (via ``routed_experts``) |
| ``sink_attention`` | V4 attention core: K=V sets + sink, one softmax | CUDA: Triton |
| ``paged_attention`` | Llama: decode rows + causal prefill spans over paged K/V | (decode rows via the next) |
| ``paged_decode_attention`` | Llama: the decode rows of ``paged_attention`` | CUDA: Triton |
| ``rejection_sample`` | speculative verification: acceptance + residual sampling | |
| ``sinkhorn`` | mHC doubly-stochastic projection | CPU: C++ (NumPy without a compiler); CUDA: Triton |

The module that calls each of the others imports it, which registers it:

| op | module | what |
|---|---|---|
| ``sink_attention_rows`` | ``sink_attention_rows.py`` | the attention core row by row (CPU compiled steps) |
| ``indexer_topk`` | ``indexer_topk.py`` | the CSA indexer's scores and top-k |
| ``rope`` | ``rope.py`` | rotary embedding of the rope dimensions |
| ``interleaved_rope`` | ``interleaved_rope_triton.py`` | V4's RoPE, forwards or backwards (CUDA: Triton) |
| ``compress_groups`` | ``compressor_triton.py`` | a V4 compressor's state writes and pooling (CUDA: two Triton) |
| ``fake_quant`` | ``fake_quant_triton.py`` | QAT fake quantisation, per block scale and rounding (CUDA: Triton) |
| ``fp8_block_linear`` | ``quantized.py`` | a linear over fp8 weights with block scales (CUDA: Triton) |
| ``routed_experts_fp4`` | ``quantized.py`` | the routed experts over fp4 weights (CUDA: Triton) |
| ``cpu_linear`` | ``weight_only.py`` | the engine's CPU projections inside a compiled step (``cpu.packed_gemm``) |
| ``rms_norm``, ``add_rms_norm`` | ``rms_norm_triton.py`` | RMSNorm, and a residual add + RMSNorm (CUDA: Triton) |
| ``rope_store`` | ``rope_triton.py`` | Llama's RoPE on q and k + the K/V cache writes (CUDA: Triton) |
| ``silu_and_mul`` | ``silu_mul_triton.py`` | SwiGLU's ``silu(gate) * up`` (CUDA: Triton) |
| ``hc_pre`` | ``mhc_triton.py`` | an mHC site's mixes, Sinkhorn and collapse (CUDA: Triton) |
| ``hc_post`` | ``mhc_triton.py`` | the mHC expand back into the streams (CUDA: Triton) |
| ``moe_gate`` | ``moe_gate_triton.py`` | router scores, top-k or hash lookup, weights (CUDA: Triton) |

The C++ CPU kernels (``deepinfer.kernels.cpu``: packed projections, int4 GEMMs, paged
attention, RoPE with the cache writes, norms, a Llama decode stack, experts, and the compiled
step's dispatcher ops), built once per machine and called directly by eager steps or from the
ops above, are a subpackage of their own.
"""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def _hand_over_to_third_party(name: str, folder: Path) -> None:
    """Replace this module in ``sys.modules`` with what the import would give without it.

    This folder is importable as a top-level ``kernels`` only while the repository root is on
    ``sys.path`` (``python -m pytest`` or ``python -c`` started in the root). That name belongs
    to the third-party ``kernels`` package that transformers imports, so the import goes on as
    if this folder were no package: the third-party package where the rest of ``sys.path``
    has one, else an empty namespace package (what Python makes of a folder without
    ``__init__.py``, and what transformers' availability check reads as "not installed": no
    version, no ``__file__``).
    """
    root = folder.parent.resolve()
    rest = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec(name, rest)
    if spec is None or spec.loader is None:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = []  # nothing of ours is importable through it
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the import system returns what sys.modules holds after this body
    if spec.loader is None:
        return
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


if __name__ == "kernels":
    _hand_over_to_third_party(__name__, Path(__file__).parent)
else:
    from deepinfer.kernels import fused_moe, moe, paged_attention, rejection, sink_attention, sinkhorn

    __all__ = ["fused_moe", "moe", "paged_attention", "rejection", "sink_attention", "sinkhorn"]
