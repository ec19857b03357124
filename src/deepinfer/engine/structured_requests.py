"""The engine's side of structured outputs: requests whose grammar is compiling, then the
matcher each constrained request carries (sampling/structured.py does the grammar work).

A constrained request is held here until its grammar is compiled, then handed to the
scheduler; one whose grammar fails to compile ends with ``abort``. After each sampled or
verified token the request's matcher advances; a matcher that has accepted its stop token
ends the request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Any

import torch

from deepinfer.engine.request import Request
from deepinfer.sampling.structured import GrammarBackend
from deepinfer.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("deepinfer")


class StructuredRequests:
    """Grammar compilation and matching for one engine (the backend made on first use:
    it needs the tokenizer)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.backend: GrammarBackend | None = None
        self.compiling: list[Request] = []

    def _backend(self) -> GrammarBackend:
        if self.backend is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer (this checkpoint has none)")
            self.backend = GrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self.backend

    def check(self, params: StructuredOutputsParams) -> None:
        """Refuse a bad constraint before the request exists (``ValueError`` naming it)."""
        self._backend().check(params)

    def submit(self, request: Request, params: StructuredOutputsParams) -> None:
        """Start compiling the request's grammar; the request waits here meanwhile."""
        request.grammar_future = self._backend().submit(params)
        self.compiling.append(request)

    def forget(self, request: Request) -> None:
        if request in self.compiling:
            self.compiling.remove(request)

    def ready(self, idle: bool) -> tuple[list[Request], list[Request]]:
        """(requests whose matcher is now set, requests whose grammar failed); ``idle``:
        nothing else can run, so wait for the first grammar to finish."""
        if not self.compiling:
            return [], []
        if idle:
            wait([r.grammar_future for r in self.compiling], return_when=FIRST_COMPLETED)
        done, failed, still = [], [], []
        for request in self.compiling:
            future = request.grammar_future
            assert future is not None
            if not future.done():
                still.append(request)
                continue
            request.grammar_future = None
            try:
                request.grammar = future.result()
                done.append(request)
            except Exception:
                logger.exception(
                    "structured_outputs: request %s: grammar failed to compile", request.request_id
                )
                failed.append(request)
        self.compiling = still
        return done, failed

    def trim_draft(self, request: Request, draft: list[int]) -> list[int]:
        """A draft cut at the first token the request's grammar rejects."""
        if request.grammar is None or not draft:
            return draft
        return GrammarBackend.trim_draft(request.grammar, draft)

    def mask_rows(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The sampled rows with each constrained request's disallowed tokens at -inf."""
        matchers = [r.grammar for r in requests]
        if self.backend is None or all(m is None for m in matchers):
            return logits
        return self.backend.mask_rows(logits, matchers)

    def mask_drafted(self, request: Request, draft: Sequence[int], rows: torch.Tensor) -> torch.Tensor:
        """The rows verifying ``draft``, masked for the grammar state at each position."""
        if request.grammar is None or self.backend is None:
            return rows
        return self.backend.mask_drafted(request.grammar, draft, rows)

    @staticmethod
    def accept(request: Request, token: int) -> str | None:
        """Advance the request's matcher by an appended token: the finish reason this sets
        ("abort" for a token its grammar rejects, "stop" once the grammar has ended)."""
        matcher = request.grammar
        if matcher is None:
            return None
        if not matcher.accept_token(token):
            logger.warning("structured_outputs: request %s: token %d rejected", request.request_id, token)
            return "abort"
        return "stop" if matcher.is_terminated() else None

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
