"""What the reference computations read from a checkpoint directory, with no deepinfer code:
the tensors of ``*.safetensors`` (the ``safetensors`` library), the text config of
``config.json`` (``json``), and Engram's compressed token map, built from ``tokenizer.json``
(the ``tokenizers`` library) by the first step of Engram's hashing rule."""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

# -- tensors and config -----------------------------------------------------------------


class Spec:
    """The text config's fields as attributes (``cfg.hidden_size``); a field the reference
    needs and ``config.json`` lacks is a clear error naming it."""

    OPTIONAL = {"candidate_source_layer_id": None, "engram_layer_ids": [], "rope_scaling": None}

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = dict(fields)

    def __getattr__(self, name: str) -> Any:
        fields = self.__dict__["_fields"]
        if name in fields:
            return fields[name]
        if name in Spec.OPTIONAL:
            return Spec.OPTIONAL[name]
        raise AttributeError(f"config.json has no field {name!r}, which the reference reads")

    def replace(self, **fields: Any) -> Spec:
        return Spec({**self._fields, **fields})

    @property
    def yarn(self) -> Any:
        """YaRN of the compressed layers (the config's ``rope_scaling``), or None."""
        rs = self.rope_scaling
        if not rs or rs.get("type", rs.get("rope_type")) != "yarn":
            return None
        return Spec(
            {
                "factor": float(rs["factor"]),
                "original_max_position_embeddings": int(rs["original_max_position_embeddings"]),
                "beta_fast": float(rs.get("beta_fast", 32)),
                "beta_slow": float(rs.get("beta_slow", 1)),
            }
        )


@dataclasses.dataclass
class ReferenceCheckpoint:
    """What the reference reads from a checkpoint directory."""

    state: dict[str, torch.Tensor]  # fp32 tensors by their checkpoint names
    cfg: Spec
    token_map: torch.Tensor | None  # Engram's token id -> compressed id (None: no Engram)


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``path/*.safetensors``, floats as fp32."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in state:
                raise ValueError(f"{file}: tensor {name!r} is in more than one shard")
            if tensor.dtype in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(f"{file}: tensor {name!r} is stored quantized; the reference reads floats")
            state[name] = tensor.float() if tensor.is_floating_point() else tensor
    return state


def read_config(path: str | Path) -> Spec:
    """``config.json``'s text config (``text_config`` of a composite config, else the top level)."""
    raw = json.loads((Path(path) / "config.json").read_text())
    text = raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw
    return Spec(text)


def read_checkpoint(path: str | Path) -> ReferenceCheckpoint:
    cfg = read_config(path)
    token_map = engram_token_map(path, cfg) if cfg.engram_layer_ids else None
    return ReferenceCheckpoint(read_state(path), cfg, token_map)


# -- Engram's compressed token map (the first step of its hash) ------------------------------


# Unicode's White_Space characters (what the ends are stripped of; not Python's str.isspace,
# which adds the separators U+001C-U+001F)
WHITE_SPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)


def normalise_token_text(text: str) -> str:
    """NFKC, NFD, strip accents (every combining mark, Unicode category M*, as the tokenizers
    library's StripAccents does), lowercase, collapse runs of space/tab/CR/LF to one space;
    then strip the ends, except that a text which is exactly one space stays one space."""
    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("M")).lower()
    text = re.sub(r"[ \t\r\n]+", " ", text)
    return text if text == " " else text.strip(WHITE_SPACE)


def engram_token_map(path: str | Path, cfg: Spec) -> torch.Tensor:
    """[vocab] token id -> compressed id, numbered by first appearance; the identity when the
    checkpoint has no tokenizer and the compressed vocabulary is the whole vocabulary."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        if cfg.engram_compressed_vocab_size != cfg.vocab_size:
            raise ValueError(f"{path}: no tokenizer.json and the compressed vocabulary is not the identity")
        return torch.arange(cfg.vocab_size)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(file))
    keys: dict[str, int] = {}
    lookup = []
    for tid in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([tid], skip_special_tokens=False)
        key = tok.id_to_token(tid) if "\ufffd" in text else (normalise_token_text(text) or text)
        lookup.append(keys.setdefault(key, len(keys)))
    if len(keys) != cfg.engram_compressed_vocab_size:
        raise ValueError(
            f"{path}: the tokenizer compresses to {len(keys)} ids, config.json says "
            f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}"
        )
    # ids past the tokenizer (embedding padding rows, never in text) hash like the pad token
    lookup += [lookup[cfg.engram_pad_token_id]] * (cfg.vocab_size - len(lookup))
    return torch.tensor(lookup, dtype=torch.long)
