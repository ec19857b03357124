"""Structured outputs: decoding constrained by a JSON schema, a regex, a list of choices or an
EBNF grammar, compiled with xgrammar against the model's tokenizer (as vLLM and SGLang do).

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

import json as jsonlib
import re
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: exactly one of ``json`` (a JSON schema, as a dict
    or a string), ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (EBNF,
    xgrammar's dialect of GBNF) or ``json_object=True`` (any JSON object).
    ``disable_any_whitespace``: JSON without free whitespace between tokens (a model cannot
    then loop on newlines)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: set exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(f"structured_outputs.json must be a schema dict or string, got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}"
            )
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"structured_outputs.disable_any_whitespace must be a bool, got {self.disable_any_whitespace!r}"
            )

    @classmethod
    def parse(cls, value: Any) -> StructuredOutputsParams | None:
        """From None, an instance, or a dict of its fields (naming any unknown one)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {value!r}")
        unknown = sorted(set(value) - {*KINDS, "disable_any_whitespace"})
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(unknown)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema_text(self) -> str:
        return self.json if isinstance(self.json, str) else jsonlib.dumps(self.json)

    def choice_grammar(self) -> str:
        """The choices as an EBNF alternation of string literals (JSON escapes are xgrammar's)."""
        assert self.choice is not None
        return "root ::= " + " | ".join(jsonlib.dumps(c, ensure_ascii=False) for c in self.choice)


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

    def mask_drafted(self, matcher: Any, draft: list[int], logits: torch.Tensor) -> torch.Tensor:
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
