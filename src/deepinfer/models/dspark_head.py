"""A DSpark draft head for Llama-family targets, loaded beside the target from its own directory
(``speculative_config={"method": "dspark", "model": PATH}``).

The math is DSpark's (paper §2.2-§3.2; techniques in the reference notes): the target's hidden
states entering ``target_layer_ids`` are concatenated, projected (``main_proj``) and normed
(``main_norm``) into one context vector per accepted position; every draft layer projects it
to keys and values with the same projection its block rows use (KV injection) and keeps them in
the drafter's window ring; one forward over the block ``[anchor, noise x (g - 1)]`` attends to
the window and to the whole block (no causal mask inside it); the target's final norm and head
give the block's logits, a rank-r bigram bias (the Markov head) joins each row left to right,
and the confidence head scores ``[h_i ; markov_embed(prev)]``.

The draft layers are Llama-shaped (grouped-query attention with RoPE, SwiGLU), as the DSpark
reference drafts Qwen3 targets with Qwen3 layers: a 135M dense target gains nothing from V4.1's
hyper-connections or experts, and each costs reads on every draft. Block rows after the anchor
embed as one learned noise vector, so no token id of the target's vocabulary is taken.

``DSparkHead`` holds the trained parameters only; ``LlamaDSparkDraft`` joins it with the
target's embedding, final norm and head into what ``speculative.dspark.DSparkDrafter`` runs.
Training (``deepinfer.drafter_training``) calls the same ``block_hidden`` and ``window_kv``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from deepinfer.errors import CheckpointError
from deepinfer.kernels.weight_only import PackedLinear
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.weights.catalog import resolve_draft_head

ARCHITECTURE = "LlamaDSparkHead"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass
class DSparkHeadConfig:
    """The head's shape; ``hidden_size`` and ``vocab_size`` must equal the target's."""

    hidden_size: int
    vocab_size: int
    target_layer_ids: list[int] = field(default_factory=list)  # hidden states entering these layers
    num_layers: int = 2
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    block_size: int = 5  # draft tokens per proposal (the anchor's row predicts the first)
    window: int = 128  # context positions each draft attends to
    markov_rank: int = 32
    # drafts come from the most frequent tokens of the training replies only (0: every token):
    # the draft's logits then read that many rows of the shared head instead of the whole
    # vocabulary, as EAGLE-3's and FR-Spec's draft vocabularies do; exactness is unchanged
    # (a token outside it has draft probability 0)
    draft_vocab_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    # what the head was trained for: the target's name, its layer count, the recipe's figures
    trained_for: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise CheckpointError naming the first field out of range."""
        positive = (
            "hidden_size",
            "vocab_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "block_size",
            "window",
            "markov_rank",
        )
        if not isinstance(self.draft_vocab_size, int) or not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise CheckpointError(
                f"DSpark head config.json: draft_vocab_size must be in [0, vocab_size], got {self.draft_vocab_size!r}"
            )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(
                    f"DSpark head config.json: {name} must be an integer >= 1, got {value!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError("DSpark head config.json: num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise CheckpointError(f"DSpark head config.json: head_dim={self.head_dim} must be even for RoPE")
        ids = self.target_layer_ids
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(
                f"DSpark head config.json: target_layer_ids must be a non-empty list of layer indices, got {ids!r}"
            )
        if len(set(ids)) != len(ids) or sorted(ids) != list(ids):
            raise CheckpointError(f"DSpark head config.json: target_layer_ids must increase, got {ids!r}")

    @property
    def kv_dim(self) -> int:
        """Width of one ring entry: a position's keys and values of every KV head."""
        return 2 * self.num_kv_heads * self.head_dim


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` [..., N, heads, head_dim] at ``positions`` [..., N]."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    freqs = positions.unsqueeze(-1).float() * inv
    cos, sin = freqs.cos().unsqueeze(-2), freqs.sin().unsqueeze(-2)
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class DraftLayer(nn.Module):
    """A Llama decoder layer whose block rows attend to injected context keys/values."""

    def __init__(self, cfg: DSparkHeadConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.kv_proj = nn.Linear(d, cfg.kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Ring entries [..., N, kv_dim] of rows ``x`` [..., N, d]: keys roped at ``positions``."""
        cfg = self.cfg
        k, v = self.kv_proj(x).unflatten(-1, (2, cfg.num_kv_heads, cfg.head_dim)).unbind(-3)
        return torch.cat([rope(k, positions, cfg.rope_theta).flatten(-2), v.flatten(-2)], dim=-1)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ring: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Block rows ``x`` [B, g, d] at ``positions`` [B, g]; ``ring`` [B, W, kv_dim] with
        ``visible`` [B, W]. Each row sees the visible ring entries and its whole block."""
        cfg = self.cfg
        b, g, _ = x.shape
        h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        a = self.input_norm(x)
        q = rope(self.q_proj(a).view(b, g, h, hd), positions, cfg.rope_theta)
        entries = torch.cat([ring.to(x.dtype), self.keys_values(a, positions)], dim=1)  # [B, W+g, kv_dim]
        k, v = entries.view(b, -1, 2, kvh, hd).unbind(2)
        mask = torch.cat([visible, torch.ones(b, g, dtype=torch.bool, device=x.device)], dim=1)
        rep = h // kvh
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).repeat_interleave(rep, dim=1),
            v.transpose(1, 2).repeat_interleave(rep, dim=1),
            attn_mask=mask[:, None, None, :],
        )
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, g, h * hd))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class DSparkHead(nn.Module):
    """The trained parameters of a DSpark head (the target's embedding, final norm and head
    are shared, not stored)."""

    def __init__(self, cfg: DSparkHeadConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        d = cfg.hidden_size
        self.main_proj = nn.Linear(d * len(cfg.target_layer_ids), d, bias=False)
        self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.noise_embed = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.markov_embed = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_head = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        self.confidence_head = nn.Linear(d + cfg.markov_rank, 1, bias=True)
        # Sequential temperature scaling of the confidence logits (one per block row)
        self.register_buffer("confidence_temperature", torch.ones(cfg.block_size))
        if cfg.draft_vocab_size:  # the token ids drafts may take, most frequent first
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size))

    def window_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every layer's ring entries [layers, N, kv_dim] from target features [N, m * d]."""
        main = self.main_norm(self.main_proj(features.to(self.main_proj.weight.dtype)))
        return torch.stack([layer.keys_values(main, positions) for layer in self.layers])

    def block_hidden(
        self,
        anchor_embeds: torch.Tensor,
        positions: torch.Tensor,
        windows: list[torch.Tensor],
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden rows [B, g, d] of blocks whose first row embeds as ``anchor_embeds`` [B, d]
        and the rest as the noise vector, at ``positions`` [B, g]."""
        b, g = positions.shape
        noise = self.noise_embed.to(anchor_embeds.dtype).expand(b, g - 1, -1)
        x = torch.cat([anchor_embeds.unsqueeze(1), noise], dim=1)
        for layer, ring in zip(self.layers, windows, strict=True):
            x = layer(x, positions, ring, visible)
        return x

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 bigram logit bias [..., V] after tokens ``prev`` and their rank-r embeddings."""
        embed = self.markov_embed(prev)
        return self.markov_head(embed).float(), embed

    def confidence_logits(self, hidden: torch.Tensor, markov_embeds: torch.Tensor) -> torch.Tensor:
        """Uncalibrated confidence logits [..., k] of ``[h_i ; markov_embed(prev)]``."""
        head_in = torch.cat([hidden, markov_embeds.to(hidden.dtype)], dim=-1)
        return self.confidence_head(head_in.float()).squeeze(-1)

    def confidence(self, hidden: torch.Tensor, markov_embeds: torch.Tensor) -> torch.Tensor:
        """P(draft i accepted | the drafts before it were) [B, k], calibrated per row."""
        logits = self.confidence_logits(hidden, markov_embeds)
        return torch.sigmoid(logits / self.confidence_temperature[: logits.shape[-1]])


def check_target(cfg: DSparkHeadConfig, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """Raise CheckpointError unless the head fits a target of this shape."""
    if cfg.hidden_size != hidden_size or cfg.vocab_size != vocab_size:
        raise CheckpointError(
            f"the DSpark head was trained for hidden_size={cfg.hidden_size}, vocab_size={cfg.vocab_size}; "
            f"the target has hidden_size={hidden_size}, vocab_size={vocab_size}"
        )
    bad = [i for i in cfg.target_layer_ids if not 1 <= i < num_layers]
    if bad:
        raise CheckpointError(
            f"the DSpark head reads layers {bad}; a target of {num_layers} layers takes ids in [1, {num_layers})"
        )


def save_head(head: DSparkHead, out: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    raw = {"architecture": ARCHITECTURE, **dataclasses.asdict(head.config)}
    (out / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE))


def load_head(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DSparkHead:
    """A head saved by ``save_head``, from its directory or a cached head's name
    (``smollm2-135m-dspark``); CheckpointError when it is not one."""
    path = resolve_draft_head(name_or_path)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise CheckpointError(f"{path} is not a DSpark head: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    raw = json.loads(config_path.read_text())
    if raw.pop("architecture", None) != ARCHITECTURE:
        raise CheckpointError(f"{config_path}: architecture must be {ARCHITECTURE!r}")
    known = {f.name for f in dataclasses.fields(DSparkHeadConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"{config_path}: unknown field(s) {unknown}")
    try:
        cfg = DSparkHeadConfig(**raw)
    except TypeError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    head = DSparkHead(cfg)
    state = load_file(str(weights_path))
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor whose shape config.json contradicts
        raise CheckpointError(f"{weights_path}: {exc}") from None
    if missing or unexpected:
        raise CheckpointError(f"{weights_path}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


class LlamaDSparkDraft:
    """A DSpark head joined with its target's embedding and output projection: every
    computation ``speculative.dspark.DSparkDrafter`` runs (its ``DSparkModel``), none of its
    bookkeeping."""

    noise_token_id = 0  # block rows after the anchor embed as the head's noise vector instead

    def __init__(
        self,
        head: DSparkHead,
        embed: nn.Embedding,
        output: Callable[[torch.Tensor], torch.Tensor],
        output_weight: torch.Tensor,
    ) -> None:
        """``output``: the target's head over normed hidden rows [N, d] -> logits [N, V], and
        its weight [V, d] (whose draft-vocabulary rows a head with one reads instead)."""
        cfg = head.config
        self.head, self.embed, self.output = head, embed, output
        # a draft vocabulary: logits over its tokens only (the head's and the Markov head's rows)
        self.vocab: torch.Tensor | None = getattr(head, "draft_vocab", None)
        self.vocab_size = output_weight.shape[0]
        # the draft vocabulary's rows of the shared head and of the Markov head, as projections
        # (``pack_for_cpu`` swaps in packed copies)
        self.vocab_out: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.vocab_markov: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._vocab_rows: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.vocab is not None:
            out_rows = output_weight.detach()[self.vocab].contiguous()
            markov_rows = head.markov_head.weight.detach()[self.vocab].contiguous()
            self._vocab_rows = (out_rows, markov_rows)
            self.vocab_out = functools.partial(F.linear, weight=out_rows)
            self.vocab_markov = functools.partial(F.linear, weight=markov_rows)
        self.block_size, self.window, self.kv_dim = cfg.block_size, cfg.window, cfg.kv_dim
        self.feature_layers = tuple(cfg.target_layer_ids)
        self.dtype = head.main_proj.weight.dtype
        self.device = head.main_proj.weight.device

    def pack_for_cpu(self) -> None:
        """Serve the head's projections from packed copies on the engine's CPU GEMM (as the
        target's are): a draft step is a few rows, where ``F.linear`` is several times slower.
        Engine-only: the packed copies have no autograd, so the head is not trained after."""
        for module in self.head.modules():
            if isinstance(module, nn.Linear) and PackedLinear.available(module.weight):
                module.forward = PackedLinear(module.weight, module.bias)  # type: ignore[method-assign]
        if self._vocab_rows is not None and PackedLinear.available(self._vocab_rows[0]):
            self.vocab_out = PackedLinear(self._vocab_rows[0], None)
            self.vocab_markov = PackedLinear(self._vocab_rows[1], None)

    @property
    def num_stages(self) -> int:
        return len(self.head.layers)

    def window_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head.window_kv(features, positions)

    def block_hidden(
        self, ids: torch.Tensor, positions: torch.Tensor, windows: list[torch.Tensor], visible: torch.Tensor
    ) -> torch.Tensor:
        """Flat blocks ``[anchor, noise x (g - 1)]`` ([B * g] ids and positions) to hidden rows [B * g, d]."""
        g = self.block_size
        anchors = ids.view(-1, g)[:, 0]
        hidden = self.head.block_hidden(self.embed(anchors), positions.view(-1, g), windows, visible)
        return hidden.flatten(0, 1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden rows (over the draft vocabulary where the head has one): the
        head's norm, then the target's output projection."""
        normed = self.head.norm(hidden)
        if self.vocab_out is not None:
            return self.vocab_out(normed).float()
        return self.output(normed).float()

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The Markov bias after tokens ``prev`` (full-vocabulary ids), over the columns
        ``logits`` gives, and the tokens' rank-r embeddings."""
        if self.vocab_markov is None:
            return self.head.markov(prev)
        embed = self.head.markov_embed(prev)
        return self.vocab_markov(embed).float(), embed

    def confidence(self, hidden: torch.Tensor, markov_embeds: torch.Tensor) -> torch.Tensor:
        return self.head.confidence(hidden, markov_embeds)
