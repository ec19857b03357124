"""Speculative decoding (issue 7): drafters that guess the next tokens, the verification that
keeps the output distribution exactly the target model's (``deepinfer.sampling.rejection``)
and the schedulers that choose how many drafts to verify.

- ``config.py``: ``SpeculativeConfig(method="ngram"|"mtp"|"dspark", num_speculative_tokens,
  schedule="static"|"threshold"|"hardware")``;
- ``ngram.py``: prompt lookup, any model;
- ``dspark.py``: V4.1's DSpark stages (block drafting, Markov head, confidence head);
- ``mtp.py``: V4's next-n layer, one draft by default;
- ``draft_ring.py``: the model drafters' private per-sequence window caches;
- ``drafter.py``: the ``Draft`` a model drafter hands to verification, draft sampling;
- ``schedule.py``: Algorithm 1, its lagged production variant, the threshold rule.

The engine side (which requests draft, features from the target step, verification and
rollback) is ``deepinfer.engine.spec_decode`` and ``Engine._verify``.
"""
