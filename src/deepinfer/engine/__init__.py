"""Request execution: block pool and prefix cache, scheduler, paged cache layout, model
runner and the engine step loop (docs/architecture.md, 'The flow of one engine step'), and the
bytes the weights and the KV cache take (``memory``: ``deepinfer plan``, ``LLM.memory_report``)."""
