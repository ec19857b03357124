"""``LLM.sleep`` / ``wake_up``: the K/V cache's pages go back to the system (resident memory
falls by what the cache held; at level 2 also by the weights and their packed copies),
requests are refused while asleep, and after waking the engine gives the outputs of a fresh
one: no prefix cached before sleep is reused over zeroed blocks, and level 2's weights are
read again (an engine over a trainer's module keeps the trainer's parameters)."""

from __future__ import annotations

import mmap

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.block_pool import BlockPool
from deepinfer.engine.memory import cache_tensors
from deepinfer.models.layers.projection import Projection, projections
from deepinfer.models.loading import load_model
from deepinfer.tiny import make_tiny_checkpoint


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def _run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture
def setup(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama", seed=2, head_dim=64, hidden_size=256)
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 258, (200,), generator=gen).tolist()
    prompts = [shared + torch.randint(2, 258, (n,), generator=gen).tolist() for n in (5, 9, 30)]
    return path, prompts


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
def test_sleep_returns_the_cache_pages_and_waking_computes_afresh(setup):
    path, prompts = setup
    fresh = _run(LLM(path, kv_cache_memory_bytes=64 << 20), prompts)
    llm = LLM(path, kv_cache_memory_bytes=64 << 20)
    _run(llm, prompts[:1])  # caches the shared prefix
    assert _run(llm, prompts) == fresh and llm.engine.block_pools[0].hit_blocks > 0
    for t in cache_tensors(llm.engine.runner.pools):
        t.view(-1).view(torch.uint8).fill_(1)  # every page of the cache resident
    held = sum(t.numel() * t.element_size() for t in cache_tensors(llm.engine.runner.pools))
    before = _rss()
    llm.sleep()
    assert llm.is_sleeping and before - _rss() >= 0.9 * held
    assert all(not t.any() for t in cache_tensors(llm.engine.runner.pools))
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate([prompts[0]])
    llm.wake_up()
    hits = llm.engine.block_pools[0].hit_blocks
    assert (
        _run(llm, prompts[:1]) == fresh[:1] and llm.engine.block_pools[0].hit_blocks == hits
    )  # nothing kept
    assert (
        _run(llm, prompts) == fresh and llm.engine.block_pools[0].hit_blocks > hits
    )  # refilled after waking


def test_a_prefix_kept_across_sleep_is_caught(setup, monkeypatch):
    """Mutation check: a sleep that keeps the cached prefixes reads zeroed blocks on the next
    hit, and the outputs differ from a fresh engine's."""
    path, prompts = setup
    fresh = _run(LLM(path, kv_cache_memory_bytes=64 << 20), prompts)
    llm = LLM(path, kv_cache_memory_bytes=64 << 20)
    _run(llm, prompts[:1])  # caches the shared prefix
    monkeypatch.setattr(BlockPool, "reset_prefix_cache", lambda self: None)
    llm.sleep()
    llm.wake_up()
    assert _run(llm, prompts[1:]) != fresh[1:]


def test_sleep_is_refused_where_it_cannot_hold(setup):
    path, prompts = setup
    llm = LLM(path)
    with pytest.raises(ValueError, match="level"):
        llm.sleep(level=3)
    llm.engine.add_request("r", prompts[0], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.sleep()
    assert not llm.is_sleeping


def _weight_bytes(llm: LLM) -> int:
    """Bytes of every distinct storage under the parameters and the engine's weight copies."""
    seen, total = set(), 0
    tensors = list(llm.model.parameters())
    for p in projections(llm.model):
        if p.engine is not None and not hasattr(p.engine, "func"):
            tensors += [t for t in vars(p.engine).values() if isinstance(t, torch.Tensor) and not t.is_mkldnn]
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("options", [{}, {"quantization": "int8"}])
def test_level_two_returns_the_weights_pages_and_waking_reads_them_again(setup, options):
    path, prompts = setup
    fresh = _run(LLM(path, **options), prompts)
    llm = LLM(path, **options)
    assert _run(llm, prompts) == fresh
    held = _weight_bytes(llm)
    before = _rss()
    llm.sleep(level=2)
    assert before - _rss() >= 0.8 * held
    assert all(not p.any() for p in llm.model.parameters())
    llm.wake_up()
    assert _run(llm, prompts) == fresh and llm.weight_version == "0"


def test_level_two_over_a_trainers_module_keeps_its_parameters(setup):
    path, prompts = setup
    fresh = _run(LLM(path), prompts)
    model = load_model(path, requires_grad=True)
    saved = [p.detach().clone() for p in model.parameters()]
    llm = LLM.from_model(model)
    llm.sleep(level=2)
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved, strict=True))
    llm.wake_up()
    assert _run(llm, prompts) == fresh


def test_a_copy_left_empty_after_level_two_is_caught(setup, monkeypatch):
    """Mutation check: waking without remaking the packed copies computes with zeros."""
    path, prompts = setup
    fresh = _run(LLM(path), prompts)
    llm = LLM(path)
    llm.sleep(level=2)
    monkeypatch.setattr(Projection, "refresh", lambda self: None)
    llm.wake_up()
    assert _run(llm, prompts) != fresh
