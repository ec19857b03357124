"""``deepinfer bench batched`` (bench/llama_cpp.py): llama-batched-bench's shape on our engine,
and llama.cpp's own tool on the same weights when a checkout is given. The figures themselves
are benchmarks (RESULTS.md); here: the table runs end to end on a tiny checkpoint, llama.cpp's
output is parsed as its columns say, and the peer gets the conversions and arguments that make
the comparison fair (same prompt and output lengths, batches, threads)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from deepinfer.kernels import weight_only

from deepinfer.bench import llama_cpp
from deepinfer.bench.llama_cpp import (
    NO_REPACK,
    PEER_CACHE_TYPES,
    VARIANTS,
    cpu_description,
    llama_cpp_rows,
    parse_batched_bench,
    run_table,
)
from deepinfer.cli import main
from deepinfer.cli.bench import BATCHED_VARIANTS
from deepinfer.tiny import make_tiny_checkpoint

# llama-batched-bench's output as that tool prints it (SmolLM2-135M F32, -npp 144 -ntg 64
# -npl 1,8, two threads on a machine other jobs shared: its figures are a format, not a reference)
SAMPLE = """
llama_batched_bench: n_kv_max = 12288, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   144 |     64 |    1 |    208 |    0.260 |   553.89 |    2.736 |    23.39 |    2.996 |    69.43 |
|   144 |     64 |    8 |   1664 |    1.932 |   596.32 |    5.916 |    86.55 |    7.848 |   212.03 |

"""


def test_parse_reads_llama_batched_bench_columns():
    rows = parse_batched_bench(SAMPLE, output_len=64)
    assert set(rows) == {1, 8}
    assert rows[1] == pytest.approx((553.89, 23.39, 64 / 2.996))
    assert rows[8] == pytest.approx((596.32, 86.55, 8 * 64 / 7.848))
    assert parse_batched_bench("no table here\n| a | b |", 64) == {}


def _fake_llama_cpp(tmp_path: Path):
    """A checkout holding the bench binary's name, and a ``subprocess.run`` stand-in that
    records each command and answers the bench with ``SAMPLE``."""
    root = tmp_path / "llama.cpp"
    (root / "build" / "bin").mkdir(parents=True)
    (root / "build" / "bin" / "llama-batched-bench").write_text("")
    calls: list[list[str]] = []

    def run(args, **kwargs):
        calls.append([str(a) for a in args])
        stdout = SAMPLE if args[0].endswith("llama-batched-bench") else ""
        return subprocess.CompletedProcess(args, 0, stdout=stdout, stderr="")

    return root, calls, run


@pytest.mark.parametrize(
    ("outtype", "quantized"), [("F32", False), ("BF16", False), ("Q8_0", False), ("Q4_0", True)]
)
def test_the_peer_runs_on_the_same_weights_and_shape(tmp_path, outtype, quantized):
    root, calls, run = _fake_llama_cpp(tmp_path)
    checkpoint = tmp_path / "ckpt"
    rows = llama_cpp_rows(root, checkpoint, outtype, [1, 8], 144, 64, threads=3, run=run).rows
    assert set(rows) == {1, 8}
    convert = calls[0]
    assert convert[1].endswith("convert_hf_to_gguf.py") and convert[2] == str(checkpoint)
    assert convert[-1] == ("f32" if quantized else outtype.lower())
    if quantized:  # F32 first, then llama-quantize to the type
        assert calls[1][0].endswith("llama-quantize") and calls[1][-1] == outtype
    bench = calls[-1]
    flags = dict(zip(bench[1::2], bench[2::2], strict=False))
    assert flags["-npp"] == "144" and flags["-ntg"] == "64" and flags["-npl"] == "1,8"
    assert flags["-t"] == flags["-tb"] == "3"
    assert int(flags["-c"]) >= 8 * (144 + 64)


def test_an_8_bit_cache_peer_runs_with_its_8_bit_kv_cache(tmp_path):
    """The 8-bit cache variants' peer (fp8 and int8): llama.cpp's q8_0 K and V cache (with the
    flash attention its quantized V cache needs); other variants keep llama.cpp's default cache."""
    root, calls, run = _fake_llama_cpp(tmp_path)
    llama_cpp_rows(root, tmp_path, "F32", [1], 144, 64, threads=2, run=run, cache_type="q8_0")
    flags = dict(zip(calls[-1][1::2], calls[-1][2::2], strict=False))
    assert flags["-ctk"] == flags["-ctv"] == "q8_0" and flags["-fa"] == "on"
    assert PEER_CACHE_TYPES == {"fp32-kv8": "q8_0", "fp32-kvi8": "q8_0"}
    assert VARIANTS["fp32-kv8"][0] == {"kv_cache_dtype": "fp8"}
    assert VARIANTS["fp32-kvi8"][0] == {"kv_cache_dtype": "int8"}
    llama_cpp_rows(root, tmp_path, "F32", [1], 144, 64, threads=2, run=run)
    assert "-ctk" not in calls[-1] and "-fa" not in calls[-1]


