"""Speculative decoding inside the engine: which requests draft, and the verification of a
drafted chunk (``[last token, d drafts]`` computed in one step, ``d + 1`` logits rows).

Drafts come from a drafter with no probabilities of its own (n-gram lookup), i.e. a one-hot
draft distribution, so verification is the rejection sampler with ``q = one_hot(draft)``:
accept draft j with probability ``p_j(x_j)``, resample from ``p_j`` without ``x_j`` at the first
rejection, or take a bonus token from ``p_d`` after all d are accepted. Greedy requests reduce
to a prefix match against the target's argmax. Either way the output distribution is the
target's (tests/test_spec_verification.py, tests/test_spec_engine.py).

Only requests whose target distribution needs no history are drafted for (no penalties, logit
bias, pending ``min_tokens`` or logprobs); others decode one token per step as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer.engine.request import Request
from deepinfer.sampling.rejection import rejection_sample
from deepinfer.sampling.sampler import filtered_log_probs, needs_history
from deepinfer.spec.config import SpeculativeConfig
from deepinfer.spec.ngram import NgramDrafter
from deepinfer.spec.schedule import SpsTable, hardware_schedule, threshold_schedule


def can_draft(req: Request) -> bool:
    """Drafts are verified against the plain filtered distribution, so a request qualifies
    only when no processor would change it along the draft (a presence or frequency penalty
    would, once the drafts count as output) and no logprobs are asked for."""
    p = req.params
    return not (
        needs_history(p, req.output_token_ids)
        or p.presence_penalty
        or p.frequency_penalty
        or p.logprobs is not None
    )


@dataclass
class SpecStats:
    """Engine-wide counters (per-request ones live on the Request)."""

    verify_steps: int = 0  # drafted chunks verified
    drafted: int = 0
    accepted: int = 0
    engine_steps: int = 0  # engine steps that verified at least one drafted chunk

    @property
    def verified_tokens_per_step(self) -> float:
        """Tokens the target checked per such step (anchors + drafts, over all requests)."""
        return (self.drafted + self.verify_steps) / self.engine_steps if self.engine_steps else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified chunk (accepted drafts + the final token)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, sps: SpsTable | None = None) -> None:
        """``sps``: the steps-per-second table the hardware schedule needs (profiled by the
        engine at start, ``profile_steps_per_second``)."""
        self.config = config
        self.max_model_len = max_model_len
        self.drafter = NgramDrafter(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self.stats = SpecStats()
        self.sps = sps
        k = config.num_speculative_tokens
        # acceptance history per draft position: P(accept j | drafts before j accepted). The
        # n-gram drafter has no confidence head; these rates stand in for it. They do not
        # depend on the drafted tokens' values, so the schedule never anticipates them.
        self.trials, self.accepts = [0] * k, [0] * k
        self.allowed: dict[str, int] = {}  # this step's verify lengths (hardware/threshold)

    def confidences(self) -> list[float]:
        """Laplace-smoothed acceptance rate per draft position."""
        return [(a + 1) / (t + 2) for a, t in zip(self.accepts, self.trials, strict=True)]

    def plan(self, requests: list[Request]) -> None:
        """Before a step: how many drafts each decoding request may verify, for the whole
        batch at once (Algorithm 1 or the threshold rule; static: no limit)."""
        schedule = self.config.schedule
        self.allowed = {}
        if schedule == "static" or not requests:
            return
        conf = [self.confidences()] * len(requests)
        if schedule == "hardware":
            if self.sps is None:
                raise RuntimeError("the hardware schedule needs a steps-per-second table")
            lengths = hardware_schedule(conf, self.sps)
        else:
            lengths = threshold_schedule(conf, self.config.confidence_threshold)
        self.allowed = {r.request_id: n for r, n in zip(requests, lengths, strict=True)}

    def draft(self, req: Request, budget: int) -> list[int]:
        """Tokens to verify after the request's last token this step (may be empty)."""
        if not can_draft(req):
            return []
        room = min(
            self.allowed.get(req.request_id, self.config.num_speculative_tokens),
            budget - 1,
            req.params.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens,
        )
        if room <= 0:
            return []
        return self.drafter.propose(req.all_token_ids)[:room]

    def verify(self, req: Request, draft: list[int], logits: torch.Tensor) -> list[int]:
        """``logits`` [d + 1, V] at the chunk's positions -> tokens to append (accepted drafts,
        then the recovered or bonus token)."""
        d = len(draft)
        if req.params.greedy:
            target = logits.argmax(dim=-1).tolist()
            accepted = next((j for j in range(d) if draft[j] != target[j]), d)
            tokens = draft[:accepted] + [target[accepted]]
        else:
            probs = torch.stack([filtered_log_probs(row, req.params) for row in logits]).exp()
            drafted = torch.tensor([draft], dtype=torch.long, device=logits.device)
            q = torch.nn.functional.one_hot(drafted, probs.shape[-1]).to(probs.dtype)
            gen = req.generator
            uniform = torch.rand(1, d, generator=gen, device=logits.device)
            noise = torch.empty(1, d + 1, probs.shape[-1], device=logits.device).exponential_(generator=gen)
            out, emitted = rejection_sample(probs.unsqueeze(0), q, drafted, uniform, noise)
            tokens = out[0, : int(emitted[0])].tolist()
            accepted = len(tokens) - 1
        self.stats.verify_steps += 1
        self.stats.drafted += d
        self.stats.accepted += accepted
        for j in range(min(accepted + 1, d)):  # positions that were tested
            self.trials[j] += 1
            self.accepts[j] += j < accepted
        req.num_draft_tokens += d
        req.num_accepted_tokens += accepted
        return tokens


def profile_steps_per_second(runner, max_tokens: int, repeats: int = 3) -> SpsTable:
    """The target's steps per second at batch sizes 1, 2, 4, ... up to ``max_tokens`` tokens,
    measured at engine start on steps of null tokens (they touch only the null block and
    slot). Decode cost at short context; the schedule needs the shape of the curve."""
    from deepinfer.engine.paged_cache import StepPadding, build_forward_batch

    sizes, b = [], 1
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    sizes.append(max_tokens)
    rates = []
    for size in sizes:
        padding = StepPadding(runner.null_block, runner.null_slot, size)
        positions, batch = build_forward_batch(runner.layout, runner.pools, [], runner.device, padding)
        ids = torch.zeros(size, dtype=torch.long, device=runner.device)
        best = float("inf")
        with torch.inference_mode():
            for _ in range(repeats):
                start = time.perf_counter()
                runner.forward(ids, positions, batch)
                if runner.device.type == "cuda":
                    torch.cuda.synchronize(runner.device)
                best = min(best, time.perf_counter() - start)
        rates.append(1.0 / best)
    return SpsTable(tuple(sizes), tuple(rates))
