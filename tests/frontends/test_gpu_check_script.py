"""The prepared GPU check, on the CPU: ``benchmarks/gpu_check.sh`` goes on past a failing
stage and leaves every stage's log under ``$OUT``; ``gpu_tests/greedy_compare`` tells a
near-tie from a real divergence (and fails on the latter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "gpu_tests"))
from greedy_compare import assert_same_up_to_near_ties, divergences  # noqa: E402


def _out(tokens: list[int], gaps: list[float]) -> RequestOutput:
    """A greedy output whose step k had its top-2 logprobs ``gaps[k]`` apart."""
    logprobs = [{t: Logprob(-0.1, 1), t + 1: Logprob(-0.1 - g, 2)} for t, g in zip(tokens, gaps, strict=True)]
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", tokens, None, logprobs, "length")])


def test_near_ties_pass_and_clear_divergences_fail():
    ref = [_out([5, 6, 7, 8], [1.0, 1.0, 1e-4, 1.0]), _out([9, 9], [0.5, 0.5])]
    same = [_out([5, 6, 7, 8], [1.0] * 4), _out([9, 9], [0.5, 0.5])]
    assert divergences(ref, same) == []
    near_tie = [_out([5, 6, 3, 3], [1.0] * 4), _out([9, 9], [0.5, 0.5])]
    (found,) = assert_same_up_to_near_ties(ref, near_tie)
    assert (found.request, found.step, found.ref_token, found.got_token) == (0, 2, 7, 3)
    assert found.gap == pytest.approx(1e-4)
    clear = [_out([5, 6, 7, 8], [1.0] * 4), _out([9, 4], [0.5, 0.5])]  # mutation: a real bug
    with pytest.raises(AssertionError, match="request 1: first differs at step 1"):
        assert_same_up_to_near_ties(ref, clear)


def test_gpu_check_goes_on_past_a_failing_stage(tmp_path):
    env = dict(
        os.environ,
        GPU_CHECK_DRY_RUN="1",
        GPU_CHECK_STAGES="env decode",
        GPU_CHECK_FAIL="env",
        GPU_CHECK_MODES="eager",
        OUT=str(tmp_path),
        # the script calls ``python3``: this interpreter's, even where its venv is not activated
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # one failed stage
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("env: FAILED") and summary[1].startswith("decode: ok"), summary
    decode = (tmp_path / "decode.log").read_text()
    assert "| 1 | eager |" in decode and "| 4 | eager |" in decode
    assert "| 1 | transformers |" in decode


def test_gpu_decode_reports_a_failing_peer_and_keeps_our_rows(monkeypatch, capsys):
    """A peer that cannot load the checkpoint (e.g. an older transformers) prints its error
    in its row; the engine's rows, measured first, are all there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_decode", ROOT / "benchmarks" / "gpu_decode.py")
    gpu_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_decode)

    def no_peer(*args):
        raise ValueError("unknown model type deepseek_v4")

    monkeypatch.setattr(gpu_decode, "transformers_step_times", no_peer)
    argv = [
        "gpu_decode.py",
        "--small",
        "--device",
        "cpu",
        "--batches",
        "1",
        "2",
        "--steps",
        "2",
        "--modes",
        "eager",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_decode.main()
    out = capsys.readouterr().out
    assert "| 1 | eager |" in out and "| 2 | eager |" in out
    assert "| - | transformers | failed: ValueError: unknown model type deepseek_v4" in out
