"""Speculative decoding (issue 7, in progress): drafters that guess the next tokens, the
verification that keeps the output distribution exactly the target model's
(``deepinfer.sampling.rejection``) and the schedulers that choose how many drafts to verify.

Built: ``SpeculativeConfig`` (``config.py``), the n-gram prompt-lookup drafter (``ngram.py``)
wired into the engine for models whose cache rolls back by position (Llama family;
``engine/spec_decode.py``), and Algorithm 1 / lagged top-K / threshold schedulers
(``schedule.py``, not yet driven by a confidence head). Not yet: the DSpark and MTP drafters,
rollback of V4/V4.1 compressor and Engram state, the profiled steps-per-second table.
"""
