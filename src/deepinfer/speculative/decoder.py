"""``SpeculativeDecoder``: speculative decoding behind the few calls the engine makes.

Per step: the scheduler asks ``plan`` (how many drafts each decoding request may verify, for
the whole batch) and ``draft`` (the tokens to append to a request's chunk); the engine calls
``before_step`` with the scheduled chunks, ``verify`` with the logits of the drafted ones,
``roll_back`` for each verified chunk that did not finish its request, and ``after_step``,
where the drafter reads the target's features of accepted rows and proposes the next drafts
(all running requests in one batch). ``forget`` drops what a finished request left.

Only requests whose target distribution needs no history are drafted for (no penalties, logit
bias, pending ``min_tokens`` or logprobs); others decode one token per step as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepinfer.sampling.sampler import needs_history
from deepinfer.sampling_params import SamplingParams
from deepinfer.speculative.adaptive import AdaptiveDrafting
from deepinfer.speculative.config import SpeculativeConfig
from deepinfer.speculative.drafter import Draft, Drafter, DraftRequest
from deepinfer.speculative.rollback import Rollback
from deepinfer.speculative.schedule import (
    SpsTable,
    StepCostFit,
    capacity_from,
    hardware_schedule,
    lagged_topk_schedule,
    survival,
    threshold_schedule,
)
from deepinfer.speculative.stats import SpecStats
from deepinfer.speculative.verify import DraftedRows, verify


class SequenceState(Protocol):
    """What speculative decoding reads (and counts) of an engine request."""

    request_id: str
    params: SamplingParams
    generator: torch.Generator | None
    slot: int | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    restore_overlap: bool
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def num_tokens(self) -> int: ...


class Chunk(Protocol):
    """A scheduled chunk: positions ``[start, end)`` of ``request``, the last ``len(draft)``
    of them drafted."""

    request: SequenceState
    start: int
    num_tokens: int
    restore_overlap: bool
    draft: Sequence[int]

    @property
    def end(self) -> int: ...


class DraftingRank(Protocol):
    """What drafting reads of one (data-parallel rank's) scheduler."""

    running: list[Any]
    waiting: Sequence[Any]

    def may_draft(self, request: Any) -> bool: ...


@dataclass
class VerifiedChunk:
    """A drafted chunk after verification: the tokens to append, one logits row each."""

    chunk: Chunk
    tokens: list[int]
    logits: torch.Tensor
    anchor: int  # position of the chunk's newest token before the drafts


def _token_at(req: SequenceState, position: int) -> int:
    """Token ``position`` of the sequence, without joining prompt and output."""
    prompt = req.prompt_token_ids
    return prompt[position] if position < len(prompt) else req.output_token_ids[position - len(prompt)]


def can_draft(req: SequenceState) -> bool:
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


# a request's own acceptance history weighs as much as this many trials of the global one
# before it has any: two verifications already separate a copying request from a free one
REQUEST_PRIOR_TRIALS = 2.0
# a model drafter's proposal is a forward of its own: requests whose drafts are not being
# verified (paused, or kept from drafting in a closed batch) propose only every
# SHADOW_STRIDE-th step, all in that step's one batch, enough shadow trials to notice when
# they should draft again
SHADOW_STRIDE = 8


class SpeculativeDecoder:
    """Drafting, verification scheduling, verification and rollback for the engine (see the
    module docstring for the calls). One ``Drafter`` serves every method."""

    def __init__(
        self,
        config: SpeculativeConfig,
        drafter: Drafter,
        max_model_len: int,
        rollback: Rollback,
        sps: SpsTable | None = None,
        lagged: bool = False,
    ) -> None:
        """``sps``: the steps-per-second table the hardware schedule needs (profiled by the
        engine at start). ``lagged``: the hardware schedule's production variant (capacity
        from confidences two steps old, top-K by current survival, no early stop), which an
        asynchronous engine needs."""
        self.config = config
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.rollback = rollback
        self.sps = sps
        self.lagged = lagged
        self.num_draft_tokens = drafter.num_draft_tokens
        self.stats = SpecStats()
        k = self.num_draft_tokens
        # acceptance history per draft position: P(accept j | drafts before j accepted), over
        # all requests and per request. A drafter without a confidence head (n-gram, MTP) uses
        # each request's own rates, drawn towards the global ones while it has few trials
        # (copy-heavy and free-form requests accept very differently). They do not depend on
        # the drafted tokens' values, so the schedule never anticipates them.
        self.trials, self.accepts = [0] * k, [0] * k
        self._request_history: dict[str, tuple[list[int], list[int]]] = {}  # trials, accepts
        self.allowed: dict[str, int] = {}  # this step's verify lengths (hardware/threshold)
        self.drafts: dict[str, Draft] = {}  # drafts waiting for their step
        self._old_confidences: list[list[list[float]]] = []  # lagged variant: two plans back
        self._accepted_end: dict[str, int] = {}  # this step's verified chunks: accepted positions
        self.adaptive = AdaptiveDrafting() if config.adaptive else None
        self.step_cost = StepCostFit()  # the engine's own decode/verify step times (CPU)
        # inside ``closed()`` (LLM.generate): the requests the engine holds are all there will
        # be until they finish, so the batch's end is what counts, not any one request's
        self.closed_batch = False
        self._shadow_trials: dict[str, list[Draft]] = {}  # paused requests: drafts being scored
        self._steps = 0  # steps seen by ``after_step`` (the shadow proposals' stride)
        self._kept_from_drafting: set[str] = set()  # this step's closed-batch rule

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        """A closed batch for the block: no request arrives until it ends."""
        self.closed_batch = True
        try:
            yield
        finally:
            self.closed_batch = False

    # -- scheduling (called by the scheduler) -------------------------------------------

    def acceptance_rates(self, request_id: str | None = None) -> list[float]:
        """Laplace-smoothed acceptance rate per draft position over all requests; with
        ``request_id``, that request's own rates with the global ones as a prior worth
        ``REQUEST_PRIOR_TRIALS`` trials."""
        rates = [(a + 1) / (t + 2) for a, t in zip(self.accepts, self.trials, strict=True)]
        return rates if request_id is None else self._own_rates(request_id, rates)

    def _own_rates(self, request_id: str, pooled: list[float]) -> list[float]:
        """The request's own rates drawn towards ``pooled`` (the global ones)."""
        own = self._request_history.get(request_id)
        if own is None:
            return pooled
        w = REQUEST_PRIOR_TRIALS
        return [(a + w * g) / (t + w) for t, a, g in zip(own[0], own[1], pooled, strict=True)]

    def _paused(self, req: SequenceState) -> bool:
        return self.adaptive is not None and not self.adaptive.drafting(req.request_id)

    def _current_draft(self, req: SequenceState) -> Draft | None:
        draft = self.drafts.get(req.request_id)
        return draft if draft is not None and draft.anchor_pos == req.num_tokens - 1 else None

    def confidences(self, req: SequenceState) -> list[float]:
        """Per-position confidences of the request's next draft: the drafter's (DSpark's
        confidence head) when it gives them, else the positions' acceptance rates."""
        draft = self._current_draft(req)
        if draft is None or self._paused(req):
            return []
        if draft.confidences:
            return draft.confidences[: len(draft.tokens)]
        return self.acceptance_rates(req.request_id)[: len(draft.tokens)]

    def plan(
        self, requests: list[SequenceState], running: Sequence[SequenceState] = (), num_waiting: int = 0
    ) -> None:
        """Before a step: how many drafts each decoding request may verify, for the whole
        batch at once (Algorithm 1, its lagged variant or the threshold rule; static: no
        limit), then, in a closed batch with adaptive drafting, none for the requests whose
        drafts cannot shorten it. ``running``: every running request (decoding or not);
        ``num_waiting``: requests queued for a slot."""
        self.allowed = {}
        self._kept_from_drafting = set()
        if not requests:
            return
        schedule = self.config.schedule
        if schedule != "static":
            conf = [self.confidences(r) for r in requests]
            if schedule == "hardware":
                if self.sps is None:
                    raise RuntimeError("the hardware schedule needs a steps-per-second table")
                sps = self.step_cost.line() or self.sps  # measured steps once there are enough
                if self.lagged:
                    self._old_confidences.append(conf)
                    old = self._old_confidences.pop(0) if len(self._old_confidences) > 2 else None
                    capacity = (
                        capacity_from(old, sps) if old is not None else self.num_draft_tokens * len(conf)
                    )
                    lengths = lagged_topk_schedule(conf, capacity)
                else:
                    lengths = hardware_schedule(conf, sps)
            else:
                lengths = threshold_schedule(conf, self.config.confidence_threshold)
            self.allowed = {r.request_id: n for r, n in zip(requests, lengths, strict=True)}
        if self.closed_batch and self.adaptive is not None and num_waiting == 0 and len(running) > 1:
            self._kept_from_drafting = set(self._cannot_shorten(requests, running))
            for rid in self._kept_from_drafting:
                self.allowed[rid] = 0

    def _cannot_shorten(self, requests: list[SequenceState], running: Sequence[SequenceState]) -> list[str]:
        """A closed batch (nothing waits, nothing more will come) ends with its slowest
        request, so drafts pay only for requests that could be the last to finish. The
        batch's end is estimated as the largest, over running requests, of remaining tokens
        over expected tokens per step (one plus the survival of its drafts by its own
        acceptance rates; one for a paused or non-decoding request, or one whose drafts have
        no history yet). A decoding request whose remaining tokens, one per step, would end
        by then gains nothing from drafting; its drafts would only cost the rows that are
        rejected. Its drafts are scored as shadow trials instead, so its rates are
        learnt before it verifies anything. Remaining tokens are ``max_tokens``' (an end of
        sequence is not foreseen), so requests with equal budgets draft only when all the
        slow ones can; any request drafts again once it is the one left."""
        drafting = {r.request_id for r in requests if not self._paused(r)}
        pooled = self.acceptance_rates()  # once per step, not once per request

        def remaining(r: SequenceState) -> int:
            return max(
                0, min(r.params.max_tokens - len(r.output_token_ids), self.max_model_len - r.num_tokens)
            )

        def per_step(r: SequenceState) -> float:
            if r.request_id not in drafting or r.request_id not in self._request_history:
                return 1.0
            return 1.0 + sum(survival(self._own_rates(r.request_id, pooled)))

        end = max(remaining(r) / per_step(r) for r in running)
        return [r.request_id for r in requests if remaining(r) <= end]

    def step_drafts(
        self, ranks: Sequence[DraftingRank], room: int, trim: Callable[[Any, list[int]], list[int]]
    ) -> dict[str, list[int]]:
        """A step's drafts as data, by request id: each rank's decoding requests get their
        verification lengths planned together (``plan``), then their drafts of at most
        ``room`` tokens, cut by ``trim`` (where the request's grammar rejects them)."""
        drafts: dict[str, list[int]] = {}
        for rank in ranks:
            ready = [r for r in rank.running if rank.may_draft(r)]
            self.plan(ready, rank.running, len(rank.waiting))
            for r in ready:
                draft = self.draft(r, room)
                if draft:
                    drafts[r.request_id] = trim(r, draft)
        return drafts

    def draft(self, req: SequenceState, room: int) -> list[int]:
        """Tokens to verify after the request's last token this step (may be empty);
        ``room``: drafts that fit the step's token budget."""
        if not can_draft(req) or self._paused(req):
            return []
        room = min(
            self.allowed.get(req.request_id, self.num_draft_tokens),
            room,
            req.params.max_tokens - len(req.output_token_ids) - 1,
            self.max_model_len - req.num_tokens,
        )
        draft = self._current_draft(req)
        if room <= 0 or draft is None:
            return []
        return draft.tokens[:room]

    # -- a step (called by the engine) --------------------------------------------------

    def observe_step(self, rows: int, seconds: float) -> None:
        """A decode or verification step of ``rows`` rows took ``seconds`` in the forward
        (the hardware schedule's cost of a row, measured where the engine can time it)."""
        self.step_cost.observe(rows, seconds)

    def before_step(self, chunks: list[Chunk]) -> None:
        for c in chunks:
            self.rollback.before_step(c)

    def verify(self, drafted: list[tuple[Chunk, torch.Tensor]]) -> list[VerifiedChunk]:
        """Verify every drafted chunk of a step together (``drafted``: each chunk with the
        logits [d + 1, V] of its last d + 1 positions)."""
        if not drafted:
            return []
        self.stats.engine_steps += 1
        items = []
        for c, logits in drafted:
            req = c.request
            model_draft = self.drafts.get(req.request_id)
            q = model_draft.q if model_draft is not None else None
            items.append(DraftedRows(req.params, req.generator, list(c.draft), q, logits))
        out = []
        for (c, logits), tokens in zip(drafted, verify(items), strict=True):
            # a confidence head's scores (DSpark), for the calibration figures
            model_draft = self.drafts.get(c.request.request_id)
            confidences = model_draft.confidences if model_draft is not None else None
            self.stats.record_positions(len(c.draft), len(tokens) - 1, confidences or None)
            self._count(c.request, len(c.draft), len(tokens) - 1)
            anchor = c.end - len(c.draft) - 1
            self._accepted_end[c.request.request_id] = anchor + len(tokens)
            out.append(VerifiedChunk(c, tokens, logits, anchor))
        return out

    def roll_back(self, verified: VerifiedChunk) -> None:
        """After the verified tokens are appended (the request goes on): set the computed
        count to the positions whose cache state is valid (the last token is not computed)."""
        self.rollback.apply(verified.chunk, verified.anchor + len(verified.tokens))

    def after_step(
        self,
        featured: list[tuple[Chunk, tuple[int, int]]],
        features: torch.Tensor | None,
        ready: list[SequenceState],
    ) -> None:
        """``featured``: each running request's chunk with (its first feature row, the chunk
        offset of that row); the drafter stores the features of the rows now accepted. Then
        it proposes for the requests ``ready`` to draft next step (all in one batch) unless
        their draft still follows their newest token."""
        self._steps += 1
        rows = self._accepted_rows(featured)
        verified = set(self._accepted_end)
        self._accepted_end = {}
        if features is not None and rows:
            slots, positions, next_tokens, feature_rows = [], [], [], []
            claimed: set[str] = set()
            for req, pos, row in rows:
                assert req.slot is not None
                if req.request_id not in claimed:
                    self.drafter.claim(req.slot, req.request_id)
                    claimed.add(req.request_id)
                slots.append(req.slot)
                positions.append(pos)
                next_tokens.append(_token_at(req, pos + 1))
                feature_rows.append(row)
            picked = features[torch.tensor(feature_rows, dtype=torch.long, device=features.device)]
            self.drafter.observe(slots, positions, picked, next_tokens)
        asks = []
        for req in ready:
            if self._current_draft(req) is not None:
                continue  # not stepped since: its ring and newest token are unchanged
            old = self.drafts.pop(req.request_id, None)
            paused = self._paused(req)
            if paused or (self.closed_batch and req.request_id not in verified):
                self._score_shadow_trials(req, old)
            unverified = paused or req.request_id in self._kept_from_drafting
            if unverified and self.drafter.window and self._steps % SHADOW_STRIDE:
                continue  # a costly proposal nobody will verify: only every few steps
            if req.slot is not None and can_draft(req):
                ask = DraftRequest(
                    req.slot,
                    req.num_tokens - 1,
                    req.output_token_ids[-1],
                    req.params,
                    req.generator,
                    req.prompt_token_ids,
                    req.output_token_ids,
                )
                asks.append((req, ask))
        for (req, _), draft in zip(asks, self.drafter.propose([a for _, a in asks]), strict=True):
            if draft.tokens:
                self.drafts[req.request_id] = draft

    def _score_shadow_trials(self, req: SequenceState, newest: Draft | None) -> None:
        """A request whose drafts were not verified (paused, or kept from drafting in a closed
        batch): open a shadow trial with ``newest`` (the draft that followed the token before
        the newest one), then score every open trial against the tokens the request produced
        since its anchor, as a verification would have. A closed trial counts in the
        request's own acceptance rates, and, for a request not paused, as a verification in
        its pause rule; a paused request's trials decide when it resumes. Trials overlap
        (one opens each step), so a request whose history starts to match resumes within a
        few tokens."""
        rid = req.request_id
        paused = self._paused(req)
        trials = self._shadow_trials.pop(rid, [])
        if newest is not None and newest.tokens and newest.anchor_pos == req.num_tokens - 2:
            trials.append(newest)
        still_open = []
        for trial in trials:
            known = min(req.num_tokens - 1 - trial.anchor_pos, len(trial.tokens))
            hits = 0
            while hits < known and trial.tokens[hits] == _token_at(req, trial.anchor_pos + 1 + hits):
                hits += 1
            final = hits < known or known == len(trial.tokens)
            if final:
                self._count_own(rid, len(trial.tokens), hits)
                if not paused and self.adaptive is not None:  # as if verified: may pause it
                    self.adaptive.verified(rid, len(trial.tokens), hits)
            closed = final
            if paused:
                assert self.adaptive is not None
                closed = self.adaptive.shadow(rid, len(trial.tokens), hits, final=final)
            if not closed:
                still_open.append(trial)
            if paused and not self._paused(req):
                return  # resumed: the other trials no longer matter
        if still_open:
            self._shadow_trials[rid] = still_open

    def _accepted_rows(
        self, featured: list[tuple[Chunk, tuple[int, int]]]
    ) -> list[tuple[SequenceState, int, int]]:
        """(request, position, feature row) of every featured row of the step whose token is
        now part of its sequence (a drafted chunk's rows past the first rejection are not)."""
        rows: list[tuple[SequenceState, int, int]] = []
        for c, (first_row, first_offset) in featured:
            req = c.request
            end = self._accepted_end.get(req.request_id, c.end - len(c.draft)) if c.draft else c.end
            end = min(end, len(req.prompt_token_ids) + len(req.output_token_ids) - 1)
            for offset in range(first_offset, c.num_tokens):
                pos = c.start + offset
                if pos < end:
                    rows.append((req, pos, first_row + offset - first_offset))
        return rows

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop its draft and saved state."""
        self.drafts.pop(request_id, None)
        self._shadow_trials.pop(request_id, None)
        self._request_history.pop(request_id, None)
        self.rollback.forget(request_id)
        if self.adaptive is not None:
            self.adaptive.forget(request_id)

    def _count(self, req: SequenceState, drafted: int, accepted: int) -> None:
        self.stats.verify_steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        for j in range(min(accepted + 1, drafted)):  # positions that were tested
            self.trials[j] += 1
            self.accepts[j] += j < accepted
        self._count_own(req.request_id, drafted, accepted)
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        if self.adaptive is not None:
            self.adaptive.verified(req.request_id, drafted, accepted)

    def _count_own(self, request_id: str, drafted: int, accepted: int) -> None:
        """The request's own per-position history: a verified chunk, or a closed shadow trial."""
        k = self.num_draft_tokens
        own = self._request_history.setdefault(request_id, ([0] * k, [0] * k))
        for j in range(min(accepted + 1, drafted, k)):
            own[0][j] += 1
            own[1][j] += j < accepted
