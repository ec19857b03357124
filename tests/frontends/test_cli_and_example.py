"""The command line and the README's main example run end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deepinfer.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_make_tiny_then_generate(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "ck"), "--quant", "fp8", "--shards", "2"]) == 0
    assert (tmp_path / "ck" / "model.safetensors.index.json").is_file()
    assert (
        main(
            [
                "generate",
                "--model",
                str(tmp_path / "ck"),
                "--prompt",
                "hi",
                "--prompt",
                "there",
                "--max-tokens",
                "5",
                "--ignore-eos",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.count("tokens:") == 2 and "tokens/s" in captured.err
    # the same checkpoint (V4 with its MTP layer) with MTP drafting: same tokens
    args = [
        "generate",
        "--model",
        str(tmp_path / "ck"),
        "--prompt",
        "hi",
        "--max-tokens",
        "6",
        "--ignore-eos",
    ]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main([*args, "--speculative-config", '{"method": "mtp", "schedule": "hardware"}']) == 0
    captured = capsys.readouterr()
    drafted = captured.out
    assert "speculative (mtp):" in captured.err and "drafted" in captured.err
    assert plain.split("tokens:")[1].split("\n")[0] == drafted.split("tokens:")[1].split("\n")[0]


def test_generate_with_weight_only_quantization(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "llama"), "--arch", "llama"]) == 0
    args = ["generate", "--model", str(tmp_path / "llama"), "--prompt", "hi", "--max-tokens", "3"]
    assert main([*args, "--quantization", "int4"]) == 0
    assert "tokens:" in capsys.readouterr().out
    assert main([*args, "--quantization", "int8"]) == 0


def test_generate_on_two_replicas_gives_one_engines_tokens(tmp_path, capsys, two_threads):
    """``--data-parallel-replicas 2``: the prompts split over two engines, the same tokens."""
    assert main(["make-tiny", str(tmp_path / "ck")]) == 0
    args = ["generate", "--model", str(tmp_path / "ck"), "--prompt", "hi", "--prompt", "there"]
    args += ["--max-tokens", "4", "--ignore-eos", "--compile", "off"]
    assert main(args) == 0
    one = capsys.readouterr().out
    assert main([*args, "--data-parallel-replicas", "2"]) == 0
    two = capsys.readouterr().out
    tokens = [line for line in one.splitlines() if "tokens:" in line]
    assert len(tokens) == 2 and tokens == [line for line in two.splitlines() if "tokens:" in line]


def test_generate_reports_bad_input(tmp_path, capsys):
    main(["make-tiny", str(tmp_path / "ck")])
    assert main(["generate", "--model", str(tmp_path / "ck"), "--prompt", "x", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2


def test_offline_inference_example_runs_the_real_model():
    """README's main command: SmolLM2 answers chat prompts."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offline_inference.py"), "--max-tokens", "12"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    assert "Paris" in run.stdout and "tokens/s" in run.stdout


def test_offline_inference_example_on_a_checkpoint_dir(tmp_path):
    from deepinfer.tiny import make_tiny_checkpoint

    ck = make_tiny_checkpoint(tmp_path / "ck")
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "offline_inference.py"),
            "--model",
            str(ck),
            "--max-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "tokens/s" in run.stdout and run.stdout.count("> ") == 4


def test_research_example_runs():
    """examples/research.py: the logit lens on SmolLM2 ends on the model's own prediction,
    LoRA steps on tiny V4 lower the loss, and the engine serves the saved adapter with the
    PEFT module's logprobs."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "research.py"), "--steps", "4"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    lines = run.stdout.splitlines()
    lens = [line for line in lines if line.strip().startswith("layer")]
    assert len(lens) == 30 and "model   :" in run.stdout
    losses = [float(x) for x in lines[-1].split("loss")[1].split("->")]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert float(lines[-2].rsplit(" ", 1)[1]) < 1e-4  # served adapter vs PEFT


def test_chat_cli_and_generate_answer_an_instruct_question(capsys, monkeypatch):
    """``deepinfer chat`` streams a reply per line typed; ``generate`` puts a checkpoint with a
    chat template through it by default (as llama.cpp's CLI does), ``--raw`` does not, and the
    speed goes to stderr.

    ``chat`` runs as its own process (stdin a pipe, as typed). The three ``generate`` runs
    differ only in how the prompt is put to the same engine (the same model and engine flags),
    so they run through ``main`` in this process, meanwhile, on one engine: loading SmolLM2
    is most of a run."""
    import deepinfer

    chat_run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "deepinfer.cli",
            "chat",
            "smollm2-135m",
            "--temperature",
            "0",
            "--max-tokens",
            "16",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    engines: dict[tuple[str, str], deepinfer.LLM] = {}
    real_llm = deepinfer.LLM

    def shared_llm(model: str, **kwargs: object) -> deepinfer.LLM:
        """``LLM``, built once per model and engine flags."""
        key = (str(model), repr(sorted(kwargs.items())))
        if key not in engines:
            engines[key] = real_llm(model, **kwargs)
        return engines[key]

    monkeypatch.setattr(deepinfer, "LLM", shared_llm)
    args = [
        "generate",
        "--model",
        "smollm2-135m",
        "--prompt",
        "What is the capital of Japan?",
        "--max-tokens",
        "12",
    ]
    try:
        for flags in ([], ["--chat"]):
            assert main([*args, *flags]) == 0, flags
            chat = capsys.readouterr()
            assert "Tokyo" in chat.out and "(chat template)" in chat.out, flags
            assert "tokens/s" in chat.err and "tokens/s" not in chat.out
        assert main([*args, "--raw"]) == 0
        raw = capsys.readouterr()
        assert "(chat template)" not in raw.out and "text:" in raw.out
        assert len(engines) == 1  # the three runs shared one engine
    finally:
        for llm in engines.values():
            llm.close()
        try:
            out, err = chat_run.communicate("What is the capital of France?\n\n", timeout=600)
        except subprocess.TimeoutExpired:
            chat_run.kill()
            raise
    assert chat_run.returncode == 0, err[-3000:]
    assert "Paris" in out
