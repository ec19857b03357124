"""Quality tools: what a quantized mode costs in perplexity, KL divergence and top-1
agreement, measured the way llama.cpp's ``llama-perplexity`` measures it, so figures compare
one for one (``scoring``; saved base distributions in ``base_logprobs``)."""

from deepinfer.quality.scoring import PerplexityReport, chunk_tokens, perplexity

__all__ = ["PerplexityReport", "chunk_tokens", "perplexity"]
