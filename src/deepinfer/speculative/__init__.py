"""Speculative decoding: drafters that guess the next tokens, the verification that keeps
the output distribution exactly the target model's, the schedules that choose how many drafts
to verify, and the rollback of rejected drafts. The engine calls it through one object,
``decoder.SpeculativeDecoder``; it imports nothing from the engine or the models (it reads
requests and draft layers through the protocols it declares).

- ``config.py``: ``SpeculativeConfig(method="ngram"|"mtp"|"dspark", num_speculative_tokens,
  schedule="static"|"threshold"|"hardware")``, the engine's ``speculative_config``;
- ``drafter.py``: the ``Drafter`` protocol every drafter implements, the ``Draft`` it hands to
  verification, draft sampling;
- ``ngram.py``: prompt lookup, any model;
- ``mtp.py``: V4's next-n layer (``models.deepseek_v4.MtpDraftModel``), one draft by default;
- ``dspark.py``: V4.1's DSpark stages (``models.dspark_stages.DSparkDraftModel``);
- ``draft_ring.py``: the model drafters' private per-sequence window caches;
- ``schedule.py``: Algorithm 1, its lagged production variant, the threshold rule;
- ``verify.py``: greedy prefix match and batched rejection sampling;
- ``rollback.py``: where a verified chunk leaves the computed count, saved slot state;
- ``decoder.py``: ``SpeculativeDecoder``, which joins them for the engine.
"""
