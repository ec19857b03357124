"""``LLM.memory_report()`` and ``deepinfer plan``: the bytes they report follow from the config
(checked against arithmetic written out here), the plan and a running engine agree on the
cache, and the cache bytes in use follow the blocks requests hold."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deepinfer import LLM, SamplingParams
from deepinfer.cache.pools import CacheLayout
from deepinfer.cli import main
from deepinfer.engine.memory import GIB, plan, pool_bytes, weight_bytes
from deepinfer.models.registry import resolve
from deepinfer.models.released_configs import V4_FLASH
from deepinfer.tiny import make_tiny_checkpoint


def _meta(raw):
    cfg, cls = resolve(raw)
    with torch.device("meta"):
        return cls(cfg), cfg


def test_v4_flash_weight_plan_follows_the_config():
    """fp4 routed experts: 17/32 byte per value (a nibble plus a ue8m0 scale per 32), for 43
    backbone layers and the MTP layer, each 256 experts x 3 matrices of 4096 x 2048; split
    evenly over 8 devices."""
    model, cfg = _meta(V4_FLASH)
    one = plan(model, cfg.quantization, 4096)
    eight = plan(model, cfg.quantization, 4096, tensor_parallel_size=8)
    experts = (43 + 1) * 256 * 3 * 4096 * 2048
    assert one.weight_bytes_by_format["fp4"] == experts * 17 // 32
    assert eight.weight_bytes_by_format["fp4"] == math.ceil(experts * 17 // 32 / 8)
    # fp8 q/kv/out projections: one byte per value plus one per 128 x 128 block
    wq_a = 4096 * 1024 + math.ceil(1024 / 128) * math.ceil(4096 / 128)
    assert one.weight_bytes_by_format["fp8"] > 44 * wq_a
    assert one.weight_bytes_per_device > 7 * eight.weight_bytes_per_device


def allocated_bytes_per_token(path, blocks: tuple[int, int]) -> float:
    """What one more cached token costs in the pools engines really allocate: the pool bytes
    of two engines with ``blocks`` cache blocks, their difference per token of the extra
    blocks (per-slot state and the null block cancel out)."""
    sizes = []
    for n in blocks:
        engine = LLM(str(path), kv_cache_dtype="float32", num_cache_blocks=n).engine
        sizes.append(pool_bytes(engine.runner.pools))
    return (sizes[1] - sizes[0]) / ((blocks[1] - blocks[0]) * engine.layout.block_size)


def test_plan_kv_cache_matches_what_the_engine_allocates(tmp_path):
    """The plan's bytes per token (meta model, config only) equal what a running engine's
    pools take per cached token, and its report's."""
    path = make_tiny_checkpoint(tmp_path, arch="deepseek_v4", seed=1, quant="fp8")
    llm = LLM(str(path), kv_cache_dtype="float32", num_cache_blocks=8)
    report = llm.memory_report()["kv_cache"]
    model, cfg = _meta(json.loads((path / "config.json").read_text()))
    planned = plan(model, cfg.quantization, 1000, block_size=llm.config.block_size, kv_dtype=torch.float32)
    assert planned.kv_bytes_per_token == allocated_bytes_per_token(path, (8, 16))
    assert planned.kv_bytes_per_token == report["bytes_per_token"]
    assert planned.kv_by_layer_kind == report["by_layer_kind"]
    kinds = report["by_layer_kind"]
    assert sum(k["layers"] for k in kinds.values()) == cfg.num_hidden_layers
    assert report["bytes_per_token"] == pytest.approx(
        sum(k["layers"] * k["bytes_per_token_per_layer"] for k in kinds.values())
    )


def test_the_allocation_check_sees_a_miscounted_block(tmp_path, monkeypatch):
    """Mutation check: a layout that forgets one fp32 value per token moves the plan and the
    report alike (the comparison between them cannot see it), not the allocated pools."""
    path = make_tiny_checkpoint(tmp_path, arch="deepseek_v4", seed=1, quant="fp8")
    honest = allocated_bytes_per_token(path, (8, 16))
    model, cfg = _meta(json.loads((path / "config.json").read_text()))
    real = CacheLayout.block_bytes
    monkeypatch.setattr(
        CacheLayout, "block_bytes", lambda self, dtype: real(self, dtype) - 4 * self.block_size
    )
    planned = plan(model, cfg.quantization, 1000, kv_dtype=torch.float32)
    assert allocated_bytes_per_token(path, (8, 16)) == honest != planned.kv_bytes_per_token


