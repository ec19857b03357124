"""Speculative decoding (issue 7, in progress): drafters that guess the next tokens, the
verification that keeps the output distribution exactly the target model's
(``deepinfer.sampling.rejection``) and the schedulers that choose how many drafts to verify.

Built: ``SpeculativeConfig`` (``config.py``); the n-gram prompt-lookup drafter (``ngram.py``)
wired into the engine for every model (``engine/spec_decode.py``; V4/V4.1 compressor state is
saved and restored around drafted steps); Algorithm 1 / lagged top-K / threshold schedulers
(``schedule.py``), driven in the engine by per-position acceptance rates and a steps-per-second
table profiled at engine start. Not yet: the DSpark and MTP drafters (and with them real
per-token confidences and the lagged production variant), a rollback that avoids recomputing
accepted tokens on compressor models.
"""
