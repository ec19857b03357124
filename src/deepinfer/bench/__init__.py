"""What ``deepinfer bench`` and ``benchmarks/`` run: each subcommand's body (``commands``, its
flags in ``deepinfer.cli.bench``), the workloads and the ``transformers`` peer measured beside
the engine (``workloads``), a load generator for OpenAI-compatible servers (``serve``),
llama.cpp's ``llama-batched-bench`` shape (``llama_cpp``), one cold start for ``bench startup``
(``startup_worker``) and the latency plot (``plot``). Nothing here asserts a speed; the figures
are recorded in ``benchmarks/RESULTS.md``."""
