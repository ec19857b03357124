"""C++ CPU kernels (import name ``deepinfer.kernels.cpu``), for small decode steps and the
compiled CPU step's ops. Each module binds the kernel of the ``.cpp`` file of its name beside
it (``fp8.h`` is shared), built once per machine on first use by ``build`` with Inductor's
compiler driver; where no compiler works, ``available()`` / ``supports()`` say so and callers
keep PyTorch's kernels.

| module | what |
|---|---|
| ``packed_gemm`` | fp32, bf16 and int8 projections on a packed copy at any row count |
| ``gemv`` | an int4 loop at a few rows, for CPUs without VNNI or AVX2 |
| ``int4_vnni`` | int4 x int8 on AVX-512 VNNI or AVX2 |
| ``attention`` | decode attention reading the paged K/V pools in place (behind ``paged_attention``) |
| ``prefill_attention`` | causal prefill spans over the paged K/V pools |
| ``rope_store`` | Llama RoPE plus the K/V cache writes in one call |
| ``norm_act`` | RMSNorm with its residual add, SwiGLU |
| ``decode_stack`` | a whole Llama layer stack's decode step in one call to the kernels above |
| ``moe`` | routed experts at decode sizes and for small experts |
| ``fp8`` | fp8 K/V pool rows (``fp8.h``) |
| ``linear_op`` | ``deepinfer::packed_linear``, a dispatcher op over ``packed_gemm`` for compiled steps |
| ``step_ops`` | the compiled step's experts, Sinkhorn, RoPE, indexer and attention rows as dispatcher ops |

Modules are imported one by one (``from deepinfer.kernels.cpu import norm_act``); importing
the package imports none of them.
"""
