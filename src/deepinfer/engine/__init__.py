"""Request execution: the block pools and prefix cache, the scheduler, the model runner, the
executor and the engine's step loop, driven by ``EngineDriver`` (``driver.py``); and the
bytes the weights and the KV cache take (``memory``: ``deepinfer plan``, ``LLM.memory_report``).

One step's data, from the scheduler's decision to the tokens (each stage reads only what
the stage before it handed over, never a live request's tables):

``Request`` (``request.py``)
    a request's whole life: its tokens, sampling parameters, blocks, slot and status.
``ScheduledChunk`` (``scheduler.py``)
    the scheduler's decision for one request in one step, frozen: the token range to
    compute, the drafts to verify, and the block tables, slot and rank as they were then.
``SeqChunk`` (``cache/step_chunks.py``)
    the runner's view of a scheduled chunk: token range, block ids, slot and which rows
    return logits (and draft features); what a tensor-parallel worker receives too.
``PreparedStep`` (``model_runner.py``)
    the step's tensors: positions and the ``ForwardBatch`` (``cache/forward_batch.py``:
    every index tensor, the cache views, the batch-invariant switch and the routing
    record), the logits rows each chunk samples from, and the captured-graph bucket.
``StepOutput`` (``executor.py``)
    what the forward returns: logits rows, the drafter's features and the forward's time.
``StepProcessor.process`` (``step_processor.py``)
    tokens from logits (sampling, verification of drafts into ``VerifiedChunk``s,
    ``speculative/decoder.py``), stop checks, prefix-cache publishing, then the
    ``RequestOutput`` (``output_processor.py``) a caller reads.

The speculative package reads chunks through its own protocols (``speculative.decoder.Chunk``,
``speculative.rollback.RollbackChunk``), which ``ScheduledChunk`` satisfies.
"""
