"""The Llama family (dense decoder: GQA, RoPE, SwiGLU, RMSNorm, optional tied embeddings),
on the same engine as V4: paged K/V pages from ``cache_spec()`` and the same ForwardBatch.

Parameter names follow the Hugging Face layout (``model.layers.{i}.self_attn.q_proj``), so
checkpoints written by ``transformers`` and our GGUF converter load by name.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch, LayerPools
from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.errors import CheckpointError
from deepinfer.kernels import cpu_decode_stack, cpu_norm_act, cpu_rope_store
from deepinfer.kernels.cpu_decode_stack import LlamaDecodeStack
from deepinfer.kernels.paged_attention import paged_attention, paged_attention_reference
from deepinfer.kernels.weight_only import PackedLinear, WeightOnlyLinear
from deepinfer.models.base import CausalLM
from deepinfer.models.layers.norms import RMSNorm

# a projection the engine runs: fused float weights or weight-only int8/int4
Projection = Callable[[torch.Tensor], torch.Tensor]


def _cpu_norms(batch: ForwardBatch, x: torch.Tensor) -> bool:
    """Whether an RMSNorm of ``x`` runs the C++ kernel (``cpu_norm_act``): an eager engine
    step (not a research call, not under compile) on an activation the kernel takes."""
    return not batch.functional and not torch.compiler.is_compiling() and cpu_norm_act.supports(x)


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: list[int] = field(default_factory=lambda: [2])

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head_dim={self.head_dim} must be even for RoPE")


def llama_config_from_dict(raw: dict[str, Any]) -> LlamaConfig:
    known = LlamaConfig.__dataclass_fields__
    cfg = LlamaConfig(**{k: raw[k] for k in known if k in raw and k != "eos_token_id"})
    if not cfg.head_dim:
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    params = raw.get("rope_parameters")
    if isinstance(params, dict):  # transformers >= 5 spelling
        cfg.rope_theta = float(params.get("rope_theta", cfg.rope_theta))
        if params.get("rope_type", "default") != "default":
            cfg.rope_scaling = params
    eos = raw.get("eos_token_id", 2)
    cfg.eos_token_id = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    cfg.validate()
    return cfg


def llama_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """RoPE inverse frequencies with the Llama scaling variants (default, linear, llama3)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    raise CheckpointError(f"config.json: unsupported rope scaling type {kind!r} for Llama")


def _fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate weights (and biases) and re-point each module's parameters at its slice:
    one matmul instead of several, no extra memory. Returns the fused weight and bias."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _fused(weight: torch.Tensor, bias: torch.Tensor | None) -> Projection:
    return functools.partial(F.linear, weight=weight, bias=bias)


