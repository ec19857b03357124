"""Structured outputs: decoding constrained by a JSON schema, a regex, a list of choices, an
EBNF grammar or a structural tag, compiled with xgrammar against the model's tokenizer (as
vLLM and SGLang do).

A request's constraint is checked when it is submitted (a bad schema, regex or grammar is a
``ValueError`` naming the field), compiled on a background thread (xgrammar caches compiled
grammars, so a repeated schema compiles once) and the request is scheduled once its grammar
is ready. Each constrained request holds a matcher; before sampling, the step fills one token
bitmask row per constrained row and applies them all at once, so only tokens the grammar
allows can be drawn. Reported logprobs stay those of the raw model distribution.

Speculative decoding: a draft is cut at its first token the grammar rejects, and the target
rows that verify a draft are masked with the matcher advanced through the draft's tokens
(then rolled back); only the tokens verification keeps are accepted into the matcher.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from deepinfer.structured_outputs import StructuredOutputsParams


def _message(exc: Exception) -> str:
    """xgrammar's message without its "[hh:mm:ss] file.cc:line: " prefix."""
    text = str(exc).strip()
    lines = text.splitlines()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", lines[-1] if lines else type(exc).__name__)


class GrammarBackend:
    """xgrammar over one tokenizer: checks and compiles constraints, makes matchers, fills
    and applies token bitmasks."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int = 2) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="deepinfer-grammar")
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def check(self, params: StructuredOutputsParams) -> None:
        """Parse the constraint without compiling it against the vocabulary (fast): a bad
        one raises ``ValueError`` naming the field and xgrammar's message."""
        xgr, kind = self.xgr, params.kind
        try:
            if kind == "json":
                xgr.Grammar.from_json_schema(
                    params.schema_text(), any_whitespace=not params.disable_any_whitespace
                )
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex)
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(params.choice_grammar())
            elif kind == "structural_tag":
                xgr.Grammar.from_structural_tag(params.structural_tag_text())
        except Exception as exc:  # xgrammar raises RuntimeError with the parser's message
            raise ValueError(f"structured_outputs.{kind}: {_message(exc)}") from exc

    def compile(self, params: StructuredOutputsParams) -> Any:
        kind, compiler = params.kind, self.compiler
        if kind == "json":
            return compiler.compile_json_schema(
                params.schema_text(), any_whitespace=not params.disable_any_whitespace
            )
        if kind == "json_object":  # an object, as vLLM compiles it (xgrammar's builtin allows any value)
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=not params.disable_any_whitespace
            )
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(params.choice_grammar())
        if kind == "structural_tag":
            return compiler.compile_structural_tag(params.structural_tag_text())
        return compiler.compile_grammar(params.grammar)

    def submit(self, params: StructuredOutputsParams) -> Future:
        """Compile on the background thread (off the step path); the future gives a matcher."""
        return self.pool.submit(lambda: self.xgr.GrammarMatcher(self.compile(params)))

    def mask_rows(self, logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
        """``logits`` [N, V] with each row's disallowed tokens at -inf (rows whose matcher is
        None stay as they are): one bitmask filled row by row, applied in one call."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = self.xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        bitmask = self._bitmask[: logits.shape[0]]
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        masked = logits.float().clone()
        self.xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=self.vocab_size, indices=rows)
        return masked

    def mask_drafted(self, matcher: Any, draft: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Rows [d + 1, V] verifying ``draft``: row j masked for the state after draft[:j]
        (the matcher advanced through the draft, then rolled back). Rows past a token the
        grammar rejects keep that row's mask: verification rejects the token there anyway."""
        n = logits.shape[0]
        if self._bitmask.shape[0] < n:
            self._bitmask = self.xgr.allocate_token_bitmask(n, self.vocab_size)
        bitmask = self._bitmask[:n]
        accepted = 0
        for j in range(n):
            matcher.fill_next_token_bitmask(bitmask, j)
            if j < len(draft):
                if not matcher.accept_token(draft[j]):
                    bitmask[j + 1 :] = bitmask[j]
                    break
                accepted += 1
        if accepted:
            matcher.rollback(accepted)
        masked = logits.float().clone()
        self.xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=self.vocab_size)
        return masked

    @staticmethod
    def trim_draft(matcher: Any, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the grammar accepts (the matcher left as it was)."""
        kept = 0
        for token in draft:
            if not matcher.accept_token(token):
                break
            kept += 1
        if kept:
            matcher.rollback(kept)
        return draft[:kept]

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
