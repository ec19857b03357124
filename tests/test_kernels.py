"""Fast kernel paths agree with their reference definitions."""

from __future__ import annotations

import torch
from deepinfer.kernels.sinkhorn import _numpy, reference, sinkhorn


def test_numpy_sinkhorn_matches_reference():
    logits = torch.randn(37, 4, 4, generator=torch.Generator().manual_seed(0)) * 3
    ref = reference(logits, 20, 1e-6)
    assert torch.allclose(_numpy(logits, 20, 1e-6), ref, atol=1e-6)
    assert torch.allclose(sinkhorn(logits, 20, 1e-6), ref, atol=1e-6)
    # the loop ends on a column normalisation: columns sum to 1 (rows only approach it)
    assert torch.allclose(ref.sum(-2), torch.ones(37, 4), atol=1e-5)


def test_sinkhorn_rows_do_not_depend_on_the_batch():
    logits = torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sinkhorn(logits, 20, 1e-6)[5:6], sinkhorn(logits[5:6], 20, 1e-6))
