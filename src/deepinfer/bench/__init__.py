"""What ``deepinfer bench`` and ``benchmarks/`` run: the workloads and the ``transformers`` peer
measured beside the engine (``workloads``), a load generator for OpenAI-compatible servers
(``serve``) and llama.cpp's ``llama-batched-bench`` shape (``llama_cpp``). Nothing here asserts
a speed; the figures are recorded in ``benchmarks/RESULTS.md``."""
