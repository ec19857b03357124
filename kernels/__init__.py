"""Custom ops (import name ``deepinfer.kernels``), each registered with ``torch.library``: a
schema, a fake implementation for tracing, a PyTorch reference implementation that runs on
every device, and a faster implementation where one exists (CUDA kernels registered per
device type; Triton when installed). Importing the package registers every op.

| op | what | faster implementation |
|---|---|---|
| ``routed_experts`` | sorted dispatch, clamped SwiGLU experts, weighted combine | CUDA: sync-free ``_grouped_mm`` |
| ``fused_moe`` | gate scores + selection + weights + ``routed_experts`` | (via ``routed_experts``) |
| ``sink_attention`` | V4 attention core: K=V sets + sink, one softmax | CUDA: Triton |
| ``paged_attention`` | Llama: decode rows + causal prefill spans over paged K/V | |
| ``rejection_sample`` | speculative verification: acceptance + residual sampling | |
| ``sinkhorn`` | mHC doubly-stochastic projection | CPU: NumPy loop |
"""

from deepinfer.kernels import fused_moe, moe, paged_attention, rejection, sink_attention, sinkhorn

__all__ = ["fused_moe", "moe", "paged_attention", "rejection", "sink_attention", "sinkhorn"]
