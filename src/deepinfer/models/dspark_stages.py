"""The DSpark draft stages of V4.1 (``mtp.0..k-1`` in the checkpoint; model_spec.md §2.8).

Each stage is a sliding-window-only V4.1 block with its own smaller MoE. Stage 0 also projects
the target layers' input means (``main_proj``, ``main_norm``); the last stage carries the final
``norm``, the Markov head (a rank-``dspark_markov_rank`` bigram logit bias) and the confidence
head. The stages share ``embed`` and ``head`` with the backbone. This module holds the weights;
the drafting loop that runs them belongs to speculative decoding (``deepinfer.speculative``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from deepinfer.models.deepseek_v41_config import DeepseekV41Config, LayerRole
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.rope import Rotary

if TYPE_CHECKING:
    from deepinfer.models.deepseek_v41 import LaggedBlock


class MarkovHead(nn.Module):
    """A low-rank bigram model: previous token -> rank-r embedding -> logit bias."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """Scores how likely a drafted position is to be accepted (fp32 linear to one logit)."""

    def __init__(self, in_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_dim, 1, bias=False)


def build_dspark_stages(cfg: DeepseekV41Config, main_rope: Rotary) -> nn.ModuleList:
    """The ``mtp`` stages (empty when the config has no DSpark head)."""
    from deepinfer.models.deepseek_v41 import LaggedBlock, moe_config_for_dspark

    stages = nn.ModuleList()
    n = cfg.num_nextn_predict_layers
    if not n or not cfg.dspark_block_size:
        return stages
    moe_cfg = moe_config_for_dspark(cfg)
    for k in range(n):
        window_only = LayerRole(cfg.num_hidden_layers + k, 0, None, None, False, False, False)
        stage: LaggedBlock = LaggedBlock(cfg, window_only, main_rope, main_rope, 0, moe_cfg)
        if k == 0:
            stage.main_proj = nn.Linear(
                cfg.hidden_size * len(cfg.dspark_target_layer_ids), cfg.hidden_size, bias=False
            )
            stage.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if k == n - 1:
            stage.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            stage.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            stage.confidence_head = ConfidenceHead(cfg.hidden_size + cfg.dspark_markov_rank)
        stages.append(stage)
    return stages
