"""Turns sampled tokens into request state: logprobs, detokenized text, stop decisions."""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.engine.request import Request
from deepinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput


def top_logprobs(logp: torch.Tensor, chosen: int, k: int) -> dict[int, Logprob]:
    """The chosen token's logprob and rank plus the top-``k`` of one row [V]."""
    entry: dict[int, Logprob] = {}
    if k > 0:
        top = torch.topk(logp, min(k, logp.shape[-1]))
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
            entry[tid] = Logprob(lp, rank)
    value = float(logp[chosen])
    entry[chosen] = Logprob(value, int((logp > logp[chosen]).sum()) + 1)
    return entry


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def append_token(self, req: Request, token: int, logits_row: torch.Tensor | None) -> None:
        """Record ``token`` for ``req`` and set ``finish_reason`` if it ends the request."""
        p = req.params
        if p.logprobs is not None and logits_row is not None:
            entry = top_logprobs(logits_row.float().log_softmax(-1), token, p.logprobs)
            req.cumulative_logprob += entry[token].logprob
            req.logprobs = (req.logprobs or []) + [entry]
        req.output_token_ids.append(token)
        n_out = len(req.output_token_ids)
        if token in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
            return
        if not p.ignore_eos and token in self.eos_token_ids and n_out >= p.min_tokens:
            req.finish_reason = "stop"
            return
        if p.stop and self.tokenizer is not None:
            old_len = len(self.text_of(req, n_out - 1))
            if n_out >= p.min_tokens and self._apply_stop_strings(req, old_len):
                return
        if n_out >= p.max_tokens or len(req.prompt_token_ids) + n_out >= self.max_model_len:
            req.finish_reason = "length"

    def text_of(self, req: Request, num_tokens: int | None = None) -> str:
        """Text of the first ``num_tokens`` outputs (default: all), decoded only when stale:
        detokenizing every request every step would cost more than the model on small ones."""
        n = len(req.output_token_ids) if num_tokens is None else num_tokens
        if self.tokenizer is not None and req.text_tokens != n:
            req.text = self.decode(req.output_token_ids[:n], req.params.skip_special_tokens)
            req.text_tokens = n
        return req.text

    def _apply_stop_strings(self, req: Request, old_len: int) -> bool:
        self.text_of(req)
        longest = max(len(s) for s in req.params.stop)
        search_from = max(0, old_len - longest + 1)
        best: tuple[int, str] | None = None
        for stop in req.params.stop:
            at = req.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        req.text = req.text[: at + (len(stop) if req.params.include_stop_str_in_output else 0)]
        req.text_tokens = len(req.output_token_ids)  # final: keep the truncated text
        req.finish_reason, req.stop_reason = "stop", stop
        return True

    @staticmethod
    def prompt_logprobs(
        req: Request, logp: torch.Tensor, start: int, count: int
    ) -> list[dict[int, Logprob] | None]:
        """Entries for prompt positions start+1 .. start+count from log-probability rows
        [count, V]."""
        k = req.params.prompt_logprobs or 0
        targets = req.prompt_token_ids[start + 1 : start + 1 + count]
        return [top_logprobs(logp[i], t, k) for i, t in enumerate(targets)]

    def make_output(self, req: Request) -> RequestOutput:
        """The request as the user sees it: its text so far, tokens, logprobs and timings."""
        completion = CompletionOutput(
            index=0,
            text=self.text_of(req),
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
            logprobs=req.logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            error=req.error,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            finished_time=req.finished_time,
            num_generated_tokens=len(req.output_token_ids),
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            outputs=[completion],
            finished=req.finished,
            prompt_logprobs=req.prompt_logprobs,
            prompt_logprobs_full=torch.cat(req.prompt_logprobs_full) if req.prompt_logprobs_full else None,
            num_cached_tokens=req.num_cached_tokens,
            metrics=metrics,
        )
