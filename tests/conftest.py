"""Shared tiny checkpoints, built once per test session (no network)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from memory_guard import MemoryGuard
from stable_topk_patch import stable_indexer_topk

from deepinfer.tiny import make_tiny_checkpoint

# README's command runs two pytest-xdist workers, one per core: each computes on one thread
# (two each oversubscribe the cores, and the suite ran slower than in one process:
# benchmarks/RESULTS.md, the test-suite entry). The kernel test files ask for two threads themselves (the
# ``two_threads`` fixture), so the kernels' threaded paths stay tested.
torch.set_num_threads(1 if "PYTEST_XDIST_WORKER" in os.environ else 2)
# V4 engines keep the CPU default (saved compiled variants, eager steps otherwise) but never
# reach its compile budget: a 30 s compile partway through a long test would change its
# timing and kernels; test_precompiled.py tests the budget rule with explicit values
os.environ.setdefault("DEEPINFER_CPU_COMPILE_AFTER_S", "1e9")
# Engines in tests size their KV caches explicitly, never as a fraction of the machine's free
# memory, which both workers (and the servers and CLIs tests start) would claim at once
os.environ.setdefault("DEEPINFER_KV_CACHE_SPACE_GB", "1")
# Compiling tests use Inductor's Python wrapper: the C++ one (the CPU default) makes each
# Inductor compile longer, and the suite runs many compiles for a few steps each; test_precompiled.py runs the default end to end
os.environ.setdefault("DEEPINFER_CPU_CPP_WRAPPER", "0")

# Each test process (an xdist worker, or the one process) has a memory bound: a test that
# outgrows it fails at once, named, instead of meeting the OOM killer (tests/support/memory_guard.py)
_MEMORY_GUARD = MemoryGuard.from_env()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with _MEMORY_GUARD.watching(item.nodeid):
        yield


@pytest.fixture
def two_threads():
    """Two compute threads for the test (kernels that split rows or tokens over threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def v4_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Released V4 config format: sliding, CSA(4, unsaturated top-k), HCA(128), hash MoE."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v4"), arch="deepseek_v4", seed=0)


@pytest.fixture(scope="session")
def v4_short_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF config spelling, HCA groups of 8, sharded into 3 files with an index json."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("v4short"), arch="deepseek_v4_short_groups", seed=1, shards=3
    )


@pytest.fixture(scope="session")
def v4_fp8_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fp8 e4m3 block-scaled linears + fp4 e2m1 routed experts, as released."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v4fp8"), arch="deepseek_v4", seed=2, quant="fp8")


@pytest.fixture(scope="session")
def hf_reference():
    """Loads a checkpoint with transformers' independent DeepseekV4ForCausalLM."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()

    def load(path: Path) -> torch.nn.Module:
        model, info = DeepseekV4ForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        return stable_indexer_topk(model.eval())  # the spec's tie rule, as ours uses

    return load


@pytest.fixture(scope="session")
def v41_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny V4.1 (``deepinfer.tiny``'s shape): CSA2 sharing, two-level top-k (unsaturated), Engram with
    the byte tokenizer's map, DSpark stages; composite config.json."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v41"), arch="deepseek_v41", seed=0)
