"""The research module: ``load_model`` returns a differentiable, hookable, HF-shaped model.

Gradients and the ``labels=`` loss equal transformers' on the same weights (tiny V4, tiny
Llama, SmolLM2), padded batches equal each row alone, hidden states equal transformers'
where both define the tensor, and the model works under hooks, ``functional_call`` and
``torch.compile``."""

from __future__ import annotations

import pytest
import torch
from grad_match import covered_parameters, matched_gradients
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st
from selection_ties import boundary_gap, selection_margins

from deepinfer import load_model
from deepinfer.models.base import CausalLMOutput
from deepinfer.tiny import make_tiny_checkpoint
from deepinfer.weights.catalog import resolve_model


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("research_llama"), arch="llama", seed=5)


@pytest.fixture(scope="module")
def v41_research_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("research_v41"), arch="deepseek_v41", seed=5)


def _hf_llama(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _batch(vocab: int, b: int, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (b, s), generator=gen)
    labels = ids.clone()
    labels[0, : s // 3] = -100  # ignored positions count as transformers counts them
    return ids, labels


def _compare_gradients(ours, theirs, ids, labels, tol: float = 1e-4) -> int:
    mine = ours(ids, labels=labels)
    ref = theirs(ids, labels=labels)
    assert isinstance(mine, CausalLMOutput)
    assert abs(mine.loss.item() - ref.loss.item()) <= 1e-5 * max(1.0, abs(ref.loss.item()))
    mine.loss.backward()
    ref.loss.backward()
    compared = 0
    for name, g_ours, g_ref in matched_gradients(ours, theirs):
        scale = g_ref.norm().item()
        if scale == 0.0:
            assert g_ours.norm().item() <= 1e-8, name
            continue
        rel = (g_ours - g_ref).norm().item() / scale
        assert rel <= tol, f"{name}: relative gradient difference {rel:.2e}"
        compared += 1
    with_grad = {n for n, p in ours.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    missing = with_grad - covered_parameters(ours, theirs)
    assert not missing, f"our parameters with gradients transformers does not hold: {sorted(missing)[:5]}"
    return compared


def test_v4_gradients_and_loss_equal_transformers(v4_ckpt, hf_reference):
    ours, theirs = load_model(v4_ckpt, requires_grad=True), hf_reference(v4_ckpt)
    ids, labels = _batch(ours.config.vocab_size, 2, 20, 0)
    assert _compare_gradients(ours, theirs, ids, labels) > 50


def test_llama_gradients_and_loss_equal_transformers(llama_ckpt):
    ours, theirs = load_model(llama_ckpt, requires_grad=True), _hf_llama(llama_ckpt)
    ids, labels = _batch(ours.config.vocab_size, 2, 20, 1)
    assert _compare_gradients(ours, theirs, ids, labels) == len(list(theirs.parameters()))


def test_smollm2_gradients_and_loss_equal_transformers():
    path = resolve_model("smollm2-135m")
    ours, theirs = load_model(path, requires_grad=True), _hf_llama(path)
    ids, labels = _batch(ours.config.vocab_size, 1, 12, 2)
    assert _compare_gradients(ours, theirs, ids, labels) > 100


@pytest.mark.parametrize("arch", ["v4", "llama"])
def test_hidden_states_equal_transformers(arch, v4_ckpt, llama_ckpt, hf_reference):
    """Embeddings and every layer's output; transformers' last entry is normed (and for V4
    collapsed by ``hc_head``), a different tensor, so it is left out."""
    path = v4_ckpt if arch == "v4" else llama_ckpt
    ours = load_model(path)
    theirs = hf_reference(path) if arch == "v4" else _hf_llama(path)
    ids, _ = _batch(ours.config.vocab_size, 2, 17, 3)
    with torch.no_grad():
        mine = ours(ids, output_hidden_states=True).hidden_states
        ref = theirs(ids, output_hidden_states=True).hidden_states
    assert len(mine) == len(ref) == ours.config.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(mine[:-1], ref[:-1], strict=True)):
        assert a.shape == b.shape, i
        assert (a - b).abs().max().item() <= 1e-4, i
    expected = (2, 17, ours.config.hc_mult, ours.config.hidden_size) if arch == "v4" else (2, 17, 64)
    assert mine[-1].shape == expected


@pytest.fixture(scope="module")
def research_models(v4_ckpt, llama_ckpt, v41_research_ckpt):
    return {
        "v4": load_model(v4_ckpt),
        "llama": load_model(llama_ckpt),
        # V4.1's QAT rounding moves last-bit batch differences to other grid points
        # (RESULTS.md, "V4.1 QAT rounding is not batch-invariant"): the padding
        # comparisons run without it, as the config fuzzer does
        "v41": load_model(v41_research_ckpt, fake_quant=False),
    }


# Relative gap under which a top-k choice counts as a near-tie (the padded
# batch moved V4.1 indexer scores by up to ~7e-6 of their size).
NEAR_TIE = 3e-5


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arch=st.sampled_from(["v4", "llama", "v41"]),
    rows=st.lists(st.tuples(st.integers(1, 40), st.booleans()), min_size=1, max_size=3),
    seed=st.integers(0, 1000),
)
@example(arch="v41", rows=[(29, True), (2, False)], seed=28)  # row 0: a 1.6e-6 indexer tie
def test_padded_batch_equals_each_row_alone(research_models, arch, rows, seed):
    """Left and right padding (random lengths per row): logits at real cells equal the row
    run alone within 1e-5 of the logits' scale (the tiny models' logits reach ~20; a batch
    changes matmul blocking, hence last bits), padded cells are zero. A row whose run alone
    made a top-k choice at a near-tie (last chosen and first unchosen score within
    ``NEAR_TIE``) may choose the other way padded, where both are right: its logits are not
    compared (hypothesis once drew a V4.1 row whose indexer scores tied to 1.5e-6)."""
    model = research_models[arch]
    width = max(n for n, _ in rows) + 3
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, model.config.vocab_size, (len(rows), width), generator=gen)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    spans = []
    for i, (n, left) in enumerate(rows):
        first = width - n if left else 0
        mask[i, first : first + n] = 1
        spans.append((first, n))
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        for i, (first, n) in enumerate(spans):
            with selection_margins() as gaps:
                alone = model(ids[i : i + 1, first : first + n]).logits[0]
            assert not padded[i, :first].any() and not padded[i, first + n :].any()
            if min(gaps, default=float("inf")) < NEAR_TIE:
                note(f"row {i}: a top-k near-tie ({min(gaps):.2e}), logits not compared")
                continue
            scale = max(1.0, alone.abs().max().item())
            assert (padded[i, first : first + n] - alone).abs().max().item() <= 1e-5 * scale


