"""A dense reference of a Llama-family DSpark head's proposal, from the files alone.

Reads the head's ``config.json`` and ``model.safetensors`` and the target's embedding (or
``lm_head``) with ``safetensors`` and ``json`` only (no deepinfer code), and computes one
sequence's proposal loop by loop: the context rows' keys and values from the projected target
features, each block row attending head by head to the context window and the whole block,
the layers' SwiGLU, the norm and the target's head, then left to right the Markov bigram bias,
the argmax draft (over the draft vocabulary where the head has one) and the calibrated confidence of ``[h_k ; markov_embed(prev)]``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file


def _read(directory: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of one head's vector ``x`` [hd] at position ``pos``."""
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for i in range(half):
        angle = pos / theta ** (2 * i / x.shape[-1])
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


class HeadReference:
    def __init__(self, head_dir: Path, target_dir: Path) -> None:
        self.cfg = json.loads((head_dir / "config.json").read_text())
        self.w = _read(head_dir)
        target = _read(target_dir)
        self.embed = target["model.embed_tokens.weight"].float()
        self.out = target.get("lm_head.weight", self.embed).float()

    def _kv(self, layer: int, x: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [KV, hd] (roped) and values [KV, hd] of one row ``x`` [d] at ``pos``."""
        c = self.cfg
        kv = self.w[f"layers.{layer}.kv_proj.weight"] @ x
        k, v = kv.view(2, c["num_kv_heads"], c["head_dim"])
        return torch.stack([_rope(h, pos, c["rope_theta"]) for h in k]), v

    def propose(self, features: torch.Tensor, anchor: int, anchor_pos: int) -> tuple[list[int], list[float]]:
        """Greedy drafts and confidences after context features [P, m*d] (rows 0 .. P-1)."""
        c, w = self.cfg, self.w
        eps, g, hd = c["rms_norm_eps"], c["block_size"], c["head_dim"]
        n_heads, n_kv = c["num_heads"], c["num_kv_heads"]
        ctx = range(max(0, anchor_pos - c["window"]), anchor_pos)
        main = {p: _rms(w["main_proj.weight"] @ features[p], w["main_norm.weight"], eps) for p in ctx}
        rows = [self.embed[anchor]] + [w["noise_embed"]] * (g - 1)
        x = torch.stack(rows)
        for layer in range(c["num_layers"]):
            pre = f"layers.{layer}."
            a = torch.stack([_rms(r, w[pre + "input_norm.weight"], eps) for r in x])
            keys, values = [], []
            for p in ctx:
                k, v = self._kv(layer, main[p], p)
                keys.append(k)
                values.append(v)
            for i in range(g):
                k, v = self._kv(layer, a[i], anchor_pos + i)
                keys.append(k)
                values.append(v)
            out = torch.zeros(g, n_heads * hd)
            for i in range(g):
                q = (w[pre + "q_proj.weight"] @ a[i]).view(n_heads, hd)
                for h in range(n_heads):
                    qh = _rope(q[h], anchor_pos + i, c["rope_theta"])
                    kvh = h // (n_heads // n_kv)
                    scores = torch.stack([qh @ k[kvh] for k in keys]) / math.sqrt(hd)
                    probs = torch.softmax(scores, dim=0)
                    out[i, h * hd : (h + 1) * hd] = sum(
                        pr * v[kvh] for pr, v in zip(probs, values, strict=True)
                    )
            x = x + out @ w[pre + "o_proj.weight"].T
            inter = c["intermediate_size"]
            gu = (
                torch.stack([_rms(r, w[pre + "post_norm.weight"], eps) for r in x])
                @ w[pre + "gate_up.weight"].T
            )
            x = x + (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ w[pre + "down.weight"].T
        logits = torch.stack([_rms(r, w["norm.weight"], eps) for r in x]) @ self.out.T
        prev, tokens, conf = anchor, [], []
        for i in range(g):
            m = w["markov_embed.weight"][prev]
            row = logits[i] + w["markov_head.weight"] @ m
            if "draft_vocab" in w:  # drafts only from the draft vocabulary
                vocab = w["draft_vocab"]
                tok = int(vocab[torch.argmax(row[vocab])])
            else:
                tok = int(torch.argmax(row))
            z = w["confidence_head.weight"][0] @ torch.cat([x[i], m]) + w["confidence_head.bias"][0]
            conf.append(float(torch.sigmoid(z / w["confidence_temperature"][i])))
            tokens.append(tok)
            prev = tok
        return tokens, conf
