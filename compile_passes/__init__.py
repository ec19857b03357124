"""FX passes for ``torch.compile`` (import name ``deepinfer.compile_passes``).

Empty until the compiler issue: passes that match the plain model's attention, MoE and
speculative-verification subgraphs and replace them with ``deepinfer.kernels`` custom ops.
"""
