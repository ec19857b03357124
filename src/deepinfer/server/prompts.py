"""Prompt preparation off the event loop: tokenization and chat rendering run on worker
threads, each request within a size and a time budget.

Tokenizing or rendering a large request takes seconds of CPU. Done in an ``async`` handler it
stops every other connection, ``/health`` included, for that long. Here it runs on a small
thread pool while the loop goes on serving, and work that cannot fit is refused before it
starts: a text longer than the model's context could hold in any tokenization, or more
messages than the server takes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from deepinfer.server.protocol import RequestError

T = TypeVar("T")

# a normalizer may fold a few characters into one; this margin keeps the size check sound for
# any such tokenizer (it bounds the work, it is not the context check)
_CHARS_PER_TOKEN_MARGIN = 4


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one vocabulary entry stands for (its stored string is at least as
    long as the text it decodes to: byte-level entries spell one character per byte)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return max((len(token) for token in vocab), default=1)


class PromptPreparer:
    """Runs prompt work on ``workers`` threads with a ``timeout_s`` budget per request."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        max_messages: int,
        timeout_s: float,
        workers: int = 2,
    ) -> None:
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        if not timeout_s > 0:
            raise ValueError(f"the prompt time budget must be > 0 s, got {timeout_s}")
        self.tokenizer = tokenizer
        self.max_messages = max_messages
        self.timeout_s = timeout_s
        self.max_chars = max_model_len * longest_token_chars(tokenizer) * _CHARS_PER_TOKEN_MARGIN
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deepinfer-prompt")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, field: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread; past the time budget the request gets a 400
        naming ``field`` (the thread finishes its bounded work unobserved)."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except TimeoutError:
            raise RequestError(
                f"{field}: preparing the prompt took longer than the server's {self.timeout_s:g} s budget",
                field,
            ) from None

    def check_text(self, field: str, texts: list[str]) -> None:
        """Refuse text that no tokenization could fit in the context, before tokenizing it."""
        total = sum(len(t) for t in texts)
        if total > self.max_chars:
            raise RequestError(
                f"{field}: {total} characters cannot fit in the model's context "
                f"(at most {self.max_chars} characters are tokenized)",
                field,
            )

    def check_messages(self, messages: list[Any], chars: int) -> None:
        """``chars``: the characters of the request's strings (``check_body`` counts them), an
        upper bound on what the template renders of the users' text."""
        if len(messages) > self.max_messages:
            raise RequestError(
                f"messages: {len(messages)} messages is more than this server takes "
                f"(--max-messages {self.max_messages})",
                "messages",
            )
        if chars > self.max_chars:
            raise RequestError(
                f"messages: {chars} characters cannot fit in the model's context "
                f"(at most {self.max_chars} characters are tokenized)",
                "messages",
            )
