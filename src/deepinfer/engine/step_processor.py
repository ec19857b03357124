"""The last stage of an engine step: a finished step's logits become tokens and request state.

``StepProcessor.process`` reads the step's logits rows (``PreparedStep.sample_rows`` and
``prompt_rows``) and, for each chunk: prompt logprobs, sampling under the request's grammar,
verification of drafted chunks, stop checks, then the prefix cache's publishing and the
drafter's turn. It also ends requests (a finish, an abort, a failure), since ending one is
the same release of blocks, grammar and draft state whichever stage decides it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from deepinfer.cache.host_tensors import long_tensor, to_device
from deepinfer.engine.dp_scheduler import DataParallelScheduler
from deepinfer.engine.executor import StepOutput
from deepinfer.engine.model_runner import PreparedStep
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request, Status
from deepinfer.engine.scheduler import ScheduledChunk, Scheduler
from deepinfer.engine.structured_requests import StructuredRequests
from deepinfer.sampling.sampler import INVALID_ROW, SamplingRow, sample, sample_tokens
from deepinfer.speculative.decoder import SpeculativeDecoder, VerifiedChunk

logger = logging.getLogger("deepinfer")


@dataclass
class DeviceSampling:
    """A step whose tokens are sampled on the device right after its forward, before the
    host reads them: every sampling chunk is a plain one (no grammar, no logits processor,
    no draft). ``chunks``: the indices of the sampling chunks, in the order of the rows."""

    chunks: list[int]
    logits_rows: list[int]
    rows: list[SamplingRow]
    positions: list[int]  # the position of the token each row draws (its random key)
    rowwise: bool
    logprob_rows: list[int]  # the rows whose requests report logprobs (their logits go home)

    def sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's tokens, on the logits' device (no host read), and the logits rows of
        ``logprob_rows`` (None when there are none)."""
        rows = self.logits_rows
        if rows == list(range(len(rows))):  # the usual step: rows 0..n-1, no gather
            picked = logits[: len(rows)]
        else:
            picked = logits.index_select(0, to_device(long_tensor(rows), logits.device))
        wanted = None
        if self.logprob_rows:
            wanted = picked.index_select(0, to_device(long_tensor(self.logprob_rows), logits.device))
        return sample_tokens(picked, self.rows, self.positions, self.rowwise), wanted

    def slots(self, chunks: list[ScheduledChunk]) -> dict[int, int]:
        """The token row of each request (by identity) whose chunk of ``chunks``, the step's,
        is sampled here: where the next step finds the token it feeds."""
        return {id(chunks[i].request): j for j, i in enumerate(self.chunks)}


