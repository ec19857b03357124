"""The prepared GPU check, on the CPU: ``benchmarks/gpu_check.sh`` runs its key figures
first and the slow stages last, within 8 minutes of limits; every measured row reaches
``$OUT/results.md`` as it is measured, so a stage cut by its limit keeps them and the next
stage still runs; ``gpu_tests/greedy_compare`` tells a near-tie from a real divergence."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "gpu_tests"))
from greedy_compare import assert_same_up_to_near_ties, divergences  # noqa: E402

STAGES = ["env", "install", "decode", "tests", "peer", "inductor"]
BUDGET_S = 480  # the lease's 15 minutes less the machine's start-up and one rerun's margin


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


def _run(out: Path, **env: str) -> subprocess.CompletedProcess:
    full = dict(
        os.environ,
        OUT=str(out),
        # the script calls ``python3``: this interpreter's, even where its venv is not activated
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        **env,
    )
    for name in [n for n in full if n.startswith(("GPU_CHECK_", "GPU_DECODE_"))]:
        if name not in env:  # only the test's own settings
            full.pop(name, None)
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=900)


def _sections(results: str) -> dict[str, list[str]]:
    """The results file's table rows (header and separator left out), per stage section."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in results.splitlines():
        if line.startswith("## "):
            current = line.split()[1]
            sections[current] = []
        elif current and line.startswith("| ") and not line.startswith(("| model |", "| test |")):
            sections[current].append(line)
    return sections


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split("|")]


def test_the_stage_limits_fit_eight_minutes_with_the_slow_stages_last(tmp_path):
    run = _run(tmp_path, GPU_CHECK_PLAN="1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    plan = [line.split() for line in lines[:-1]]
    assert [stage for stage, _ in plan] == STAGES
    grace = int(re.search(r"\+ (\d+)s kill grace", lines[-1]).group(1))
    total = sum(int(limit) + grace for _, limit in plan)
    assert lines[-1].startswith(f"total {total} ") and total <= BUDGET_S, lines[-1]
    # the key figures' stage gets the largest share; the Inductor and transformers stages,
    # last, are the ones a cut takes
    limits = {stage: int(limit) for stage, limit in plan}
    assert max(limits, key=limits.get) == "decode"


def test_dry_run_runs_the_key_figures_first_and_records_every_row(tmp_path):
    run = _run(tmp_path, GPU_CHECK_DRY_RUN="1")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == STAGES
    assert all(": ok in " in line for line in summary), summary
    results = (tmp_path / "results.md").read_text()
    sections = _sections(results)
    assert list(sections) == STAGES
    for stage in STAGES:  # each section ends with its stage's verdict
        assert re.search(rf"^{stage}: ok in \d+s$", results, re.M), stage
    decode = [_cells(r)[:3] for r in sections["decode"]]
    assert decode == [
        [model, str(batch), mode]
        for model in ("smollm2-1.7b", "v4-1.9b")
        for batch in (1, 4)
        for mode in ("graphs-eager", "eager")
    ]
    for row in sections["decode"]:
        model, batch, mode, device, host, *_, note = _cells(row)
        if mode == "eager":  # measured (no CUDA events on the CPU)
            assert device == "n/a" and float(host) > 0 and note.startswith("built in"), row
        else:
            assert "skipped: CUDA graphs need a CUDA device" in note, row
    tests = {_cells(r)[0]: _cells(r)[1] for r in sections["tests"]}
    assert sum(o == "passed" for o in tests.values()) >= 5, tests  # the capture rules
    assert all(o.startswith("skipped") for t, o in tests.items() if t.startswith("gpu_tests/"))
    assert any("test_speculative_decoding_on_cuda" in t for t in tests)
    assert not any("compiled-step" in t for t in tests)  # Inductor's cases wait for a later stage
    assert [_cells(r)[:3] for r in sections["peer"]] == [["smollm2-1.7b", b, "transformers"] for b in "14"]
    assert [_cells(r)[:3] for r in sections["inductor"]] == [
        ["smollm2-1.7b", b, m] for b in "14" for m in ("compiled", "graphs")
    ]
    # the printed summary: the key figures first, then the stages
    tail = run.stdout[run.stdout.index("== key figures") :].splitlines()
    assert tail[2:10] == sections["decode"]
    assert tail[10].startswith("== stages") and tail[11:] == summary


def test_a_stage_cut_by_its_limit_keeps_its_rows_and_the_next_stages_run(tmp_path):
    """gpu_decode.py stops responding after three rows: the stage is stopped at its limit,
    the three rows are in the results, and the stages after it (one made to fail) run."""
    run = _run(
        tmp_path,
        GPU_CHECK_DRY_RUN="1",
        GPU_CHECK_STAGES="decode env install",
        GPU_CHECK_LIMITS="decode=20",
        GPU_DECODE_HANG_AFTER_ROWS="3",
        GPU_CHECK_FAIL="env",
    )
    assert run.returncode == 2, run.stdout + run.stderr  # two failed stages
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("decode: TIMED OUT after 20s"), summary
    assert summary[1].startswith("env: FAILED") and summary[2].startswith("install: ok"), summary
    rows = _sections((tmp_path / "results.md").read_text())["decode"]
    assert [_cells(r)[:3] for r in rows] == [
        ["smollm2-1.7b", "1", "graphs-eager"],
        ["smollm2-1.7b", "1", "eager"],
        ["smollm2-1.7b", "4", "graphs-eager"],
    ]
    assert "waiting to be stopped" in (tmp_path / "decode.log").read_text()


def test_gpu_decode_reports_a_failing_peer_and_keeps_our_rows(monkeypatch, capsys, tmp_path):
    """A peer that cannot load the checkpoint (e.g. an older transformers) puts its error in
    its rows; the engine's rows, in between, are all there, in the printout and the file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_decode", ROOT / "benchmarks" / "gpu_decode.py")
    gpu_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_decode)

    class NoPeer:
        def __init__(self, *args):
            raise ValueError("unknown model type deepseek_v4")

    monkeypatch.setattr(gpu_decode, "PeerBench", NoPeer)
    results = tmp_path / "results.md"
    argv = ["--small", "--device", "cpu", "--models", "v4", "--batches", "1", "2", "--steps", "2"]
    gpu_decode.main([*argv, "--modes", "eager", "transformers", "--results", str(results)])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| v4-1.9b")]
    assert [_cells(r)[:3] for r in rows] == [
        ["v4-1.9b", b, m] for b in "12" for m in ("eager", "transformers")
    ]
    failed = "failed: ValueError: unknown model type deepseek_v4"
    assert all(failed in r for r in rows if "| transformers |" in r)
    assert all(float(_cells(r)[4]) > 0 for r in rows if "| eager |" in r)
    assert [line for line in results.read_text().splitlines() if line.startswith("| v4-1.9b")] == rows
