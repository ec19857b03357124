"""mHC on the tiny V4.1: every site's mixing matrix is doubly stochastic (Sinkhorn), and the
streams carried between blocks stay finite and distinct."""

from __future__ import annotations

import torch

from deepinfer.models.loading import load_model


def test_mixing_matrices_are_doubly_stochastic(v41_ckpt):
    model = load_model(v41_ckpt)
    streams = torch.randn(
        64, model.config.hc_mult, model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    for block in [*model.layers, *model.mtp]:
        for site in ("attn", "ffn"):
            pre, post, comb = block.mixes(streams * 3.0, site)
            assert torch.allclose(comb.sum(dim=-1), torch.ones(64, 4), atol=1e-5), site
            assert torch.allclose(comb.sum(dim=-2), torch.ones(64, 4), atol=1e-5), site
            assert (comb >= 0).all() and (pre > 0).all() and ((post > 0) & (post < 2)).all()
