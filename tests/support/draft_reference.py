"""Dense references of the model drafters, computed from the checkpoint's weights alone.

- DSpark (V4.1 ``mtp.0..k-1``; the DSpark paper and the official ``DSparkBlock``): the block
  ``[anchor, noise x (g - 1)]`` runs through the stages, each a window-only V4.1 block (the
  one-site mHC lag, its own MoE) whose keys are the K=V vectors of the accepted context rows,
  projected from the target features by stage 0's ``main_proj``/``main_norm``, plus the whole
  block (no causal mask inside it); then the last stage's norm and the shared head, the Markov
  bigram bias left to right, and the confidence head on ``[h_k ; markov_embed(prev)]``.
- MTP (V4 ``mtp.0``; the official V4 ``MTPBlock``): each row's input is
  ``e_proj(enorm(embed(next token))) + h_proj(hnorm(streams))`` per stream, then a V4 block
  (each site collapses with its own ``pre`` mix, per-head query RMS norm) over a sliding
  window, V4's sigmoid ``hc_head`` collapse, its own norm, and the shared head; run k times.

Everything is plain fp32 torch over a state dict read from ``*.safetensors`` and a config read
from ``config.json`` by ``tests/support/v41_reference.py`` (no deepinfer code), one sequence at a time.
"""

from __future__ import annotations

import torch
from v41_reference import (
    ReferenceCheckpoint,
    hc_collapse,
    hc_expand,
    hc_mixes,
    linear,
    moe,
    queries,
    rms_norm,
    rope_frequencies,
    sink_attention_output,
    window_kv,
)


def _dense_attention(state, prefix, x, keys, positions, freqs, cfg, head_norm: bool = False):
    """Queries of x [1,T,d] at ``positions`` attend to every row of ``keys`` [1,L,D] (K = V)."""
    q, _ = queries(state, prefix, x, positions, freqs, cfg, head_norm=head_norm)
    scores = torch.einsum("bshd,bld->bshl", q, keys) * cfg.head_dim**-0.5
    return sink_attention_output(state, prefix, q, [scores], [keys], positions, freqs, cfg)


def _site(state, prefix: str, site: str, streams: torch.Tensor, cfg):
    return hc_mixes(
        streams,
        state[f"{prefix}hc_{site}_fn"],
        state[f"{prefix}hc_{site}_scale"],
        state[f"{prefix}hc_{site}_base"],
        cfg,
    )


@torch.no_grad()
def dspark_proposal(
    ckpt: ReferenceCheckpoint, features: torch.Tensor, anchor: int, k: int, fake_quant: bool
) -> tuple[list[int], list[float]]:
    """Greedy draft tokens and confidences for one sequence whose accepted positions are
    0..P-1 (``features`` [P, m*d]: the mean stream entering each target layer)."""
    state, cfg = ckpt.state, ckpt.cfg
    eps, n, g, w = cfg.rms_norm_eps, cfg.hc_mult, cfg.dspark_block_size, cfg.sliding_window
    stages = [f"mtp.{s}." for s in range(cfg.num_nextn_predict_layers)]
    moe_cfg = cfg.replace(
        n_routed_experts=cfg.dspark_n_routed_experts, num_experts_per_tok=cfg.dspark_num_experts_per_tok
    )
    freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, None)  # window-only layers
    p = features.shape[0]
    ctx_pos = torch.arange(max(0, p - w), p)
    main_x = rms_norm(
        linear(features[ctx_pos], state["mtp.0.main_proj.weight"]), state["mtp.0.main_norm.weight"], eps
    )
    ids = torch.tensor([[anchor] + [cfg.dspark_noise_token_id] * (g - 1)])
    pos = p + torch.arange(g)
    streams = state["embed.weight"][ids].unsqueeze(2).repeat(1, 1, n, 1)  # [1, g, n, d]
    pre_mix = torch.zeros(1, g, n)
    pre_mix[..., 0] = 1.0
    for L in stages:
        A = L + "attn."
        a_pre, a_post, a_comb = _site(state, L, "attn", streams, cfg)
        x = rms_norm(hc_collapse(streams, pre_mix), state[L + "attn_norm.weight"], eps)
        ctx_kv = window_kv(state, A, main_x[None], ctx_pos, freqs, cfg, fake_quant)
        block_kv = window_kv(state, A, x, pos, freqs, cfg, fake_quant)
        y = _dense_attention(state, A, x, torch.cat([ctx_kv, block_kv], dim=1), pos, freqs, cfg)
        streams = hc_expand(y, streams, a_post, a_comb)
        f_pre, f_post, f_comb = _site(state, L, "ffn", streams, cfg)
        x = rms_norm(hc_collapse(streams, a_pre), state[L + "ffn_norm.weight"], eps)
        streams = hc_expand(moe(state, L + "ffn.", x, moe_cfg), streams, f_post, f_comb)
        pre_mix = f_pre
    last = stages[-1]
    hidden = hc_collapse(streams, pre_mix)[0]  # [g, d]
    logits = linear(rms_norm(hidden, state[last + "norm.weight"], eps), state["head.weight"])
    markov_embed, markov_head = (
        state[last + "markov_head.embed.weight"],
        state[last + "markov_head.head.weight"],
    )
    confidence = state[last + "confidence_head.proj.weight"][0]
    tokens, conf, prev = [], [], anchor
    for i in range(k):
        emb = markov_embed[prev]
        tokens.append(int((logits[i] + markov_head @ emb).argmax()))
        conf.append(float(torch.sigmoid(confidence @ torch.cat([hidden[i], emb]))))
        prev = tokens[-1]
    return tokens, conf