def test_boundary_gap_finds_the_closest_chosen_unchosen_pair():
    rows = torch.tensor([[3.0, 2.0, 1.0], [5.0, 4.0, 4.0 - 2**-16], [2.0, 2.0, 0.5]])
    assert boundary_gap(rows[:1], 1) == pytest.approx(1 / 3)
    assert boundary_gap(rows[1:2], 2) == 2**-16 / 4
    # an exact tie at the boundary is the tie rule's; the next distinct score counts
    assert boundary_gap(rows[2:], 1) == pytest.approx(1.5 / 2)
    assert boundary_gap(torch.tensor([[2.0 + 2**-16, 2.0, 2.0]]), 2) == 2**-16 / 2
    assert boundary_gap(rows, 1) == pytest.approx(1 / 5)  # the closest row: 5 against 4
    assert boundary_gap(torch.tensor([[1.0, float("-inf"), float("-inf")]]), 1) == float("inf")
    assert boundary_gap(rows, 3) == float("inf")  # nothing left unchosen


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_selection_margins_see_every_top_k(research_models, arch):
    """The recorder sees the indexer's, the candidate blocks' and the routers' choices (a row
    alone makes some), and reports the near-tie hypothesis found in a V4.1 row."""
    model = research_models[arch]
    ids = torch.randint(2, model.config.vocab_size, (1, 29), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), selection_margins() as gaps:
        model(ids)
    assert len(gaps) >= 4 and all(g >= 0 for g in gaps)
    if arch == "v41":
        width = 32
        ids = torch.randint(
            2, model.config.vocab_size, (2, width), generator=torch.Generator().manual_seed(28)
        )
        with torch.no_grad(), selection_margins() as gaps:
            model(ids[:1, 3:])
        assert min(gaps) < NEAR_TIE