class StepProcessor:
    """Tokens from logits, and the end of requests. ``counts_in_flight``: an asynchronous
    engine counts each request's token being sampled by a launched step
    (``Request.pending_tokens``); ``rowwise``: sample row by row (batch invariance)."""

    def __init__(
        self,
        scheduler: Scheduler | DataParallelScheduler,
        outputs: OutputProcessor,
        structured: StructuredRequests,
        spec: SpeculativeDecoder | None,
        eos_token_ids: list[int],
        rowwise: bool,
        counts_in_flight: bool,
    ) -> None:
        self.scheduler = scheduler
        self.outputs = outputs
        self.structured = structured
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        self.rowwise = rowwise
        self.counts_in_flight = counts_in_flight

    # ---- a step's results -----------------------------------------------------------------

    def device_sampling(self, prepared: PreparedStep) -> DeviceSampling | None:
        """The plan to sample ``prepared``'s tokens on the device after its forward, or None
        when a row needs the host first: a grammar mask (its matcher advances as the last
        step's tokens are processed), a logits processor reading the output so far, or a
        drafted chunk's verification. A synchronous engine samples in ``process`` (the same
        ``sample_tokens``; no next step waits for the tokens there)."""
        if self.spec is not None or not self.counts_in_flight:
            return None
        picked, logits_rows, rows, positions = [], [], [], []
        for i, (c, row) in enumerate(zip(prepared.chunks, prepared.sample_rows, strict=True)):
            if row < 0:
                continue
            req = c.request
            sampling_row = req.sampling_row or self._sampling_row(req)
            if c.draft or req.grammar is not None or not sampling_row.plain:
                return None
            picked.append(i)
            logits_rows.append(row)
            rows.append(sampling_row)
            positions.append(c.end)
        if not picked:  # nothing to sample: the next step needs nothing from this one
            return DeviceSampling([], [], [], [], self.rowwise, [])
        wanted = [j for j, row in enumerate(rows) if row.params.logprobs is not None]
        return DeviceSampling(picked, logits_rows, rows, positions, self.rowwise, wanted)

    def process(
        self, prepared: PreparedStep, output: StepOutput, sampled: DeviceSampling | None = None
    ) -> list[Request]:
        """Turn a finished step's logits into tokens: prompt logprobs, sampling (or the tokens
        ``sampled`` drew on the device, read back now), verification of drafted chunks,
        prefix-cache publishing, then the drafter's turn. Returns the requests that got
        tokens or ended."""
        logits, features = output.logits, output.features
        chunks = prepared.chunks
        drawn = drawn_logits = None
        if sampled is not None and output.host_tokens is not None:
            values = output.host_tokens.tolist()  # the step's one host read
            drawn = {id(chunks[i]): v for i, v in zip(sampled.chunks, values, strict=True)}
            if output.host_logits is not None:  # copied beside the tokens, for logprobs
                rows = output.host_logits.wait()
                drawn_logits = {
                    id(chunks[sampled.chunks[j]]): rows[k] for k, j in enumerate(sampled.logprob_rows)
                }
        live = [(c, row) for c, row in zip(chunks, prepared.sample_rows, strict=True) if row >= 0]
        if self.counts_in_flight:
            for c, _ in live:
                c.request.pending_tokens = max(0, c.request.pending_tokens - 1)
        live = [(c, row) for c, row in live if not c.request.finished]
        self._prompt_logprobs(prepared, logits)
        updated = self._sample([(c, row) for c, row in live if not c.draft], logits, drawn, drawn_logits)
        spec = self.spec
        if spec is not None:
            drafted = [(c, logits[row : row + len(c.draft) + 1]) for c, row in live if c.draft]
            checked = [(c, self.structured.mask_drafted(c.request, c.draft, rows)) for c, rows in drafted]
            verified = spec.verify(checked)
            for v, (_, raw) in zip(verified, drafted, strict=True):
                v.logits = raw  # logprobs are reported from the raw distribution
            updated += [self._append_verified(v) for v in verified]
        # published first, then trimmed: trimmed blocks stay cached
        self.scheduler.after_step([c.request for c in chunks])
        if spec is not None:
            if output.forward_s is not None and all(c.num_tokens == 1 + len(c.draft) for c in chunks):
                spec.observe_step(sum(c.num_tokens for c in chunks), output.forward_s)
            featured = [
                (c, rows)
                for c, rows in zip(chunks, prepared.feature_rows or [], strict=False)
                if c.request.status is Status.RUNNING
            ]
            ready = [r for r in self.scheduler.running if self.scheduler.may_draft(r)]
            spec.after_step(featured, features, ready)
        return updated

    def _prompt_logprobs(self, prepared: PreparedStep, logits: torch.Tensor) -> None:
        for c, (first, count) in zip(prepared.chunks, prepared.prompt_rows, strict=True):
            req = c.request
            if count and not req.finished:
                logp = logits[first : first + count].float().log_softmax(-1)
                entries = self.outputs.prompt_logprobs(req, logp, c.start, count)
                have = req.prompt_logprobs or [None]  # entry i is for prompt token i
                new = len(have) - c.start - 1  # a recompute after preemption adds none twice
                have += entries[new:]
                req.prompt_logprobs = have
                if req.params.prompt_logprobs_full and new < count:
                    if req.prompt_logprobs_full is None:
                        req.prompt_logprobs_full = []
                    req.prompt_logprobs_full.append(logp[max(new, 0) :])

    def _sample(
        self,
        live: list[tuple[ScheduledChunk, int]],
        logits: torch.Tensor,
        drawn: dict[int, int] | None = None,
        drawn_logits: dict[int, torch.Tensor] | None = None,
    ) -> list[Request]:
        """One token for each chunk that reached its sequence's end (``live``: chunk and its
        logits row), with stop checks; ``drawn``: the tokens the device sampled, by chunk, and
        ``drawn_logits`` the host copies of their logits rows that logprobs read (the device's
        own rows are not read then: after a launch, a read would wait for the next step)."""
        if not live:
            return []
        sampled_logits: torch.Tensor | list[torch.Tensor | None]
        if drawn is not None:
            tokens = [drawn[id(c)] for c, _ in live]
            sampled_logits = [(drawn_logits or {}).get(id(c)) for c, _ in live]
        else:
            indices = [row for _, row in live]
            if indices == list(range(len(indices))):  # the usual step: rows 0..n-1, no gather
                sampled_logits = logits[: len(indices)]
            else:
                sampled_logits = logits[torch.tensor(indices)]
            rows = [c.request.sampling_row or self._sampling_row(c.request) for c, _ in live]
            allowed = self.structured.mask_rows(sampled_logits, [c.request for c, _ in live])
            positions = [c.end for c, _ in live]
            tokens = sample(allowed, rows, rowwise=self.rowwise, positions=positions)
        now = time.perf_counter()
        updated = []
        for i, ((c, _), token) in enumerate(zip(live, tokens, strict=True)):
            req = c.request
            updated.append(req)
            if token == INVALID_ROW:
                self.fail(req, "the model's distribution for this request was not finite (NaN)")
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            try:
                # a row's logits are read only for its logprobs: no view made for the others
                self._append(req, token, sampled_logits[i] if req.params.logprobs is not None else None)
            except Exception as exc:  # this request's own post-processing: it fails alone
                logger.exception("request %s failed after sampling", req.request_id)
                self.fail(req, f"{type(exc).__name__}: {exc}")
                continue
            if req.finish_reason is not None:
                # the token just sampled has no row yet: an asynchronous engine counts the
                # next step's row for it (and that step's token) already, and may be writing it
                known = len(req.prompt_token_ids) + len(req.output_token_ids)
                self.finish(req, computed=min(req.num_computed_tokens, known - 1))
        return updated

    def _sampling_row(self, request: Request) -> SamplingRow:
        """What the sampler reads of ``request``, made once: its params, generator and token
        lists never change identity (the lists grow in place)."""
        request.sampling_row = SamplingRow(
            request.params,
            request.generator,
            request.prompt_token_ids,
            request.output_token_ids,
            self.eos_token_ids,
        )
        return request.sampling_row

    def _append_verified(self, verified: VerifiedChunk) -> Request:
        """Append a drafted chunk's verified tokens one by one (stop checks apply to each),
        then let the speculative decoder roll the computed count back to the valid rows."""
        req = verified.chunk.request
        assert isinstance(req, Request)
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        for j, token in enumerate(verified.tokens):
            self._append(req, token, verified.logits[j])
            if req.finish_reason is not None:  # rows up to the anchor and accepted drafts are valid
                self.finish(req, computed=verified.anchor + j + 1)
                return req
        assert self.spec is not None
        self.spec.roll_back(verified)
        return req

    def _append(self, req: Request, token: int, row_logits: torch.Tensor | None) -> None:
        """Append a sampled token (stop checks) and advance the request's grammar, whose end
        (its stop token accepted) ends the request."""
        self.outputs.append_token(req, token, row_logits)
        reason = self.structured.accept(req, token)
        if reason is not None and req.finish_reason is None:
            req.finish_reason = reason

    # ---- the end of a request ---------------------------------------------------------------

    def finish(self, req: Request, computed: int | None = None) -> None:
        """``computed``: positions whose cache rows this request has validly written; their
        full blocks are published to the prefix cache before the blocks are freed (None: an
        abort, nothing published)."""
        req.finished_time = time.perf_counter()
        if self.spec is not None:
            self.spec.forget(req.request_id)
        self.scheduler.finish(req, computed)

    def end_now(self, request: Request, reason: str) -> None:
        """Finish a request before its end (an abort, a failure): nothing it computed is
        published to the prefix cache."""
        if request.finished:
            return
        request.finish_reason = reason
        self.structured.forget(request)
        self.finish(request)

    def fail(self, request: Request, error: str) -> None:
        """End one request that went wrong (finish reason "error", ``error`` saying why); its
        cache is freed unpublished and the other requests go on."""
        if not request.finished:
            logger.error("request %s failed: %s", request.request_id, error)
            request.error = error
            self.end_now(request, "error")