def test_a_missing_llama_cpp_build_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="llama-batched-bench"):
        llama_cpp_rows(tmp_path, tmp_path, "F32", [1], 8, 4, threads=1)


def test_the_table_runs_on_a_tiny_checkpoint_without_a_peer(tmp_path, capsys):
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    lines: list[str] = []
    threads = torch.get_num_threads()
    table = run_table(
        path, ["fp32", "int4"], [1, 3], prompt_len=8, output_len=4, threads=1, print_fn=lines.append
    )
    assert [(r["variant"], r["batch"]) for r in table] == [("fp32", 1), ("fp32", 3), ("int4", 1), ("int4", 3)]
    assert all(r["peer"] is None and min(r["ours"]) > 0 for r in table)
    assert any(line.startswith("  int4 vs fp32: greedy tokens") for line in lines)
    assert torch.get_num_threads() == threads  # ran on 1 thread, left the caller's count
    assert lines[0].startswith("CPU: ")
    assert (
        main(
            ["bench", "batched", "--model", str(path), "--batches", "2", "--variants", "fp32"]
            + ["--prompt-len", "6", "--output-len", "3", "--threads", "1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| fp32 | 2 |" in out


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="variants"):
        run_table(tmp_path, ["fp64"], [1])
    with pytest.raises(ValueError, match="output_len"):
        run_table(tmp_path, ["fp32"], [1], output_len=1)


def test_the_cli_offers_every_variant_and_reads_llama_cpp_dir(monkeypatch, tmp_path):
    assert set(BATCHED_VARIANTS) == set(VARIANTS)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path))
    assert llama_cpp.default_llama_cpp() == tmp_path
    monkeypatch.delenv("LLAMA_CPP_DIR")
    assert llama_cpp.default_llama_cpp() is None


def test_a_crashed_peer_is_rerun_without_repacking_and_says_so(tmp_path):
    """llama.cpp's AMX path segfaults on some builds (ggml-org/llama.cpp#20824): the table gets
    the peer's run without repacking, labelled, instead of dying; an error it reports is raised."""
    root, calls, ok = _fake_llama_cpp(tmp_path)

    def crashing(args, **kwargs):
        if args[0].endswith("llama-batched-bench") and NO_REPACK not in args:
            raise subprocess.CalledProcessError(-11, args)
        return ok(args, **kwargs)

    peer = llama_cpp_rows(root, tmp_path, "Q8_0", [1, 8], 144, 64, threads=2, run=crashing)
    assert set(peer.rows) == {1, 8} and peer.fallback == NO_REPACK
    assert calls[-1][-1] == NO_REPACK
    assert llama_cpp_rows(root, tmp_path, "Q8_0", [1], 144, 64, threads=2, run=ok).fallback is None

    def failing(args, **kwargs):
        if args[0].endswith("llama-batched-bench"):
            raise subprocess.CalledProcessError(1, args)
        return ok(args, **kwargs)

    with pytest.raises(subprocess.CalledProcessError):
        llama_cpp_rows(root, tmp_path, "Q8_0", [1], 144, 64, threads=2, run=failing)


def test_a_failing_converter_says_why(tmp_path):
    """The converter's own message (e.g. a Python package it lacks) reaches the user."""
    root, _, ok = _fake_llama_cpp(tmp_path)

    def no_sentencepiece(args, **kwargs):
        if args[1].endswith("convert_hf_to_gguf.py"):
            raise subprocess.CalledProcessError(
                1,
                args,
                output="",
                stderr="Traceback...\nModuleNotFoundError: No module named 'sentencepiece'",
            )
        return ok(args, **kwargs)

    with pytest.raises(RuntimeError, match=r"(?s)convert_hf_to_gguf.py failed \(exit 1\):\n.*sentencepiece"):
        llama_cpp_rows(root, tmp_path, "F32", [1], 144, 64, threads=2, run=no_sentencepiece)


def test_the_bf16_onednn_kernel_is_named():
    """The table names the oneDNN kernel bf16 runs; on a CPU with AMX it must be AMX's."""
    kernel = weight_only.onednn_bf16_kernel()
    if not weight_only.PackedLinear.available(torch.zeros(2, 2, dtype=torch.bfloat16)):
        assert kernel is None
        return
    assert kernel and ":" in kernel  # e.g. brg_matmul:avx10_1_512_amx
    if "amx_bf16" in Path("/proc/cpuinfo").read_text():
        assert "amx" in kernel
    assert f"above {kernel}" in cpu_description()
