"""Packed CPU weights in huge-page-advised memory (kernels/huge_pages.py): the copy holds the
same values, sits in a mapping the kernel was asked to back with 2 MiB pages (Linux's
``hg`` flag in /proc/self/smaps), outlives the arena's reference to its chunk, and is unmapped
with its last tensor; engines put their packed weights there unless told not to, with the
same outputs either way."""

from __future__ import annotations

import gc
import re
import sys

import pytest
import torch
from deepinfer.kernels import huge_pages
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")


def _region(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps entry of the mapping holding ``address`` (None: unmapped)."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
        lo, hi = (int(x, 16) for x in entry.split()[0].split("-"))
        if lo <= address < hi:
            return dict(line.split(":", 1) for line in entry.splitlines()[1:] if ":" in line)
    return None


def _advised(t: torch.Tensor) -> bool:
    region = _region(t.data_ptr())
    return region is not None and "hg" in region.get("VmFlags", "").split()


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 3000),
    cols=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.uint8, torch.int8, torch.bfloat16]),
)
def test_adopt_copies_large_tensors_into_advised_memory(rows, cols, dtype):
    t = torch.randint(-100, 100, (rows, cols)).to(dtype)
    out = huge_pages.HugePageArena().adopt(t)
    assert torch.equal(out, t) and out.shape == t.shape and out.dtype == t.dtype
    if t.numel() * t.element_size() < huge_pages.MIN_BYTES:
        assert out is t
    else:
        assert out.data_ptr() != t.data_ptr() and out.is_contiguous()
        assert out.data_ptr() % huge_pages.ALIGN == 0 and _advised(out)


def test_no_arena_or_small_tensors_stay_where_they_are():
    big = torch.randn(1024, 1024)
    assert huge_pages.adopt(big, None) is big
    small = torch.randn(16, 16)
    assert huge_pages.adopt(small, huge_pages.HugePageArena()) is small
    assert not _advised(big)  # the mutation check's baseline: ordinary memory has no flag


def test_a_tensor_outlives_the_arena_and_its_mapping_goes_with_it():
    arena = huge_pages.HugePageArena()
    kept = arena.adopt(torch.arange(huge_pages.CHUNK // 4, dtype=torch.float32))  # a chunk of its own
    address = kept.data_ptr()
    arena.adopt(torch.ones(huge_pages.CHUNK // 4, dtype=torch.float32))  # the arena moves on
    gc.collect()
    assert kept[-1].item() == huge_pages.CHUNK // 4 - 1 and _advised(kept)
    del kept
    gc.collect()
    assert _region(address) is None


def test_engine_packed_weights_use_huge_pages_and_outputs_do_not_change(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama", hidden_size=256, intermediate_size=1024)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = {}
    for flag in (True, False):
        llm = LLM(path, cpu_huge_pages=flag)
        mlp = llm.engine.runner.model.model.layers[0].mlp
        assert _advised(mlp.gate_up.engine.packed) is flag
        out = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0].outputs[0]
        outputs[flag] = (out.token_ids, [[(k, v.logprob) for k, v in d.items()] for d in out.logprobs])
    assert outputs[True] == outputs[False]
    with pytest.raises(ValueError, match="cpu_huge_pages"):
        LLM(path, cpu_huge_pages="yes")
