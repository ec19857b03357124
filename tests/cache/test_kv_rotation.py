"""The rotated key basis of 8-bit K/V caches (``kv_rotation``): the transform against the
Hadamard matrix written out here, and why keys are rotated. The kernels' rotation is checked
bitwise in test_cpu_kernels (RoPE + cache writes), the engine's in test_kv_int8 and
test_kv_dtypes (the caches against an fp32 twin rotating the same way)."""

from __future__ import annotations

import torch
from deepinfer.kernels import kv_int8, kv_rotation
from hypothesis import given, settings
from hypothesis import strategies as st


def _hadamard(n: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of order n (a power of two), built by
    Kronecker products, apart from ``kv_rotation``."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / n**0.5


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000), lead=st.integers(1, 5), head_dim=st.sampled_from([8, 32, 64, 96, 128, 192])
)
def test_rotate_is_the_blockwise_hadamard_matrix_and_its_own_inverse(seed, lead, head_dim):
    """``rotate`` multiplies each head by the orthonormal Hadamard matrix of its largest
    power-of-two block (96 -> three blocks of 32), keeps query-key products, and undoes
    itself."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(lead, 3, head_dim, generator=gen)
    n = head_dim & -head_dim
    want = (x.view(lead, 3, head_dim // n, n) @ _hadamard(n)).view(x.shape)
    got = kv_rotation.rotate(x)
    assert got.shape == x.shape and torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(kv_rotation.rotate(got), x, atol=1e-5)
    q, k = torch.randn(head_dim, generator=gen), x[0, 0]
    assert torch.allclose(kv_rotation.rotate(q) @ got[0, 0], q @ k, atol=1e-4)


def test_rotation_spreads_an_outlier_channel_over_the_block():
    """Why keys are rotated: a head whose one channel is 100x the others loses most of its
    small channels to a shared scale; rotated, the same codes keep them. Mutation check: the
    unrotated round trip is many times worse."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(256, 64, generator=gen)
    k[:, 5] *= 100.0

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        return kv_int8.read(kv_int8.encode(x), torch.float32)

    plain = (round_trip(k) - k)[:, [i for i in range(64) if i != 5]].pow(2).mean()
    rotated = (kv_rotation.rotate(round_trip(kv_rotation.rotate(k))) - k)[:, [i for i in range(64) if i != 5]]
    assert rotated.pow(2).mean() * 10 < plain
