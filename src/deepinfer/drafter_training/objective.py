"""DSpark's training objective on blocks cut from self-distillation data (paper §3, eq. 12).

A block anchored at position ``a`` of a sequence has the anchor token at ``a`` (the token the
target emitted last), sees the target's features of positions ``[a - W, a - 1]`` and predicts
the tokens at ``a + 1 .. a + g``. Row ``k`` is scored three ways, each weighted by
``exp(-k / decay)`` and masked past the sequence's end:

- cross entropy against the data's token (the Markov head teacher-forced with the data's
  previous token);
- the total variation distance between the draft's and the target's distributions (the
  draft's over its draft vocabulary, the target's exact, from its full log-normaliser);
- the confidence head's binary cross entropy against the chance that row ``k`` survives
  verification given the rows before it did: ``1 - TV`` for sampled decoding (the paper's soft
  label), or whether the draft's argmax is the target's for greedy decoding.

Total: ``0.1 * CE + 0.9 * TV + 1.0 * confidence`` (the paper's weights), plus, with
``soft_weight``, the cross entropy against the target's whole distribution (EAGLE's
distillation term): total variation's gradient fades where the two distributions barely
overlap, which is where a head trained from scratch starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.drafter_training.dataset import DistillSet
from deepinfer.models.dspark_head import DSparkHead

CE_WEIGHT, TV_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
DECAY = 4.0  # exp(-k / DECAY) per block row


@dataclass
class Blocks:
    """One training batch: the chosen sequences' rows and the blocks cut from them."""

    ctx_rows: torch.Tensor  # [P] rows of the data set whose features the blocks read
    ctx_positions: torch.Tensor  # [P] their positions in their sequences
    window_index: torch.Tensor  # [A, W] index into ctx rows (clamped where not visible)
    visible: torch.Tensor  # [A, W] bool
    anchors: torch.Tensor  # [A] anchor tokens
    positions: torch.Tensor  # [A, g] block positions a .. a + g - 1
    prev: torch.Tensor  # [A, g] the token before each row's target (the anchor for row 0)
    labels: torch.Tensor  # [A, g] the data's token at a + 1 + k
    target_rows: torch.Tensor  # [A, g] data rows whose target distribution row k matches
    valid: torch.Tensor  # [A, g] bool: a + 1 + k lies inside the sequence


def cut_blocks(
    data: DistillSet,
    sequences: list[int],
    anchors_per_sequence: int,
    g: int,
    window: int,
    gen: torch.Generator,
) -> Blocks:
    """Blocks anchored at up to ``anchors_per_sequence`` random reply positions of each of
    ``sequences`` (positions with at least one token after them)."""
    ctx_rows, ctx_pos, win_idx, vis = [], [], [], []
    anchors, positions, prev, labels, target_rows, valid = [], [], [], [], [], []
    offset = 0
    k = torch.arange(g)
    back = torch.arange(window, 0, -1)  # a - W .. a - 1
    for s in sequences:
        rows = data.sequence(s)
        length = rows.stop - rows.start
        first = int(data.reply_starts[s])
        choices = torch.arange(first, length - 1)
        if choices.numel() == 0:
            continue
        pick = choices[torch.randperm(choices.numel(), generator=gen)[:anchors_per_sequence]]
        ctx_rows.append(torch.arange(rows.start, rows.stop))
        ctx_pos.append(torch.arange(length))
        win = pick.unsqueeze(1) - back  # [a, W]
        vis.append(win >= 0)
        win_idx.append(offset + win.clamp(min=0))
        tokens = data.tokens[rows]
        at = pick.unsqueeze(1) + k  # [a, g] positions a + k
        inside = at + 1 < length
        anchors.append(tokens[pick])
        positions.append(at)
        prev.append(tokens[at.clamp(max=length - 1)])
        labels.append(torch.where(inside, tokens[(at + 1).clamp(max=length - 1)], -1))
        target_rows.append(rows.start + at.clamp(max=length - 1))
        valid.append(inside)
        offset += length
    return Blocks(
        torch.cat(ctx_rows),
        torch.cat(ctx_pos),
        torch.cat(win_idx),
        torch.cat(vis),
        torch.cat(anchors),
        torch.cat(positions),
        torch.cat(prev),
        torch.cat(labels),
        torch.cat(target_rows),
        torch.cat(valid),
    )


@dataclass
class TargetView:
    """What training reads of the target: its frozen embedding [V, d], the rows of its output
    projection for the draft vocabulary ``vocab`` [S] (every token when the head has none),
    and per data row the log-normaliser [N] and argmax [N] of its full distribution (so the
    vocabulary's probabilities are exact without the whole head in every step)."""

    embed: torch.Tensor
    vocab: torch.Tensor
    vocab_out: torch.Tensor
    lse: torch.Tensor
    top: torch.Tensor
    slot: torch.Tensor  # [V] each token's index in ``vocab`` (-1: outside it)


