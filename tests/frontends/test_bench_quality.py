"""``benchmarks/quality.py`` (bench/quality.py): our modes scored by the perplexity tool
against our own full-precision run, llama-perplexity's figures parsed as it prints them, and
the peer given the same text, context, chunks and KL base for every mode."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from deepinfer.bench import quality
from deepinfer.bench.quality import Figures, parse_llama_perplexity, table
from deepinfer.tiny import make_tiny_checkpoint

# the lines llama-perplexity prints (tools/perplexity/perplexity.cpp's formats), plain and
# with --kl-divergence
PLAIN = """
perplexity: calculating perplexity over 32 chunks, n_ctx=512, batch_size=512, n_seq=1
[1]10.1,[2]11.2,
Final estimate: PPL = 12.1284 +/- 0.35512
"""
KL = """
====== Perplexity statistics ======
Mean PPL(Q)                   :  12.180642 ±   0.357000
Mean PPL(base)                :  12.128387 ±   0.355120
Mean ln(PPL(Q)/PPL(base))     :   0.004299 ±   0.000420

====== KL divergence statistics ======
Mean    KLD:   0.004023 ±   0.000040
Maximum KLD:   0.512000
Same top p: 96.507 ± 0.203 %
"""


def test_llama_perplexity_output_is_read_as_printed():
    assert parse_llama_perplexity(PLAIN) == Figures(12.1284, None, None, None)
    got = parse_llama_perplexity(KL)
    assert got.ppl == pytest.approx(12.180642) and got.kl == pytest.approx(0.004023)
    assert got.top1 == pytest.approx(0.96507)
    with pytest.raises(RuntimeError, match="no perplexity"):
        parse_llama_perplexity("llama_model_load: error loading model")


def test_the_peer_scores_the_same_text_against_its_own_f32_base(tmp_path, monkeypatch):
    """One F32 run writes the KL base; each mode runs with the same file, context and chunks,
    the 8-bit cache mode with llama.cpp's q8_0 K/V cache (and the flash attention it needs);
    a mode two of ours share runs once."""
    root = tmp_path / "llama.cpp"
    (root / "build" / "bin").mkdir(parents=True)
    (root / "build" / "bin" / "llama-perplexity").write_text("")
    calls: list[list[str]] = []

    def run(args, **kwargs):
        calls.append([str(a) for a in args])
        out = KL if "--kl-divergence" in args else PLAIN
        return subprocess.CompletedProcess(args, 0, stdout=out, stderr="")

    monkeypatch.setattr(quality, "gguf_bits", lambda path: 4.5)
    text = tmp_path / "text.txt"
    modes = ["fp32", "int8", "fp8-kv", "int8-kv"]
    got = quality.peer(
        root, tmp_path / "ckpt", modes, text, 256, 7, 3, tmp_path, run=run, print_fn=lambda s: None
    )
    runs = [c for c in calls if c[0].endswith("llama-perplexity")]
    assert len(runs) == 4  # the base, F32 against it, Q8_0, F32 + q8_0 once for both cache modes
    for args in runs:
        flags = dict(zip(args[1::2], args[2::2], strict=False))
        assert flags["-f"] == str(text) and flags["-c"] == "256" and flags["--chunks"] == "7"
        assert flags["--kl-divergence-base"] == str(tmp_path / "peer-f32.kld") and flags["-t"] == "3"
    assert "--kl-divergence" not in runs[0] and all("--kl-divergence" in r for r in runs[1:])
    cache = [r for r in runs if "-ctk" in r]
    assert len(cache) == 1 and cache[0][cache[0].index("-ctv") + 1] == "q8_0" and "-fa" in cache[0]
    assert got["fp8-kv"] == got["int8-kv"] and got["int8"].bits == 4.5 and got["fp32"].bits is None


def test_our_modes_are_scored_against_our_fp32_run(tmp_path):
    """Our side on a tiny Llama: fp32 is the base (no KL), the int8 K/V cache and int8 weights
    report KL and top-1 against it, int8 weights their bits per weight; the table has a row
    per mode."""
    path = make_tiny_checkpoint(tmp_path / "llama", arch="llama", seed=2, head_dim=32)
    words = " ".join(f"w{i % 53} x{i % 7}" for i in range(3000))
    modes = ["fp32", "int8", "int8-kv"]
    ours = quality.ours(path, modes, words, ctx=64, chunks=3, folder=tmp_path, print_fn=lambda s: None)
    assert ours["fp32"].kl is None and ours["fp32"].bits is None
    for mode in ("int8", "int8-kv"):
        assert ours[mode].kl is not None and ours[mode].kl > 0 and 0 < ours[mode].top1 <= 1
    assert 8.5 <= ours["int8"].bits < 9 and ours["int8-kv"].bits is None
    lines = table(modes, ours, {})
    assert len(lines) == 2 + len(modes) and lines[2].startswith("| fp32 ")
    with pytest.raises(ValueError, match="unknown"):
        quality.run_quality(path, Path(path), words, ["int3"])
