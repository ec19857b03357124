"""Speculative-decoding building blocks: the rejection sampler is lossless (its output has the
target's distribution, checked by chi-square), greedy verification is a prefix match, an
oracle draft is always accepted; the n-gram drafter proposes what followed the last match
(checked against the definition on generated sequences, and through its per-slot histories)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.sampling.rejection import rejection_sample
from deepinfer.sampling_params import SamplingParams
from deepinfer.speculative.drafter import DraftRequest
from deepinfer.speculative.ngram import NgramDrafter

# chi-square critical values at p = 0.001 (df -> value), from standard tables
CHI2_999 = {4: 18.47, 24: 51.18}


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """Draft tokens come from q, the target is p (fixed per position, independent of the
    prefix); the first two generated tokens must be distributed as p0 x p1."""
    gen = torch.Generator().manual_seed(0)
    n, k, v = 60_000, 2, 5
    p = torch.softmax(torch.randn(k + 1, v, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(k, v, generator=gen) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    tokens, emitted = rejection_sample(
        p.expand(n, -1, -1),
        q.expand(n, -1, -1),
        drafts,
        torch.rand(n, k, generator=gen),
        torch.empty(n, k + 1, v).exponential_(generator=gen),
    )
    assert bool((emitted >= 1).all()) and bool((emitted <= k + 1).all())
    first = torch.bincount(tokens[:, 0], minlength=v).float()
    assert _chi2(first, p[0] * n) < CHI2_999[v - 1]
    # a step that emitted one token leaves the second to the next step, which samples the
    # (prefix-independent) target p1 directly
    second = torch.where(
        emitted >= 2, tokens[:, 1], torch.multinomial(p[1], n, replacement=True, generator=gen)
    )
    pairs = torch.bincount(tokens[:, 0] * v + second, minlength=v * v).float()
    assert _chi2(pairs, torch.outer(p[0], p[1]).flatten() * n) < CHI2_999[v * v - 1]
    # and the sampler does accept: mean emitted tokens beats one per step
    assert float(emitted.float().mean()) > 1.2


def test_identical_draft_and_target_accept_everything():
    gen = torch.Generator().manual_seed(1)
    n, k, v = 500, 4, 7
    p = torch.softmax(torch.randn(n, k + 1, v, generator=gen), -1)
    drafts = torch.multinomial(p[:, :k].reshape(-1, v), 1, generator=gen).view(n, k)
    noise = torch.empty(n, k + 1, v).exponential_(generator=gen)
    tokens, emitted = rejection_sample(p, p[:, :k], drafts, torch.rand(n, k, generator=gen), noise)
    assert bool((emitted == k + 1).all())
    assert torch.equal(tokens[:, :k], drafts)


def test_greedy_verification_is_a_prefix_match():
    v, k = 6, 4
    target = torch.tensor([[2, 5, 1, 0, 3]])  # the target's argmax at each position
    drafts = torch.tensor([[2, 5, 4, 0]])  # mismatch at position 2
    p = torch.nn.functional.one_hot(target, v).float()
    q = torch.nn.functional.one_hot(drafts, v).float()
    tokens, emitted = rejection_sample(
        p, q, drafts, torch.rand(1, k), torch.empty(1, k + 1, v).exponential_()
    )
    assert tokens.tolist() == [[2, 5, 1, -1, -1]] and emitted.tolist() == [3]
    oracle = target[:, :k]  # the target's own continuation: all accepted plus the bonus
    tokens, emitted = rejection_sample(
        p, torch.nn.functional.one_hot(oracle, v).float(), oracle, torch.rand(1, k), torch.ones(1, k + 1, v)
    )
    assert tokens.tolist() == [[2, 5, 1, 0, 3]] and emitted.tolist() == [5]


def test_ngram_drafter_proposes_what_followed_the_last_match():
    drafter = NgramDrafter(num_speculative_tokens=3, min_n=1, max_n=3)
    assert drafter.lookup([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]
    assert drafter.lookup([5, 6, 7, 5, 6, 8, 5, 6]) == [8, 5, 6]  # the most recent "5 6"
    assert drafter.lookup([1, 2, 3]) == []
    assert drafter.lookup([7, 7]) == [7]
    assert NgramDrafter(num_speculative_tokens=2, min_n=2, max_n=2).lookup([1, 2, 3, 9, 2]) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=3, max_n=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramDrafter(num_speculative_tokens=0)


def _prompt_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The n-gram draft by its definition: the longest suffix of ``min_n``..``max_n`` tokens
    that occurred earlier; what followed its most recent occurrence with ``k`` tokens after
    it, else its earliest occurrence."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        starts = [s for s in range(length - n) if tokens[s : s + n] == tokens[length - n :]]
        if starts:
            full = [s for s in starts if s + n + k <= length]
            s = full[-1] if full else starts[0]
            return tokens[s + n : s + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), max_size=40),
    k=st.integers(1, 6),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
)
def test_ngram_lookup_matches_its_definition(tokens, k, min_n, extra_n):
    drafter = NgramDrafter(k, min_n, min_n + extra_n)
    assert drafter.lookup(tokens) == _prompt_lookup(tokens, k, min_n, min_n + extra_n)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_ngram_proposals_follow_each_slots_requests(data):
    """Proposals read each slot's cached history, extended step by step; a slot reused by a
    new request, or a request given a new output list (shorter or not), must not see the old
    tokens."""
    drafter = NgramDrafter(3, 1, 3)
    params = SamplingParams(max_tokens=8)
    owners: dict[int, tuple[list[int], list[int]]] = {}
    token = st.integers(0, 4)
    for _ in range(data.draw(st.integers(1, 30))):
        slot = data.draw(st.integers(0, 2))
        action = data.draw(st.sampled_from(["grow", "grow", "grow", "new", "copy", "shorten"]))
        if action == "new" or slot not in owners:
            owners[slot] = (data.draw(st.lists(token, min_size=1, max_size=12)), [])
        prompt, output = owners[slot]
        if action == "copy":  # same tokens, a new list
            output = [*output]
        elif action == "shorten":  # a new list with fewer tokens than the slot has seen
            output = output[: len(output) // 2]
        owners[slot] = (prompt, output)
        output.extend(data.draw(st.lists(token, max_size=4)))
        length = len(prompt) + len(output)
        req = DraftRequest(slot, length - 1, [*prompt, *output][-1], params, None, prompt, output)
        (draft,) = drafter.propose([req])
        assert draft.anchor_pos == length - 1
        assert draft.tokens == _prompt_lookup([*prompt, *output], 3, 1, 3)


def test_one_batched_verification_equals_each_request_verified_alone():
    """Drafts of different lengths, greedy and sampled, n-gram (one-hot q) and model drafts
    (their own q): verifying the step's chunks in one call gives each request the tokens
    a lone verification with the same generator state gives, and the same counters."""
    from deepinfer.engine.request import Request
    from deepinfer.engine.scheduler import ScheduledChunk
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.speculative.config import SpeculativeConfig
    from deepinfer.speculative.decoder import SpeculativeDecoder
    from deepinfer.speculative.drafter import Draft
    from deepinfer.speculative.rollback import Rollback

    vocab = 11
    gen = torch.Generator().manual_seed(3)
    cases = []  # (params, draft, logits, model q or None)
    for i, (d, temp) in enumerate([(3, 1.0), (1, 0.0), (5, 0.7), (2, 1.3), (4, 0.0), (3, 1.0)]):
        params = SamplingParams(temperature=temp, top_k=7 if i == 2 else -1, seed=100 + i)
        logits = torch.randn(d + 1, vocab, generator=gen) * 2
        draft = torch.randint(0, vocab, (d,), generator=gen).tolist()
        q = torch.softmax(torch.randn(d, vocab, generator=gen), -1) if i in (3, 5) else None
        cases.append((params, draft, logits, q))

    def run(indices):
        config = SpeculativeConfig(num_speculative_tokens=5)
        spec = SpeculativeDecoder(config, NgramDrafter(5), 100, Rollback([], [], slots=None))
        items = []
        for i in indices:
            params, draft, logits, q = cases[i]
            generator = None if params.greedy else torch.Generator().manual_seed(params.seed)
            req = Request(str(i), None, [1, 2], params, generator, 0.0)
            if q is not None:
                spec.drafts[str(i)] = Draft(1, draft, q, [])
            chunk = ScheduledChunk(req, 1, len(draft) + 1, False, samples=True, draft=tuple(draft))
            items.append((chunk, logits))
        return [v.tokens for v in spec.verify(items)], spec.stats

    together, stats = run(range(len(cases)))
    alone = [run([i])[0][0] for i in range(len(cases))]
    assert together == alone
    assert stats.verify_steps == len(cases) and stats.drafted == sum(len(c[1]) for c in cases)
    assert stats.accepted == sum(len(t) - 1 for t in together)
    for (params, draft, logits, _), tokens in zip(cases, together, strict=True):
        assert 1 <= len(tokens) <= len(draft) + 1 and tokens[:-1] == draft[: len(tokens) - 1]
        if params.greedy:
            target = logits.argmax(-1).tolist()
            assert tokens[-1] == target[len(tokens) - 1]
