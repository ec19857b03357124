"""A Python process started in the repository root imports third-party packages, not our folders.

``python -m pytest`` and ``python -c`` run from the root put the root first on ``sys.path``,
where our ``kernels/`` folder (import name ``deepinfer.kernels``) would shadow the third-party
``kernels`` package that transformers imports. ``kernels/__init__.py`` hands such an import over.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def run_in_root(code: str, *python_flags: str) -> subprocess.CompletedProcess[str]:
    """Runs ``code`` with the repository root as working directory and first on ``sys.path``."""
    prelude = f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
    return subprocess.run(
        [sys.executable, *python_flags, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_transformers_loads_a_checkpoint_from_the_root(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    done = run_in_root(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
        logits = model(torch.tensor([[1, 2, 3]])).logits
        assert logits.shape == (1, 3, 64), logits.shape
        import kernels
        print("kernels from", kernels.__file__)
        """
    )
    assert done.returncode == 0, done.stderr
    # transformers' own dependency, when present, is the package it got (not our folder)
    assert str(ROOT / "kernels") not in done.stdout, done.stdout


def test_a_third_party_kernels_package_wins_over_our_folder(tmp_path: Path) -> None:
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("WHO = 'third party'\n")
    (other / "sub.py").write_text("WHAT = 'its submodule'\n")
    done = run_in_root(
        f"""
        sys.path.insert(1, {str(tmp_path / "site")!r})  # after the root, before site-packages
        import kernels
        import kernels.sub
        assert kernels.WHO == "third party", kernels.__file__
        assert kernels.sub.WHAT == "its submodule"
        import deepinfer.kernels
        assert "fused_moe" in deepinfer.kernels.__all__
        assert sys.modules["kernels"] is kernels
        """
    )
    assert done.returncode == 0, done.stderr


def test_without_a_third_party_kernels_the_import_reads_as_not_installed() -> None:
    """With no third-party ``kernels`` (-S: no site-packages), ``import kernels`` gives an empty
    namespace package, as for a folder without ``__init__.py``: transformers' availability
    check (find_spec, no metadata, import, no version and no ``__file__``) reads it as absent
    instead of failing its own import."""
    done = run_in_root(
        """
        import importlib
        import importlib.util
        assert importlib.util.find_spec("kernels") is not None
        package = importlib.import_module("kernels")
        assert getattr(package, "__version__", "N/A") == "N/A"
        assert getattr(package, "__file__", None) is None
        try:
            import kernels.cpu.fp8  # none of our modules under the third-party name
        except ModuleNotFoundError:
            print("absent")
        """,
        "-S",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "absent"
