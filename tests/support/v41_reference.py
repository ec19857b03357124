"""An independent, slow, dense re-implementation of the DeepSeek-V4.1-Flash forward pass.

Written from the model's published description (configuration, layer roles, mHC, attention,
compressor and indexer, MoE, Engram, QAT fake-quant), not from the engine's code: one-shot
prefill of full sequences ``[B, S]`` starting at position 0, no paging, no cache, every step
in plain fp32 torch over the whole sequence, and the full logits ``[B, S, V]``.

It reads the checkpoint directory itself, with no deepinfer code at all
(``tests/support/reference_checkpoint.py``): the tensors of ``*.safetensors`` in the official layout,
the fields of ``config.json`` (``text_config`` when the config is composite), and Engram's
compressed token map built from ``tokenizer.json`` by Engram's hashing rule. The QAT
fake-quant formats are written out here too. So a loader, naming,
config or token-map bug in the engine shows up as a parity failure instead of being shared.

Use::

    ref = read_checkpoint(path)
    logits = reference_logits(ref, ids, fake_quant=True)
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from reference_checkpoint import ReferenceCheckpoint, Spec, read_checkpoint

__all__ = ["ReferenceCheckpoint", "Spec", "read_checkpoint", "reference_logits"]

NEG_INF = float("-inf")


# -- QAT fake-quant (a trailing dim that is not a multiple of the block is left alone) ---------

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    if x.shape[-1] % block:
        return None
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pow2_scale(blocks: torch.Tensor, qmax: float) -> torch.Tensor:
    """ue8m0 scale 2^ceil(log2(amax / qmax)), amax clamped at 1e-4, exact via frexp."""
    ratio = blocks.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4) / qmax
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(ratio), exponent - (mantissa == 0.5).int())


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 value (magnitudes clamped at 6); at a tie the even code (index)."""
    mag = x.abs().clamp(max=6.0).unsqueeze(-1)
    dist = (mag - E2M1_GRID).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    prefer_even = nearest.int() * (2 - torch.arange(8) % 2)  # among ties (two codes) the even one
    return torch.copysign(E2M1_GRID[prefer_even.argmax(dim=-1)], x)