@torch.no_grad()
def target_view(
    data: DistillSet, embed: torch.Tensor, output: torch.Tensor, vocab: torch.Tensor
) -> TargetView:
    """The target's normalisers and argmaxes over every row of ``data`` (chunked)."""
    lse, top = [], []
    for rows in torch.split(data.final, 2048):
        logits = F.linear(rows, output).float()
        lse.append(torch.logsumexp(logits, dim=-1))
        top.append(logits.argmax(dim=-1))
    slot = torch.full((output.shape[0],), -1, dtype=torch.long)
    slot[vocab] = torch.arange(vocab.numel())
    return TargetView(embed, vocab, output[vocab].contiguous(), torch.cat(lse), torch.cat(top), slot)


@dataclass
class BlockOutputs:
    """The head's outputs on a batch of blocks (teacher-forced Markov rows), over the draft
    vocabulary."""

    hidden: torch.Tensor  # [A, g, d]
    draft_logits: torch.Tensor  # [A, g, S] with the Markov bias
    markov_embeds: torch.Tensor  # [A, g, r]
    target_log_probs: torch.Tensor  # [A, g, S] the target's exact log-probabilities (no gradient)


def run_blocks(head: DSparkHead, data: DistillSet, blocks: Blocks, target: TargetView) -> BlockOutputs:
    """The head over ``blocks`` as a serving drafter runs it (``window_kv``, ``block_hidden``)."""
    ring = head.window_kv(data.features[blocks.ctx_rows], blocks.ctx_positions)  # [layers, P, kv]
    windows = [layer_ring[blocks.window_index] for layer_ring in ring]
    anchors = F.embedding(blocks.anchors, target.embed)
    hidden = head.block_hidden(anchors, blocks.positions, windows, blocks.visible)
    markov_embeds = head.markov_embed(blocks.prev)
    bias = F.linear(markov_embeds, head.markov_head.weight[target.vocab]).float()
    draft = F.linear(head.norm(hidden), target.vocab_out).float() + bias
    with torch.no_grad():
        rows = blocks.target_rows
        target_logits = F.linear(data.final[rows], target.vocab_out).float()
        target_log_probs = target_logits - target.lse[rows].unsqueeze(-1)
    return BlockOutputs(hidden, draft, markov_embeds, target_log_probs)


def block_loss(
    head: DSparkHead,
    out: BlockOutputs,
    blocks: Blocks,
    target: TargetView,
    greedy_confidence: bool,
    soft_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted loss and its parts (and the argmax agreement of each row, teacher-forced).
    Tokens outside the draft vocabulary count as mass the draft cannot have (total variation)
    and as rows the cross entropy skips."""
    g = blocks.positions.shape[1]
    weight = torch.exp(-torch.arange(g, dtype=torch.float32) / DECAY) * blocks.valid
    total = weight.sum().clamp(min=1.0)
    log_q = F.log_softmax(out.draft_logits, dim=-1)
    p = out.target_log_probs.exp()
    label = target.slot[blocks.labels.clamp(min=0)]
    known = (label >= 0) & blocks.valid
    ce = (
        F.nll_loss(log_q.flatten(0, 1), label.clamp(min=0).flatten(), reduction="none").view_as(weight)
        * known
    )
    tv = 0.5 * ((log_q.exp() - p).abs().sum(dim=-1) + (1.0 - p.sum(dim=-1)).clamp(min=0.0))
    drafted = target.vocab[out.draft_logits.argmax(-1)]
    agree = (drafted == target.top[blocks.target_rows]).float()
    conf_label = agree if greedy_confidence else (1.0 - tv).detach()
    conf = F.binary_cross_entropy_with_logits(
        head.confidence_logits(out.hidden, out.markov_embeds), conf_label.clamp(0.0, 1.0), reduction="none"
    )
    soft = -(p * log_q).sum(dim=-1)  # cross entropy against the target's distribution
    parts = {"ce": ce, "tv": tv, "soft": soft, "confidence": conf}
    per_row = CE_WEIGHT * ce + TV_WEIGHT * tv + soft_weight * soft + CONFIDENCE_WEIGHT * conf
    loss = (weight * per_row).sum() / total
    stats = {name: float((weight * v.detach()).sum() / total) for name, v in parts.items()}
    valid = blocks.valid.float()
    for k in range(g):
        stats[f"agree_{k}"] = float((agree[:, k] * valid[:, k]).sum() / valid[:, k].sum().clamp(min=1.0))
    return loss, stats