@torch.no_grad()
def mtp_proposal(ckpt: ReferenceCheckpoint, streams: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """Greedy MTP-k drafts for one sequence: ``streams`` [P, n, d] are the backbone's final
    streams of accepted positions 0..P-1, ``tokens`` 0..P (P: the anchor)."""
    state, cfg = ckpt.state, ckpt.cfg
    L, eps, w = "mtp.0.", cfg.rms_norm_eps, cfg.sliding_window
    A = L + "attn."
    freqs = rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, None)  # a sliding layer

    def merge(next_tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[R] tokens and [R, n, d] streams -> block input [1, R, n, d]."""
        e = linear(
            rms_norm(state["embed.weight"][next_tokens], state[L + "enorm.weight"], eps),
            state[L + "e_proj.weight"],
        )
        h = linear(rms_norm(rows, state[L + "hnorm.weight"], eps), state[L + "h_proj.weight"])
        return (e.unsqueeze(1) + h).unsqueeze(0)

    def attn_input(x: torch.Tensor) -> torch.Tensor:
        pre, _, _ = _site(state, L, "attn", x, cfg)
        return rms_norm(hc_collapse(x, pre), state[L + "attn_norm.weight"], eps)

    p = streams.shape[0]
    rows = torch.arange(max(0, p - w), p)
    x = merge(torch.tensor(tokens)[rows + 1], streams[rows])
    keys = window_kv(state, A, attn_input(x), rows, freqs, cfg, False)[
        :, :-1
    ]  # the first draft row adds P - 1
    out, row_streams, token = [], streams[p - 1 : p], torch.tensor([tokens[p]])
    for i in range(k):
        pos = torch.tensor([p - 1 + i])
        x = merge(token, row_streams)
        pre, post, comb = _site(state, L, "attn", x, cfg)
        a_in = rms_norm(hc_collapse(x, pre), state[L + "attn_norm.weight"], eps)
        kv = window_kv(state, A, a_in, pos, freqs, cfg, False)
        window = torch.cat([keys[:, -(w - 1) :] if w > 1 else keys[:, :0], kv], dim=1)
        x = hc_expand(
            _dense_attention(state, A, a_in, window, pos, freqs, cfg, head_norm=True), x, post, comb
        )
        pre, post, comb = _site(state, L, "ffn", x, cfg)
        y = moe(state, L + "ffn.", rms_norm(hc_collapse(x, pre), state[L + "ffn_norm.weight"], eps), cfg)
        x = hc_expand(y, x, post, comb)
        keys = torch.cat([keys, kv], dim=1)
        # V4's hc_head: a sigmoid-only pre mix (no Sinkhorn), then the MTP layer's own norm
        flat = x.flatten(-2)
        m = linear(flat, state[L + "hc_head_fn"]) * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + eps)
        pre = torch.sigmoid(m * state[L + "hc_head_scale"] + state[L + "hc_head_base"]) + cfg.hc_eps
        head_in = rms_norm(hc_collapse(x, pre), state[L + "norm.weight"], eps)
        token = linear(head_in, state["head.weight"])[0].argmax(dim=-1)
        out.append(int(token))
        row_streams = x[0]
    return out
