"""Token ids for a prompt built of control tokens and plain text, where plain text can never
become a control token.

``split_special_tokens=True`` is not enough: it only splits tokens flagged *special*, and many
chat formats' control tokens are added tokens without that flag (DeepSeek-V4's ``<｜User｜>``,
``</think>``, ``｜DSML｜``; Qwen's ``<think>``). Plain text is therefore tokenized by a copy of
the tokenizer with no added tokens at all: the same normalizer, pre-tokenizer and BPE model,
so text without control strings gets exactly the ids the full tokenizer would give it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# id(tokenizer) -> (tokenizer, its copy without added tokens or None, its added vocabulary)
_CACHE: dict[int, tuple[Any, Any, dict[str, int]]] = {}


def _tables(tokenizer: Any) -> tuple[Any, dict[str, int]]:
    """The tokenizer's ``tokenizers`` backend without added tokens (None for a slow tokenizer)
    and its added vocabulary, built once per tokenizer."""
    hit = _CACHE.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1], hit[2]
    plain = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        spec["added_tokens"] = []
        spec["truncation"] = None
        spec["padding"] = None
        plain = Tokenizer.from_str(json.dumps(spec))
    added = dict(tokenizer.get_added_vocab())
    _CACHE[id(tokenizer)] = (tokenizer, plain, added)
    return plain, added


def plain_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as ordinary text: no added or special token is ever recognised in it."""
    if not text:
        return []
    plain, _ = _tables(tokenizer)
    if plain is None:  # a slow tokenizer: the best it offers
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
    return plain.encode(text, add_special_tokens=False).ids


@dataclass
class Prompt:
    """A rendered prompt as ``(text, is_control)`` pieces: control pieces are the format's own
    tokens, everything else (template prose and users' text alike) is plain text."""

    pieces: list[tuple[str, bool]] = field(default_factory=list)

    def control(self, token: str) -> None:
        self.pieces.append((token, True))

    def text(self, text: str) -> None:
        if text:
            self.pieces.append((text, False))

    def render(self) -> str:
        """The prompt as one string (what the format's reference encoder writes)."""
        return "".join(text for text, _ in self.pieces)

    def token_ids(self, tokenizer: Any) -> list[int]:
        """Adjacent plain pieces are tokenized together, so BPE sees the same words it would in
        the rendered string; control pieces are split points there as here. A control string
        the vocabulary has no token for is text, as the rendered string would read it."""
        _, added = _tables(tokenizer)
        ids: list[int] = []
        run: list[str] = []
        for text, is_control in self.pieces:
            if is_control and text in added:
                ids += plain_ids(tokenizer, "".join(run))
                run = []
                ids.append(added[text])
            else:
                run.append(text)
        return ids + plain_ids(tokenizer, "".join(run))