def _weight_only(linears: list[nn.Linear], method: str) -> WeightOnlyLinear:
    """The linears' weights, concatenated, as a weight-only int8/int4 projection."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    return WeightOnlyLinear(weight, bias, method)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama RoPE: rotate the two halves of each head (cos/sin are [T, 1, D/2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.attention_bias)
        # the engine's projections (the research binding uses the parameters themselves)
        self.qkv: Projection | None = None
        self.out: Projection | None = None
        self.qkv_weight: torch.Tensor | None = None  # fused by ``fuse()`` (after loading)
        self.qkv_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        """One [q; k; v] weight, with the three projections' parameters as views into it:
        one matmul instead of three per step, no extra memory, names unchanged."""
        self.qkv_weight, self.qkv_bias = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        self.qkv = _fused(self.qkv_weight, self.qkv_bias)

    def quantize(self, method: str) -> None:
        self.qkv = _weight_only([self.q_proj, self.k_proj, self.v_proj], method)
        self.out = _weight_only([self.o_proj], method)

    def pack(self) -> None:
        if self.qkv_weight is None:
            self.fuse()
        self.qkv = PackedLinear(self.qkv_weight, self.qkv_bias)
        self.out = PackedLinear(self.o_proj.weight, self.o_proj.bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pools: LayerPools, batch: ForwardBatch
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        engine = not batch.functional  # research: the parameters themselves
        if self.qkv is not None and engine:
            qkv = self.qkv(x)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        assert pools.values is not None and batch.full is not None
        if (
            engine
            and not torch.compiler.is_compiling()
            and cpu_rope_store.supports(qkv, pools.window, pools.values)
        ):
            # eager CPU: RoPE and both cache writes in one call, bitwise the code below
            q = cpu_rope_store.rope_store(
                qkv, cos, sin, batch.window_write, pools.window, pools.values, self.n_heads, self.n_kv, d
            )
            keys, values = pools.window, pools.values
        else:
            # q and k heads sit side by side: one RoPE call rotates both
            qk = rotate_half_rope(qkv[:, : (self.n_heads + self.n_kv) * d].reshape(t, -1, d), cos, sin)
            q, k = qk[:, : self.n_heads], qk[:, self.n_heads :]
            v = qkv[:, (self.n_heads + self.n_kv) * d :]
            keys = batch.write(pools.window, batch.window_write, k.reshape(t, -1))
            values = batch.write(pools.values, batch.window_write, v)
        meta = batch.full
        # the op is for compiled steps (opaque to the tracer); eager steps and the research
        # binding (the op has no backward) call its implementation directly
        attend = paged_attention if torch.compiler.is_compiling() else paged_attention_reference
        out = attend(
            q,
            keys,
            values,
            meta.decode_rows,
            meta.decode_kv,
            meta.decode_valid,
            meta.span_meta,
            meta.span_kv_rows,
        )
        out = out.reshape(t, -1)
        return self.out(out) if self.out is not None and engine else self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self.gate_up: Projection | None = None
        self.down: Projection | None = None
        self.gate_up_weight: torch.Tensor | None = None  # fused by ``fuse()`` (after loading)
        self.gate_up_bias: torch.Tensor | None = None

    def fuse(self) -> None:
        self.gate_up_weight, self.gate_up_bias = _fuse_linears([self.gate_proj, self.up_proj])
        self.gate_up = _fused(self.gate_up_weight, self.gate_up_bias)

    def quantize(self, method: str) -> None:
        self.gate_up = _weight_only([self.gate_proj, self.up_proj], method)
        self.down = _weight_only([self.down_proj], method)

    def pack(self) -> None:
        if self.gate_up_weight is None:
            self.fuse()
        self.gate_up = PackedLinear(self.gate_up_weight, self.gate_up_bias)
        self.down = PackedLinear(self.down_proj.weight, self.down_proj.bias)

    def forward(self, x: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """``fused``: use the fused gate/up weight (the engine); the research binding runs
        the parameters themselves, so gradients and ``functional_call`` reach them."""
        if self.gate_up is not None and fused:
            gate_up = self.gate_up(x)
            if not torch.compiler.is_compiling() and cpu_norm_act.supports(gate_up):
                hidden = cpu_norm_act.silu_mul(gate_up)  # eager CPU decode: one call
                return self.down(hidden) if self.down is not None else self.down_proj(hidden)
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = F.silu(gate) * up
        return self.down(hidden) if self.down is not None and fused else self.down_proj(hidden)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        # tensor parallel: sums the row-parallel outputs (o_proj, down_proj) over the ranks
        # (set by distributed/tensor_parallel.py; None on one device)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pools: LayerPools, batch: ForwardBatch
    ) -> torch.Tensor:
        """h [T, d] -> [T, d] (on the research grid: [B, S, d])."""
        x = batch.to_flat(h)
        if _cpu_norms(batch, x):
            # eager CPU decode: each norm (the second with its residual add) in one call
            norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
            _, normed = cpu_norm_act.add_rms_norm(x, None, norm1.weight, norm1.eps)
            attn = self._sum(self.self_attn(normed, cos, sin, pools, batch))
            x, normed = cpu_norm_act.add_rms_norm(x, attn, norm2.weight, norm2.eps)
            return x + self._sum(self.mlp(normed))
        x = x + self._sum(self.self_attn(self.input_layernorm(x), cos, sin, pools, batch))
        x = x + self._sum(self.mlp(self.post_attention_layernorm(x), fused=not batch.functional))
        return batch.to_grid(x)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """A Llama-family decoder with transformers' module names (``model.embed_tokens``,
    ``model.layers[i].self_attn.q_proj``, ``lm_head``), so checkpoints load by name and
    research code finds what it expects."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._inv_freq = llama_inv_freq(cfg)  # host copy; the step reads a per-device one
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}
        self.head: Projection | None = None  # the engine's output projection (quantized or packed)
        # the engine's eager CPU decode steps: every layer in one C++ call (``pack_weights``)
        self.decode_stack: LlamaDecodeStack | None = None
        # tensor parallel with the vocabulary split (distributed/tensor_parallel.py): (this
        # rank's first token id, sum over the ranks, gather of the logits' columns)
        self.vocab_parallel: tuple[int, Callable, Callable] | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers (``model.layers``), at the top level as V4's are."""
        return self.model.layers

    def post_load(self, path: Path) -> None:
        """Called by the loader once weights are in place: fuse q/k/v and gate/up."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def quantize_weights(self, method: str) -> None:
        """Weight-only int8/int4 copies of every projection and the output head for the
        engine's steps (``kernels/weight_only.py``); the embedding and norms stay as loaded,
        and research calls keep computing with the float parameters."""
        for layer in self.model.layers:
            layer.self_attn.quantize(method)
            layer.mlp.quantize(method)
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        self.head = WeightOnlyLinear(weight, None, method)
        self.decode_stack = self._decode_stack()

    def pack_weights(self) -> None:
        """Packed copies of the float projections and the head for the engine's eager CPU
        steps (``kernels/weight_only.PackedLinear``: ``cpu_packed_gemm``'s layout for fp32,
        oneDNN's for bf16); quantized ones stay as they are."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if self.head is not None or not PackedLinear.available(weight):
            return  # quantized (or packed by an earlier engine) already
        for layer in self.model.layers:
            layer.self_attn.pack()
            layer.mlp.pack()
        self.head = PackedLinear(weight, None)
        self.decode_stack = self._decode_stack()

    def _decode_stack(self) -> LlamaDecodeStack | None:
        """The one-call decode driver over the engine's projections: packed fp32, int8 or int4
        weights (None for other dtypes, or where the CPU kernels did not build)."""
        cfg = self.config
        if self.model.embed_tokens.weight.dtype != torch.float32 or not cpu_decode_stack.available():
            return None
        if any(layer.reduce is not None for layer in self.model.layers):
            return None  # tensor parallel: the one-call stack has no cross-rank sum

        def projection(engine: Projection | None, weight: torch.Tensor | None, bias: torch.Tensor | None):
            """(weight, bias, scale, offset) of one projection as the driver reads it."""
            if isinstance(engine, WeightOnlyLinear):
                if engine.bias is not None:
                    raise ValueError("the stack runs quantized weights without bias")
                if engine.method == "int8":  # the packed copy (built wherever the stack is)
                    return engine.packed8, None, engine.scales_f32, None
                return engine.packed4, None, engine.scale4, engine.offset4
            assert weight is not None
            return weight.detach(), None if bias is None else bias.detach(), None, None

        try:
            layers = []
            for layer in self.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                engines = {"qkv": attn.qkv, "o": attn.out, "gate_up": mlp.gate_up, "down": mlp.down}
                layers.append(
                    {
                        "norm1": layer.input_layernorm.weight.detach(),
                        "qkv": projection(attn.qkv, attn.qkv_weight, attn.qkv_bias),
                        "o": projection(attn.out, attn.o_proj.weight, attn.o_proj.bias),
                        "gate_up": projection(mlp.gate_up, mlp.gate_up_weight, mlp.gate_up_bias),
                        "down": projection(mlp.down, mlp.down_proj.weight, mlp.down_proj.bias),
                        "norm2": layer.post_attention_layernorm.weight.detach(),
                        "vnni": {
                            name: engine.packed_vnni
                            for name, engine in engines.items()
                            if isinstance(engine, WeightOnlyLinear) and engine.packed_vnni is not None
                        },
                        "packed": {
                            name: engine.packed
                            for name, engine in engines.items()
                            if isinstance(engine, PackedLinear)
                        },
                    }
                )
            return LlamaDecodeStack(
                layers,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                cfg.intermediate_size,
                cfg.rms_norm_eps,
            )
        except ValueError:  # a layout the driver does not take
            return None

    def cache_spec(self) -> list[LayerCacheSpec]:
        kv_dim = self.config.num_key_value_heads * self.config.head_dim
        return [LayerCacheSpec(window=0, kv_dim=kv_dim, separate_values=True)] * self.config.num_hidden_layers

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE frequencies on ``device``, copied once: a step captured as a CUDA graph must
        not copy from the host (the capture's warm-up run fills this cache)."""
        inv = self._inv_freq_by_device.get(device)
        if inv is None:
            inv = self._inv_freq_by_device.setdefault(device, self._inv_freq.to(device))
        return inv

    def step_tables(self, device: torch.device) -> list[torch.Tensor]:
        """Per-device tables the step reads, made before ``torch.compile`` traces it."""
        return [self.inv_freq(device)]

    def _stack_pools(
        self, h: torch.Tensor, batch: ForwardBatch
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The pools when this step is an eager engine step the one-call driver covers (a few
        rows: decode rows, and prefill spans such as speculative verification's drafts where
        the span kernel takes them; nothing recorded; pools it reads); else None."""
        stack, meta = self.decode_stack, batch.full
        if stack is None or meta is None or batch.functional or batch.grid is not None:
            return None
        if batch.hidden_states is not None or torch.compiler.is_compiling():
            return None
        pools = [(p.window, p.values) for p in batch.pools]
        # padded steps carry spans of 0 tokens, which need no span kernel
        spans = bool(meta.span_meta[:, 1].any()) if meta.span_meta.shape[0] else False
        return pools if stack.supports(h, pools, spans=spans) else None

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One engine step (see ``CausalLM``): flat tokens in, logits for ``batch.logits_idx``."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq(positions.device)
        cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
        h = batch.to_grid(self._embed(input_ids))
        batch.record(h)
        pools = self._stack_pools(h, batch)
        if pools is not None:
            meta = batch.full
            assert meta is not None and self.decode_stack is not None
            h = self.decode_stack(
                h,
                cos,
                sin,
                batch.window_write,
                meta.decode_rows,
                meta.decode_kv,
                meta.decode_valid,
                pools,
                meta.span_meta,
                meta.span_kv_rows,
            )
        else:
            for layer, layer_pools in zip(self.model.layers, batch.pools, strict=True):
                h = layer(h, cos, sin, layer_pools, batch)
                batch.record(h)
        h = batch.to_flat(h)
        if batch.logits_idx is not None:
            h = h[batch.logits_idx]
        norm = self.model.norm
        if _cpu_norms(batch, h):
            _, h = cpu_norm_act.add_rms_norm(h, None, norm.weight, norm.eps)  # one call, as the layers' norms
        else:
            h = norm(h)
        if self.head is not None and not batch.functional:
            logits = self.head(h).float()
        else:
            weight = (
                self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
            )
            logits = F.linear(h, weight).float()
        return logits if self.vocab_parallel is None else self.vocab_parallel[2](logits)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; with a vocab-parallel embedding, this rank's rows (others zero)
        summed over the ranks."""
        weight = self.model.embed_tokens.weight
        if self.vocab_parallel is None:
            return self.model.embed_tokens(input_ids)
        offset, reduce, _ = self.vocab_parallel
        rows = weight.shape[0]
        local = (input_ids >= offset) & (input_ids < offset + rows)
        h = F.embedding((input_ids - offset).clamp(0, rows - 1), weight) * local.unsqueeze(-1).to(
            weight.dtype
        )
        return reduce(h)
