"""Speculative decoding (issue 7, in progress): drafters that guess the next tokens and the
verification that keeps the output distribution exactly the target model's
(``deepinfer.sampling.rejection``). What exists so far: the n-gram prompt-lookup drafter and
the rejection sampler; the engine does not draft yet (no ``EngineConfig`` option exposes it).
"""
