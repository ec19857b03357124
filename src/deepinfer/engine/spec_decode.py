"""Speculative decoding inside the engine: which requests draft, and the verification of a
drafted chunk (``[last token, d drafts]`` computed in one step, ``d + 1`` logits rows).

Drafters: n-gram lookup (no model, a one-hot draft distribution) or a model drafter (DSpark
stages, the MTP layer) that reads the target's features of accepted rows after each step and
proposes for every running request at once; its drafts carry their sampling distribution
``q`` (and DSpark's per-token confidences). Verification is the rejection sampler: accept
draft j with probability ``min(1, p_j(x_j) / q_j(x_j))``, resample from ``norm(max(p_j - q_j, 0))``
at the first rejection, or take a bonus token from ``p_d`` after all d are accepted. Greedy
requests reduce to a prefix match against the target's argmax. Either way the output
distribution is the target's (tests/test_spec_verification.py, tests/test_spec_engine.py).

Only requests whose target distribution needs no history are drafted for (no penalties, logit
bias, pending ``min_tokens`` or logprobs); others decode one token per step as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer.engine.request import Request
from deepinfer.sampling.rejection import acceptance_and_recovery, assemble_tokens
from deepinfer.sampling.sampler import filter_log_probs, needs_history
from deepinfer.speculative.config import SpeculativeConfig
from deepinfer.speculative.drafter import Draft, DraftRequest, ModelDrafter
from deepinfer.speculative.ngram import NgramDrafter
from deepinfer.speculative.schedule import (
    SpsTable,
    capacity_from,
    hardware_schedule,
    lagged_topk_schedule,
    threshold_schedule,
)


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
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        sps: SpsTable | None = None,
        drafter: ModelDrafter | None = None,
        lagged: bool = False,
    ) -> None:
        """``sps``: the steps-per-second table the hardware schedule needs (profiled by the
        engine at start, ``profile_steps_per_second``). ``drafter``: a model drafter (None:
        n-gram lookup). ``lagged``: the hardware schedule's production variant (capacity
        from confidences two steps old, top-K by current survival, no early stop)."""
        self.config = config
        self.max_model_len = max_model_len
        self.ngram: NgramDrafter | None = None
        if drafter is None:
            assert config.num_speculative_tokens is not None
            self.ngram = NgramDrafter(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        self.model_drafter = drafter
        self.lagged = lagged
        self.num_draft_tokens = (
            drafter.num_draft_tokens if drafter is not None else config.num_speculative_tokens
        )
        self.stats = SpecStats()
        self.sps = sps
        k = self.num_draft_tokens
        # acceptance history per draft position: P(accept j | drafts before j accepted). A
        # drafter without a confidence head (n-gram, MTP) uses these rates instead. They do
        # not depend on the drafted tokens' values, so the schedule never anticipates them.
        self.trials, self.accepts = [0] * k, [0] * k
        self.allowed: dict[str, int] = {}  # this step's verify lengths (hardware/threshold)
        self.drafts: dict[str, Draft] = {}  # model drafts waiting for their step
        self._old_confidences: list[list[list[float]]] = []  # lagged variant: two plans back

    # -- which rows the target returns features of --------------------------------------

    def feature_offsets(self, num_tokens: int, num_draft: int) -> list[int]:
        """Chunk offsets whose features a model drafter reads: the last ``window`` rows before
        the drafts, and the drafted rows (the accepted ones become history)."""
        assert self.model_drafter is not None
        first = max(0, num_tokens - num_draft - self.model_drafter.window)
        return list(range(first, num_tokens))

    # -- scheduling ---------------------------------------------------------------------

    def acceptance_rates(self) -> list[float]:
        """Laplace-smoothed acceptance rate per draft position."""
        return [(a + 1) / (t + 2) for a, t in zip(self.accepts, self.trials, strict=True)]

    def confidences(self, req: Request) -> list[float]:
        """Per-position confidences of the request's next draft: the confidence head's when
        the drafter has one, else the positions' acceptance rates."""
        draft = self.drafts.get(req.request_id)
        if self.model_drafter is not None:
            if draft is None or draft.anchor_pos != req.num_tokens - 1:
                return []
            if draft.confidences:
                return draft.confidences[: len(draft.tokens)]
            return self.acceptance_rates()[: len(draft.tokens)]
        return self.acceptance_rates()

    def plan(self, requests: list[Request]) -> None:
        """Before a step: how many drafts each decoding request may verify, for the whole
        batch at once (Algorithm 1, its lagged variant or the threshold rule; static: no
        limit)."""
        schedule = self.config.schedule
        self.allowed = {}
        if schedule == "static" or not requests:
            return
        conf = [self.confidences(r) for r in requests]
        if schedule == "hardware":
            if self.sps is None:
                raise RuntimeError("the hardware schedule needs a steps-per-second table")
            if self.lagged:
                self._old_confidences.append(conf)
                old = self._old_confidences.pop(0) if len(self._old_confidences) > 2 else None
                capacity = (
                    capacity_from(old, self.sps) if old is not None else self.num_draft_tokens * len(conf)
                )
                lengths = lagged_topk_schedule(conf, capacity)
            else:
                lengths = hardware_schedule(conf, self.sps)
        else:
            lengths = threshold_schedule(conf, self.config.confidence_threshold)
        self.allowed = {r.request_id: n for r, n in zip(requests, lengths, strict=True)}

    def draft(self, req: Request, room: int) -> list[int]:
        """Tokens to verify after the request's last token this step (may be empty);
        ``room``: drafts that fit the step's token budget."""
        if not can_draft(req):
            return []
        room = min(
            self.allowed.get(req.request_id, self.num_draft_tokens),
            room,
            req.params.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens,
        )
        if room <= 0:
            return []
        if self.ngram is not None:
            return self.ngram.propose(req.all_token_ids)[:room]
        draft = self.drafts.get(req.request_id)
        if draft is None or draft.anchor_pos != req.num_tokens - 1:
            return []
        return draft.tokens[:room]

    # -- after a step -------------------------------------------------------------------

    def after_step(
        self, rows: list[tuple[Request, int, int]], features: torch.Tensor | None, ready: list[Request]
    ) -> None:
        """Model drafters: store the features of accepted rows (``rows``: request, position,
        its feature row, for every position of the step that is now accepted), then propose
        for the requests ``ready`` to draft next step (all in one batch) unless their draft
        still follows their newest token."""
        drafter = self.model_drafter
        if drafter is None:
            return
        if features is not None and rows:
            slots, positions, next_tokens, feature_rows = [], [], [], []
            sequences: dict[str, list[int]] = {}
            for req, pos, row in rows:
                assert req.slot is not None
                tokens = sequences.get(req.request_id)
                if tokens is None:
                    drafter.claim(req.slot, req.request_id)
                    tokens = sequences[req.request_id] = req.all_token_ids
                slots.append(req.slot)
                positions.append(pos)
                next_tokens.append(tokens[pos + 1])
                feature_rows.append(row)
            picked = features[torch.tensor(feature_rows, dtype=torch.long, device=features.device)]
            drafter.observe(slots, positions, picked, next_tokens)
        asks = []
        for req in ready:
            draft = self.drafts.get(req.request_id)
            if draft is not None and draft.anchor_pos == req.num_tokens - 1:
                continue  # not stepped since: its ring and newest token are unchanged
            self.drafts.pop(req.request_id, None)
            if req.slot is not None and can_draft(req):
                asks.append(
                    (
                        req,
                        DraftRequest(
                            req.slot, req.num_tokens - 1, req.output_token_ids[-1], req.params, req.generator
                        ),
                    )
                )
        for (req, _), draft in zip(asks, drafter.propose([a for _, a in asks]), strict=True):
            if draft.tokens:
                self.drafts[req.request_id] = draft

    def forget(self, req: Request) -> None:
        self.drafts.pop(req.request_id, None)

    # -- verification -------------------------------------------------------------------

    def verify(self, items: list[tuple[Request, list[int], torch.Tensor]]) -> list[list[int]]:
        """Verify every drafted chunk of a step together. ``items``: (request, draft of d
        tokens, logits [d + 1, V] at the chunk's last d + 1 positions). Returns per item the
        tokens to append (accepted drafts, then the recovered or bonus token).

        Greedy requests: one argmax over all their rows, then a prefix match. Sampled ones:
        one rejection-sampling call over the batch padded to the longest draft (a padded
        position has q = 0 and is cut off after, so the token after a row's last draft comes
        from its own p: the bonus); each request's randomness comes from its own generator in
        the order a lone verification would draw it."""
        out: list[list[int] | None] = [None] * len(items)
        greedy = [i for i, (req, _, _) in enumerate(items) if req.params.greedy]
        if greedy:
            target = torch.cat([items[i][2] for i in greedy]).argmax(dim=-1).tolist()
            row = 0
            for i in greedy:
                draft = items[i][1]
                mine = target[row : row + len(draft) + 1]
                row += len(draft) + 1
                accepted = next((j for j in range(len(draft)) if draft[j] != mine[j]), len(draft))
                out[i] = draft[:accepted] + [mine[accepted]]
        sampled = [i for i in range(len(items)) if out[i] is None]
        if sampled:
            for i, tokens in zip(sampled, self._rejection_sample([items[i] for i in sampled]), strict=True):
                out[i] = tokens
        results: list[list[int]] = []
        for (req, draft, _), tokens in zip(items, out, strict=True):
            assert tokens is not None
            self._count(req, len(draft), len(tokens) - 1)
            results.append(tokens)
        return results

    def _rejection_sample(self, items: list[tuple[Request, list[int], torch.Tensor]]) -> list[list[int]]:
        dev = items[0][2].device
        k = max(len(draft) for _, draft, _ in items)
        vocab = items[0][2].shape[-1]
        rows = torch.cat([logits for _, _, logits in items])
        params = [req.params for req, draft, _ in items for _ in range(len(draft) + 1)]
        probs_flat = filter_log_probs(
            rows.float(),
            torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([p.top_k for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
            torch.tensor([p.min_p for p in params], device=dev),
        ).exp()
        n = len(items)
        probs = torch.full((n, k + 1, vocab), 1.0 / vocab, device=dev)
        q = torch.zeros(n, k, vocab, device=dev)
        drafted = torch.zeros(n, k, dtype=torch.long, device=dev)
        uniform = torch.zeros(n, k, device=dev)
        noise = torch.ones(n, k + 1, vocab, device=dev)
        row = 0
        for b, (req, draft, _) in enumerate(items):
            d = len(draft)
            probs[b, : d + 1] = probs_flat[row : row + d + 1]
            row += d + 1
            drafted[b, :d] = torch.tensor(draft, dtype=torch.long, device=dev)
            model_draft = self.drafts.get(req.request_id)
            if model_draft is not None and model_draft.q is not None:
                q[b, :d] = model_draft.q[:d].to(dev, q.dtype)
            else:  # n-gram: the draft is deterministic given the history, q is one-hot
                q[b, torch.arange(d, device=dev), drafted[b, :d]] = 1.0
            gen = req.generator
            uniform[b, :d] = torch.rand(d, generator=gen, device=dev)
            noise[b, : d + 1] = torch.empty(d + 1, vocab, device=dev).exponential_(generator=gen)
        accepted, recovered = acceptance_and_recovery(probs, q, drafted, uniform, noise)
        lengths = torch.tensor([len(draft) for _, draft, _ in items], device=dev)
        accepted = torch.minimum(accepted, lengths)
        tokens = assemble_tokens(drafted, accepted, recovered).tolist()
        return [t[: int(a) + 1] for t, a in zip(tokens, accepted.tolist(), strict=True)]

    def _count(self, req: Request, drafted: int, accepted: int) -> None:
        self.stats.verify_steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        for j in range(min(accepted + 1, drafted)):  # positions that were tested
            self.trials[j] += 1
            self.accepts[j] += j < accepted
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted


def build_model_drafter(model, config: SpeculativeConfig, num_slots: int) -> ModelDrafter | None:
    """The drafter ``config.method`` names, over the target's own draft layers (None: n-gram)."""
    if config.method == "dspark":
        from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
        from deepinfer.speculative.dspark import DSparkDrafter

        if not isinstance(model, DeepseekV41ForCausalLM):
            raise ValueError(
                f"speculative.method='dspark' needs a DeepSeek-V4.1 model, not {type(model).__name__}"
            )
        return DSparkDrafter(model, num_slots, config.num_speculative_tokens)
    if config.method == "mtp":
        from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
        from deepinfer.speculative.mtp import MtpDrafter

        if not isinstance(model, DeepseekV4ForCausalLM):
            raise ValueError(
                f"speculative.method='mtp' needs a DeepSeek-V4 model, not {type(model).__name__}"
            )
        return MtpDrafter(model, num_slots, config.num_speculative_tokens)
    return None


def profile_steps_per_second(runner, max_tokens: int, repeats: int = 3) -> SpsTable:
    """The target's steps per second at batch sizes 1, 2, 4, ... up to ``max_tokens`` tokens,
    measured at engine start on steps of null tokens (they touch only the null block and
    slot). Decode cost at short context; the schedule needs the shape of the curve."""
    from deepinfer.cache.step_metadata import StepPadding, build_forward_batch

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
