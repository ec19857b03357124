"""Training a DSpark head (``deepinfer.drafter_training``, ``deepinfer train-drafter``).

- the recipe is deterministic from its seed (generation, features, training, calibration);
- training learns: the loss falls and the trained head's held-out drafts are accepted more
  often than an untrained head's;
- sequential temperature scaling calibrates a miscalibrated head (and a calibration that does
  nothing fails the same check);
- the command writes a head the engine serves with greedy outputs unchanged, and rejects bad
  flags with a clear error.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
from dspark_heads import TINY_HEAD_SHAPE
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main as cli
from deepinfer.drafter_training import train as training
from deepinfer.drafter_training.dataset import DistillSet
from deepinfer.drafter_training.recipe import (
    DATA_FILE,
    DATA_SETTINGS,
    LOG_FILE,
    default_layers,
    train_drafter,
)
from deepinfer.drafter_training.train import TrainOptions, expected_calibration_error
from deepinfer.tiny import make_tiny_checkpoint

SHAPE = TINY_HEAD_SHAPE
SETTINGS = {"prompts": 48, "max_tokens": 32, "sampled_fraction": 0.25, "held_out_fraction": 0.2}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("train_target"), arch="llama", num_hidden_layers=4)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    options = TrainOptions(
        steps=100, lr=3e-3, warmup=5, sequences_per_step=4, anchors_per_sequence=8, log_every=5
    )
    summary = train_drafter(target, out, options=options, head_shape=SHAPE, **SETTINGS)
    return out, summary, options


def test_the_recipe_is_deterministic_from_its_seed(target, trained, tmp_path):
    out, _, options = trained
    again = tmp_path / "again"
    train_drafter(target, again, options=options, head_shape=SHAPE, **SETTINGS)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    data_a, data_b = DistillSet.load(out / DATA_FILE), DistillSet.load(again / DATA_FILE)
    assert torch.equal(data_a.tokens, data_b.tokens) and torch.equal(data_a.features, data_b.features)


def test_training_learns_to_draft(target, trained, tmp_path):
    """The loss falls, and held-out drafts are accepted far more often than the same head's
    at its starting point (the recipe with a learning rate of 0, on the same data)."""
    out, summary, options = trained
    log = json.loads((out / LOG_FILE).read_text())["log"]
    assert log[-1]["loss"] < 0.8 * log[0]["loss"]
    start = tmp_path / "start"
    start.mkdir()
    for name in (DATA_FILE, DATA_SETTINGS):
        shutil.copy(out / name, start / name)
    frozen = dataclasses.replace(options, steps=1, lr=0.0, warmup=1)
    untrained = train_drafter(target, start, options=frozen, head_shape=SHAPE, **SETTINGS)
    trained_tokens = summary["held_out_calibrated"]["tokens_per_step"]
    untrained_tokens = untrained["held_out_calibrated"]["tokens_per_step"]
    assert trained_tokens > untrained_tokens + 1.0, (trained_tokens, untrained_tokens)


def _miscalibrated(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits whose true per-row acceptance is sigmoid(logit / 3): survival drawn from it."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6000, 4, generator=gen) * 4
    accepted = torch.rand(6000, 4, generator=gen) < torch.sigmoid(logits / 3)
    survived = torch.cumprod(accepted.int(), dim=1).bool()
    return logits, survived, torch.ones_like(survived)


def _ece_after_calibration(seed: int) -> tuple[float, float]:
    logits, survived, valid = _miscalibrated(seed)
    temps = training.calibrate(logits[:3000], survived[:3000], valid[:3000])
    after = training.survival(logits[3000:], temps)
    before = training.survival(logits[3000:], torch.ones(4))
    eces = [
        max(expected_calibration_error(s[:, k], survived[3000:, k]) for k in range(4))
        for s in (before, after)
    ]
    return eces[0], eces[1]


def test_sequential_temperature_scaling_calibrates():
    before, after = _ece_after_calibration(0)
    assert before > 0.05 and after < 0.03, (before, after)


def test_a_calibration_that_does_nothing_fails_the_check(monkeypatch):
    """Mutation check of the test above."""
    monkeypatch.setattr(training, "calibrate", lambda logits, survived, valid: torch.ones(logits.shape[1]))
    _, after = _ece_after_calibration(0)
    assert not after < 0.03


@given(st.integers(2, 200), st.integers(1, 8))
def test_default_layers_spread_inside_the_target(num_layers, count):
    ids = default_layers(num_layers, count)
    assert ids == sorted(set(ids)) and all(1 <= i < num_layers for i in ids)
    assert len(ids) <= count and (count == 1 or num_layers == 2 or ids[-1] == num_layers - 1)


def test_the_command_writes_a_head_the_engine_serves(target, tmp_path, capsys):
    out = tmp_path / "head"
    flags = [
        "--steps",
        "3",
        "--prompts",
        "8",
        "--max-tokens",
        "12",
        "--num-layers",
        "1",
        "--markov-rank",
        "4",
    ]
    assert (
        cli(["train-drafter", str(target), "--out", str(out), *flags, "--plot", str(tmp_path / "loss.png")])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["out"] == str(out)
    assert (tmp_path / "loss.png").stat().st_size > 0
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 2}, {"prompt_token_ids": [30, 31]}]
    plain = [o.outputs[0].token_ids for o in LLM(target).generate(prompts, params, use_tqdm=False)]
    llm = LLM(target, speculative_config={"method": "dspark", "model": str(out), "adaptive": False})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--layers", "1,x"], "--layers must be comma-separated integers"),
        (["--sampled-fraction", "2"], r"--sampled-fraction must be in \[0, 1\]"),
        (["--layers", "0,9"], r"reads layers \[0, 9\]"),
    ],
)
def test_bad_flags_are_clear_errors(target, tmp_path, capsys, flags, message):
    assert cli(["train-drafter", str(target), "--out", str(tmp_path / "x"), *flags]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_a_checkpoint_directory_needs_an_output_directory(target, capsys):
    assert cli(["train-drafter", str(target)]) == 2
    assert "--out is required" in capsys.readouterr().err