def _checkpoint_values(path: Path) -> int:
    """Values stored in the checkpoint's safetensors files (read from their headers)."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def test_sequences_that_fit_is_the_memory_left_after_the_weights(tmp_path):
    """The count is worked out here from the checkpoint and its config alone, not from the
    plan's own fields: weights are the checkpoint's values at 2 bytes each (bf16, as the plan
    assumes for an unquantized checkpoint; the tied head is stored once), a cached token costs
    K and V x layers x KV heads x head size x 2 bytes, a sequence holds its ``ceil(len / 16)``
    blocks of 16 tokens, and ``(budget x utilization - weights) // sequence bytes`` fit."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    model, _ = _meta(raw)
    max_len = 1000  # not a whole number of blocks: the last one is partly used
    weights = 2 * _checkpoint_values(path)
    per_token = 2 * raw["num_hidden_layers"] * raw["num_key_value_heads"] * raw["head_dim"] * 2
    per_sequence = math.ceil(max_len / 16) * 16 * per_token
    budgets = [weights - 1, weights, weights + per_sequence - 1, weights + per_sequence]
    budgets.append(weights + 7 * per_sequence + per_sequence // 2)
    for budget in budgets:
        for utilization in (1.0, 0.9):
            got = plan(model, None, max_len, memory_bytes=budget, utilization=utilization)
            assert got.weight_bytes_per_device == weights
            assert got.kv_bytes_per_sequence == per_sequence
            assert got.sequences_that_fit == max(0, (int(budget * utilization) - weights) // per_sequence)


def test_memory_report_counts_blocks_in_use(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    llm = LLM(str(path), num_cache_blocks=16, enable_prefix_caching=False)
    report = llm.memory_report()
    assert report["weights"]["bytes"] == sum(weight_bytes(llm.model).values()) > 0
    kv = report["kv_cache"]
    assert kv["blocks_in_use"] == 0 and kv["in_use_bytes"] == 0
    assert kv["allocated_bytes"] >= kv["blocks"] * kv["block_bytes"]
    engine = llm.engine
    prompt = list(range(3, 3 + 2 * kv["block_size"] + 1))  # three blocks once prefilled
    request = engine.add_request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while not request.output_token_ids:
        engine.step()
    held = llm.memory_report()["kv_cache"]
    assert held["blocks_in_use"] == 3
    assert held["in_use_bytes"] == 3 * kv["block_bytes"]


def test_plan_cli_prints_json(capsys):
    assert main(["plan", "deepseek-v4-flash", "--max-model-len", "8192", "--tensor-parallel-size", "8",
                 "--memory-gib", "131", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["tensor_parallel_size"] == 8 and out["max_model_len"] == 8192
    assert out["sequences_that_fit"] >= 1
    assert 0 < out["weight_bytes_per_device"] < 131 * GIB


def test_plan_refuses_an_int8_cache_where_the_engine_does(tmp_path, capsys):
    """V4's windowed and compressed rows have no int8 reader: ``deepinfer plan`` says so as the
    engine does, and a full-attention model plans an int8 cache at 9/32 of fp32's bytes."""
    assert main(["plan", "deepseek-v4-flash", "--max-model-len", "8192", "--kv-cache-dtype", "int8"]) != 0
    assert "kv_cache_dtype='int8'" in capsys.readouterr().err
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama", seed=1, head_dim=32)
    model, _ = _meta(json.loads((path / "config.json").read_text()))
    int8, fp32 = (plan(model, None, 256, kv_dtype=d, packed_kv=False) for d in (torch.int8, torch.float32))
    assert int8.kv_bytes_per_token * 32 == fp32.kv_bytes_per_token * 9