@pytest.mark.parametrize("arch", ["v4", "llama", "v41"])
def test_hooks_names_functional_call_and_compile(research_models, arch):
    """Forward hooks see each layer's output, ``functional_call`` honours substituted
    parameters, and ``torch.compile`` gives eager's logits within 1e-5 of their scale: with
    its default backend (Inductor, which generates and runs its own kernels) for Llama and
    V4.1; V4's research model, whose host-side routing breaks the graph some thirty times,
    takes two minutes there, so it runs ``aot_eager`` (AOTAutograd's traced, functionalized
    graphs without Inductor's code generation) to keep the suite's time."""
    model = research_models[arch]
    ids, _ = _batch(model.config.vocab_size, 2, 11, 4)
    seen = []
    handle = model.layers[0].register_forward_hook(
        lambda mod, args, out: seen.append(tuple((out[0] if isinstance(out, tuple) else out).shape))
    )
    with torch.no_grad():
        base = model(ids).logits
    handle.remove()
    assert seen and seen[0][:2] == (2, 11)
    embed = model.model.embed_tokens if arch == "llama" else model.embed
    assert embed.weight.shape[0] == model.config.vocab_size
    # functional_call must honour substituted parameters everywhere (experts, fused q/k/v)
    params = {n: p.detach() * 1.01 for n, p in model.named_parameters()}
    with torch.no_grad():
        swapped = torch.func.functional_call(model, params, (ids,)).logits
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.copy_(params[n])
        moved = model(ids).logits
        for n, p in model.named_parameters():
            p.copy_(saved[n])
        backend = "aot_eager" if arch == "v4" else "inductor"
        compiled = torch.compile(model, backend=backend)(ids).logits
    assert (swapped - base).abs().max().item() > 1e-3
    assert (swapped - moved).abs().max().item() <= 1e-5
    # Inductor's fused kernels sum in their own order: last bits of the logits' scale
    tol = 1e-5 * base.abs().max().item()
    assert (compiled - base).abs().max().item() <= tol
    # mutation check: a model whose weights are 1e-4 off is caught by that bound
    nudged = {n: p.detach() * (1 + 1e-4) for n, p in model.named_parameters()}
    with torch.no_grad():
        off = torch.func.functional_call(model, nudged, (ids,)).logits
    assert (off - base).abs().max().item() > tol


def test_research_inputs_are_checked(research_models):
    model = research_models["v4"]
    ids = torch.randint(2, 200, (2, 6))
    cases = [
        ((ids[0],), {}, "input_ids must be a \\[batch, seq\\]"),
        ((ids.float(),), {}, "integer token ids"),
        ((ids,), {"attention_mask": torch.ones(2, 5)}, "shaped like input_ids"),
        ((ids,), {"attention_mask": torch.tensor([[1, 0, 1, 1, 1, 1], [1] * 6])}, "not contiguous"),
        ((ids,), {"attention_mask": torch.full((2, 6), 2)}, "only 0"),
        ((ids,), {"attention_mask": torch.zeros(2, 6)}, "no token"),
        ((ids,), {"labels": ids[:, :3]}, "labels must be shaped"),
        ((ids + 1000,), {}, "token ids must lie in"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model(*args, **kwargs)