def fq_fp8_pow2(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Window K=V: fp8 e4m3, 32-blocks, ue8m0 scales (KERN ``act_quant``)."""
    g = _blocks(x, block)
    if g is None:
        return x
    scale = _pow2_scale(g, 448.0)
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


def fq_fp4_pow2(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Indexer queries and keys: fp4 e2m1, 32-blocks, ue8m0 scales."""
    g = _blocks(x, block)
    if g is None:
        return x
    scale = _pow2_scale(g, 6.0)
    return (round_to_e2m1(g / scale) * scale).reshape(x.shape)


def fq_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Compressed latent: fp4 e2m1, 16-blocks, scale clamp(amax, 6*2^-9) / 6 cast to e4m3."""
    g = _blocks(x, block)
    if g is None:
        return x
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=6.0 * 2**-9)
    scale = (amax / 6.0).to(torch.float8_e4m3fn).float()
    return (round_to_e2m1(g / scale) * scale).reshape(x.shape)


# -- small pieces -------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps), in fp32."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear without bias: weight is [out, in]."""
    return x.float() @ weight.float().t()


def rope_frequencies(dim: int, base: float, yarn) -> torch.Tensor:
    """Per-pair angular frequencies [dim/2] (YaRN without mscale when ``yarn``)."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if yarn is not None:
        orig = yarn.original_max_position_embeddings

        def corr(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(yarn.beta_fast)), 0)
        high = min(math.ceil(corr(yarn.beta_slow)), dim - 1)
        i = torch.arange(dim // 2, dtype=torch.float64)
        ramp = ((i - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
        freqs = freqs / yarn.factor * ramp + freqs * (1.0 - ramp)
    return freqs


def rotate(
    x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the LAST ``2*len(freqs)`` channels of x [B, P, (H,) C] as adjacent pairs
    (a + ib) by e^{i p f} (its conjugate when ``inverse``), p = ``positions[P]``."""
    rd = 2 * freqs.numel()
    angles = positions.double()[:, None] * freqs[None, :]  # [P, rd/2]
    rot = torch.polar(torch.ones_like(angles), angles)  # complex128
    if inverse:
        rot = rot.conj()
    head, tail = x[..., :-rd], x[..., -rd:]
    pairs = torch.view_as_complex(tail.double().contiguous().reshape(*tail.shape[:-1], rd // 2, 2))
    shape = [1] * pairs.dim()
    shape[1], shape[-1] = rot.shape
    rotated = torch.view_as_real(pairs * rot.reshape(shape)).flatten(-2).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)


# -- mHC ------------------------------------------------------------------------------------


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, cfg):
    """h [B,S,n,d] -> pre [B,S,n], post [B,S,n], comb [B,S,n,n]."""
    n = cfg.hc_mult
    eps = cfg.hc_eps
    flat = h.float().flatten(-2)
    m = (flat @ fn.float().t()) * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + cfg.rms_norm_eps)
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
    post = 2.0 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    c = (m[..., 2 * n :] * scale[2] + base[2 * n :]).reshape(*m.shape[:-1], n, n)
    c = torch.softmax(c, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return pre, post, c


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_c pre_c h_c: [B,S,n,d], [B,S,n] -> [B,S,d]."""
    out = torch.zeros_like(h[:, :, 0]).float()
    for c in range(h.shape[2]):
        out = out + pre[:, :, c : c + 1] * h[:, :, c].float()
    return out


def hc_expand(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[c'] = post_c' y + sum_c comb[c, c'] R_c."""
    n = res.shape[2]
    outs = []
    for cp in range(n):
        o = post[:, :, cp : cp + 1] * y
        for c in range(n):
            o = o + comb[:, :, c, cp : cp + 1] * res[:, :, c].float()
        outs.append(o)
    return torch.stack(outs, dim=2)


# -- layer roles ----------------------------------------------------------------------------


def layer_roles(cfg) -> list[dict]:
    roles = []
    kv_src = sorted(cfg.kv_source_layer_ids)
    idx_src = sorted(cfg.index_source_layer_ids)
    cand = cfg.candidate_source_layer_id
    for i in range(cfg.num_hidden_layers):
        r = cfg.compress_ratios[i]
        if r == 0:
            roles.append(dict(ratio=0, kv_source=None, index_source=None))
            continue
        kv = max(s for s in kv_src if s <= i)
        ix = max(s for s in idx_src if s <= i)
        roles.append(
            dict(
                ratio=r,
                kv_source=kv,
                index_source=ix,
                owns_kv=kv == i,
                scores=ix == i,
                is_candidate_source=cand is not None and i == cand,
                uses_candidates=cand is not None and i == ix and ix > cand,
            )
        )
    return roles


# -- compressor and index keys --------------------------------------------------------------


def compress(state, prefix: str, x: torch.Tensor, ratio: int, cfg) -> torch.Tensor:
    """Pre-RoPE latents [B, S//ratio, D] from the attention input x [B,S,d]."""
    eps = cfg.rms_norm_eps
    norm_w = state[prefix + "compressor.norm.weight"]
    kv = linear(x, state[prefix + "compressor.wkv.weight"])
    if ratio == 1:
        return rms_norm(kv, norm_w, eps)
    score = linear(x, state[prefix + "compressor.wgate.weight"])
    B, S, D = kv.shape
    groups = S // ratio
    latents = []
    for j in range(groups):
        k = kv[:, j * ratio : (j + 1) * ratio]  # [B, r, D]
        s = score[:, j * ratio : (j + 1) * ratio]
        w = torch.softmax(s, dim=1)  # over the r tokens, per channel
        latents.append((w * k).sum(dim=1))
    if not latents:
        return kv.new_zeros(B, 0, D)
    return rms_norm(torch.stack(latents, dim=1), norm_w, eps)


# -- indexer and two-level top-k ------------------------------------------------------------


def index_scores(state, prefix, x, qr, keys, ratio, positions, freqs, cfg, fake_quant) -> torch.Tensor:
    """I(p, j) [B,S,E] with -inf where j >= (p+1)//ratio."""
    B, S, _ = x.shape
    nh, hd = cfg.index_n_heads, cfg.index_head_dim
    q = linear(qr, state[prefix + "indexer.wq_b.weight"]).reshape(B, S, nh, hd)
    q = rotate(q, positions, freqs)
    if fake_quant:
        q = fq_fp4_pow2(q)
    w = linear(x, state[prefix + "indexer.weights_proj.weight"]) * hd**-0.5 * nh**-0.5  # [B,S,nh]
    dots = torch.einsum("bshk,bek->bshe", q, keys)
    scores = (w.unsqueeze(-1) * torch.relu(dots)).sum(dim=2)  # [B,S,E]
    E = keys.shape[1]
    vis = (positions + 1) // ratio  # [S]
    invisible = torch.arange(E)[None, :] >= vis[:, None]  # [S,E]
    return scores.masked_fill(invisible[None], NEG_INF)


def _stable_topk(values: list[float], k: int) -> list[int]:
    """Indices of the k best finite values; ties prefer the lower index."""
    finite = [(v, j) for j, v in enumerate(values) if v != NEG_INF]
    finite.sort(key=lambda t: (-t[0], t[1]))
    return [j for _, j in finite[:k]]


def candidate_mask(scores: torch.Tensor, ratio: int, positions: torch.Tensor, cfg) -> torch.Tensor:
    """Boolean [B,S,E]: entries inside the kept candidate blocks of each query row."""
    B, S, E = scores.shape
    bs = cfg.candidate_block_size
    mask = torch.zeros(B, S, E, dtype=torch.bool)
    n_blocks = -(-E // bs)
    for b in range(B):
        for s in range(S):
            row = scores[b, s].tolist() + [NEG_INF] * (n_blocks * bs - E)
            blocks = [max(row[k * bs : (k + 1) * bs]) for k in range(n_blocks)]
            vis = (int(positions[s]) + 1) // ratio
            if vis > 0:
                blocks[(vis - 1) // bs] = float("inf")
            for k in _stable_topk(blocks, cfg.candidate_topk_blocks):
                mask[b, s, k * bs : min((k + 1) * bs, E)] = True
    return mask


def choose_topk(scores: torch.Tensor, cfg) -> torch.Tensor:
    """Boolean [B,S,E]: the index_topk best finite entries of each row."""
    B, S, E = scores.shape
    chosen = torch.zeros(B, S, E, dtype=torch.bool)
    for b in range(B):
        for s in range(S):
            for j in _stable_topk(scores[b, s].tolist(), cfg.index_topk):
                chosen[b, s, j] = True
    return chosen


# -- attention ------------------------------------------------------------------------------


def queries(state, prefix, x, positions, freqs, cfg, head_norm: bool = False):
    """Rotated queries [B,S,H,D] and the query residual qr = q_norm(wq_a(x)); ``head_norm``:
    V4's unweighted RMS norm of each query head (HF4 ``q_b_norm``; V4.1 has none)."""
    B, S, _ = x.shape
    H, D = cfg.num_attention_heads, cfg.head_dim
    eps = cfg.rms_norm_eps
    qr = rms_norm(linear(x, state[prefix + "wq_a.weight"]), state[prefix + "q_norm.weight"], eps)
    q = linear(qr, state[prefix + "wq_b.weight"]).reshape(B, S, H, D)
    if head_norm:
        q = q * torch.rsqrt(q.pow(2).mean(dim=-1, keepdim=True) + eps)
    return rotate(q, positions, freqs), qr


def window_kv(state, prefix, x, positions, freqs, cfg, fake_quant) -> torch.Tensor:
    """The shared K=V vector [B,S,D]: kv_norm(wkv(x)), rotated, fp8-rounded with fake-quant."""
    kv = rms_norm(linear(x, state[prefix + "wkv.weight"]), state[prefix + "kv_norm.weight"], cfg.rms_norm_eps)
    kv = rotate(kv, positions, freqs)
    return fq_fp8_pow2(kv) if fake_quant else kv


def sink_attention_output(state, prefix, q, logits, values, positions, freqs, cfg) -> torch.Tensor:
    """Softmax over the masked score sets ``logits`` ([B,S,H,L_i]) plus the per-head sink,
    K = V ``values`` ([B,L_i,D]), the inverse RoPE at the query positions, and the grouped
    low-rank output projection."""
    B, S, H, _ = q.shape
    sink = state[prefix + "attn_sink"].float().reshape(1, 1, H, 1).expand(B, S, H, 1)
    probs = torch.softmax(torch.cat([*logits, sink], dim=-1), dim=-1)[
        ..., :-1
    ]  # the sink only enlarges the denominator
    o = torch.einsum("bshj,bjd->bshd", probs, torch.cat(values, dim=1))
    o = rotate(o, positions, freqs, inverse=True)
    G = cfg.o_groups
    o = o.reshape(B, S, G, H * cfg.head_dim // G)
    wo_a = state[prefix + "wo_a.weight"].float().reshape(G, cfg.o_lora_rank, H * cfg.head_dim // G)
    o = torch.einsum("bsgd,grd->bsgr", o, wo_a).flatten(2)
    return linear(o, state[prefix + "wo_b.weight"])


def attention(state, prefix, x, positions, freqs, cfg, fake_quant, entries, chosen) -> torch.Tensor:
    """x [B,S,d] (after attn_norm); entries [B,E,D] (roped, quantised) or None; chosen [B,S,E]."""
    q, _ = queries(state, prefix, x, positions, freqs, cfg)
    kv = window_kv(state, prefix, x, positions, freqs, cfg, fake_quant)
    W = cfg.sliding_window
    p = positions[:, None]
    t = positions[None, :]
    window = (t <= p) & (t >= p - W + 1)  # [S(query), S(key)]
    scale = cfg.head_dim**-0.5
    s_win = torch.einsum("bshd,btd->bsht", q, kv) * scale
    logits = [s_win.masked_fill(~window[None, :, None, :], NEG_INF)]
    values = [kv]
    if entries is not None and entries.shape[1] > 0:
        s_cmp = torch.einsum("bshd,bed->bshe", q, entries) * scale
        logits.append(s_cmp.masked_fill(~chosen[:, :, None, :], NEG_INF))
        values.append(entries)
    return sink_attention_output(state, prefix, q, logits, values, positions, freqs, cfg)


# -- MoE ------------------------------------------------------------------------------------


def expert(state, prefix, x, limit) -> torch.Tensor:
    g = linear(x, state[prefix + "w1.weight"]).clamp(max=limit)
    u = linear(x, state[prefix + "w3.weight"]).clamp(-limit, limit)
    return linear(F.silu(g) * u, state[prefix + "w2.weight"])


def moe(state, prefix, x, cfg) -> torch.Tensor:
    B, S, d = x.shape
    flat = x.reshape(-1, d)
    logits = linear(flat, state[prefix + "gate.weight"])
    assert cfg.scoring_func == "sqrtsoftplus"
    scores = torch.sqrt(F.softplus(logits))
    ids = torch.topk(scores + state[prefix + "gate.bias"].float(), cfg.num_experts_per_tok, dim=-1).indices
    w = scores.gather(-1, ids)
    if cfg.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * cfg.routed_scaling_factor
    out = torch.zeros(flat.shape[0], d)
    L = cfg.swiglu_limit
    for e in range(cfg.n_routed_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)  # the tokens routed to expert e
        if tok.numel():
            y = expert(state, f"{prefix}experts.{e}.", flat[tok], L)
            out.index_add_(0, tok, w[tok, slot, None] * y)
    out = out + expert(state, prefix + "shared_experts.", flat, L)
    return out.reshape(B, S, d)


# -- Engram ---------------------------------------------------------------------------------


def _is_prime(v: int) -> bool:
    if v < 2:
        return False
    k = 2
    while k * k <= v:
        if v % k == 0:
            return False
        k += 1
    return True


def engram_layout(cfg):
    """primes[layer][size-2][head], offsets[layer][col], multipliers[layer][s] (Python ints)."""
    seen: set[int] = set()
    primes, offsets, mults = {}, {}, {}
    C = cfg.engram_compressed_vocab_size
    for layer in cfg.engram_layer_ids:
        per_size = []
        for _size in range(2, cfg.engram_max_ngram_size + 1):
            cur = cfg.engram_vocab_size - 1
            heads = []
            for _h in range(cfg.engram_n_heads):
                cand = cur + 1
                while not _is_prime(cand) or cand in seen:
                    cand += 1
                seen.add(cand)
                heads.append(cand)
                cur = cand
            per_size.append(heads)
        primes[layer] = per_size
        flat = [pr for heads in per_size for pr in heads]
        offsets[layer] = [sum(flat[:k]) for k in range(len(flat))]
        rng = np.random.default_rng(10007 * layer)
        high = (np.iinfo(np.int64).max // C) // 2
        mults[layer] = [
            int(2 * v + 1) for v in rng.integers(0, high, cfg.engram_max_ngram_size, dtype=np.int64)
        ]
    return primes, offsets, mults


def engram_hash(ids: torch.Tensor, token_map: torch.Tensor, layer: int, layout, cfg) -> torch.Tensor:
    """[B,S] token ids -> [B,S,(max_ngram-1)*n_heads] table rows, with Python ints."""
    primes, offsets, mults = layout
    n_heads, N = cfg.engram_n_heads, cfg.engram_max_ngram_size
    pad = int(token_map[cfg.engram_pad_token_id])
    B, S = ids.shape
    out = torch.zeros(B, S, (N - 1) * n_heads, dtype=torch.long)
    for b in range(B):
        comp = [int(token_map[int(t)]) for t in ids[b]]
        for t in range(S):
            toks = [comp[t - s] if t - s >= 0 else pad for s in range(N)]
            m = mults[layer]
            v = toks[0] * m[0]
            for s in range(1, N):
                v ^= toks[s] * m[s]
                for h in range(n_heads):
                    col = (s - 1) * n_heads + h
                    out[b, t, col] = v % primes[layer][s - 1][h] + offsets[layer][col]
    return out


def engram(state, prefix, h: torch.Tensor, rows: torch.Tensor, cfg) -> torch.Tensor:
    """h [B,S,n,d] streams; rows [B,S,cols] -> updated streams."""
    B, S, n, d = h.shape
    eps = cfg.rms_norm_eps
    table = state[prefix + "embed.weight"].float()
    e = table[rows].reshape(B, S, -1)  # concat of the rows in column order
    kv = linear(e, state[prefix + "wkv.weight"])
    key = kv[..., : n * d].reshape(B, S, n, d)
    value = kv[..., n * d :]  # [B,S,d]
    Wqk = state[prefix + "q_weight"].float() * state[prefix + "k_weight"].float()  # [n,d]
    hf = h.float()
    dot = (hf * Wqk * key).sum(dim=-1)
    dot = (
        dot * torch.rsqrt(hf.pow(2).mean(dim=-1) + eps) * torch.rsqrt(key.pow(2).mean(dim=-1) + eps) * d**-0.5
    )
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))  # [B,S,n]
    return hf + gate.unsqueeze(-1) * value.unsqueeze(2)


# -- the whole model ------------------------------------------------------------------------


@torch.no_grad()
def reference_logits(
    ckpt: ReferenceCheckpoint | str | Path,
    input_ids: torch.Tensor,
    fake_quant: bool,
    *,
    same_site_pre: bool = False,
) -> torch.Tensor:
    """Full fp32 logits [B,S,V] of a one-shot prefill from position 0 of the checkpoint
    ``ckpt`` (a directory, or what ``read_checkpoint`` read from one).

    ``same_site_pre=True`` is the V4-style (wrong for V4.1) variant without the one-site mHC
    lag: each sublayer's input is collapsed with its own site's ``pre`` mix.
    """
    if not isinstance(ckpt, ReferenceCheckpoint):
        ckpt = read_checkpoint(ckpt)
    state, cfg, token_map = ckpt.state, ckpt.cfg, ckpt.token_map
    B, S = input_ids.shape
    n = cfg.hc_mult
    eps = cfg.rms_norm_eps
    positions = torch.arange(S)
    main_freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, None)
    comp_freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.yarn)
    roles = layer_roles(cfg)
    layout = engram_layout(cfg) if cfg.engram_layer_ids else None

    h0 = state["embed.weight"].float()[input_ids]  # [B,S,d]
    h = h0.unsqueeze(2).repeat(1, 1, n, 1)
    pre_mix = torch.zeros(B, S, n)
    pre_mix[..., 0] = 1.0

    entries: dict[int, torch.Tensor] = {}  # kv source -> roped (quantised) entries [B,E,D]
    index_keys: dict[int, torch.Tensor] = {}  # kv source -> index keys [B,E,hd]
    chosen: dict[int, torch.Tensor] = {}  # index source -> [B,S,E] chosen entries
    candidates: torch.Tensor | None = None

    for i, role in enumerate(roles):
        L = f"layers.{i}."
        if i in cfg.engram_layer_ids:
            rows = engram_hash(input_ids, token_map, i, layout, cfg)
            h = engram(state, L + "engram.", h, rows, cfg)

        # attention site
        res = h
        a_pre, a_post, a_comb = hc_mixes(
            h, state[L + "hc_attn_fn"], state[L + "hc_attn_scale"], state[L + "hc_attn_base"], cfg
        )
        x = rms_norm(hc_collapse(h, a_pre if same_site_pre else pre_mix), state[L + "attn_norm.weight"], eps)
        A = L + "attn."
        r = role["ratio"]
        freqs = comp_freqs if r else main_freqs
        ent, sel = None, None
        if r:
            if role["owns_kv"]:
                latent = compress(state, A, x, r, cfg)  # pre-RoPE [B,E,D]
                E = latent.shape[1]
                epos = torch.arange(E) * r
                stored = rotate(latent, epos, freqs)
                if fake_quant:
                    stored = fq_fp4_e4m3(stored)
                entries[i] = stored
                k = rms_norm(
                    linear(latent, state[A + "indexer.wk.weight"]), state[A + "indexer.k_norm.weight"], eps
                )
                k = rotate(k, epos, freqs)
                if fake_quant:
                    k = fq_fp4_pow2(k)
                index_keys[i] = k
            ent = entries[role["kv_source"]]
        # the indexer reads this layer's attention query residual qr (same formula as in attention)
        if r and role["scores"]:
            qr = rms_norm(linear(x, state[A + "wq_a.weight"]), state[A + "q_norm.weight"], eps)
            keys = index_keys[role["kv_source"]]
            scores = index_scores(state, A, x, qr, keys, r, positions, freqs, cfg, fake_quant)
            if role["is_candidate_source"]:
                candidates = candidate_mask(scores, r, positions, cfg)
            elif role["uses_candidates"]:
                scores = scores.masked_fill(~candidates, NEG_INF)
            chosen[i] = choose_topk(scores, cfg)
        if r:
            sel = chosen[role["index_source"]]
        y = attention(state, A, x, positions, freqs, cfg, fake_quant, ent, sel)
        h = hc_expand(y, res, a_post, a_comb)

        # FFN site
        res = h
        f_pre, f_post, f_comb = hc_mixes(
            h, state[L + "hc_ffn_fn"], state[L + "hc_ffn_scale"], state[L + "hc_ffn_base"], cfg
        )
        x = rms_norm(hc_collapse(h, f_pre if same_site_pre else a_pre), state[L + "ffn_norm.weight"], eps)
        y = moe(state, L + "ffn.", x, cfg)
        h = hc_expand(y, res, f_post, f_comb)
        pre_mix = f_pre

    x = rms_norm(hc_collapse(h, pre_mix), state["norm.weight"], eps)
    return linear(x, state["head.weight"])
