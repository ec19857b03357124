"""Train a DSpark head on self-distillation data, calibrate its confidence head, and measure
what it would give on held-out sequences, all deterministic from a seed.

The loop samples sequences, cuts blocks at random reply positions (``objective.cut_blocks``)
and minimises DSpark's loss with AdamW (linear warm-up, cosine decay). After training, blocks
at every reply position of the held-out sequences are drafted as a serving engine drafts them
(greedy, the Markov head fed the head's own previous draft) and checked against the target's
greedy tokens: acceptance by position, tokens per verify step, and the confidence head's
calibration before and after sequential temperature scaling (paper §3.2.1: one temperature per
block row, chosen in order to minimise the ECE of the cumulative survival).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from deepinfer.drafter_training.dataset import DistillSet
from deepinfer.drafter_training.objective import TargetView, block_loss, cut_blocks, run_blocks
from deepinfer.models.dspark_head import DSparkHead, DSparkHeadConfig

TEMPERATURE_GRID = tuple(round(0.05 * 1.1**i, 4) for i in range(60))  # 0.05 .. ~14
ECE_BINS = 20


@dataclass
class TrainOptions:
    steps: int = 4000
    lr: float = 1e-3
    warmup: int = 100
    sequences_per_step: int = 4
    anchors_per_sequence: int = 16
    seed: int = 0
    greedy_confidence: bool = True  # the confidence label: greedy agreement, else 1 - TV
    soft_weight: float = 1.0  # weight of the cross entropy against the target's distribution
    log_every: int = 20


@dataclass
class Evaluation:
    """Free-running drafts on held-out blocks against the target's greedy tokens."""

    blocks: int
    acceptance_by_position: list[float]  # P(row k accepted | rows before it were)
    tokens_per_step: float  # accepted drafts + the target's own token, per verify step
    predicted_survival: list[float]  # mean cumulative confidence per row
    observed_survival: list[float]  # share of blocks whose rows 0..k were all accepted
    ece: list[float]  # per row, of the cumulative confidence against survival

    def as_dict(self) -> dict:
        return {
            k: (round(v, 4) if isinstance(v, float) else [round(x, 4) for x in v])
            for k, v in vars(self).items()
            if k != "blocks"
        } | {"blocks": self.blocks}


@dataclass
class TrainResult:
    head: DSparkHead
    log: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def lr_at(step: int, options: TrainOptions) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    done = (step - options.warmup) / max(1, options.steps - options.warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def start_from_target(head: DSparkHead, layers: list[dict[str, torch.Tensor]], embed: torch.Tensor) -> None:
    """Start the draft layers as copies of the target's last decoder layers (``layers``: their
    ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``, ``down``, ``norm1``, ``norm2`` weights, as many
    as the head has layers, where the shapes agree), and ``main_proj`` as the identity on the
    deepest target feature: the head's first step is then the target's own last layers reading
    the target's own context. The noise row starts at the embeddings' scale."""
    cfg = head.config
    d = cfg.hidden_size
    with torch.no_grad():
        head.noise_embed.normal_(0.0, float(embed.std()))
        head.confidence_head.weight.zero_()
        head.main_proj.weight.zero_()
        head.main_proj.weight[:, -d:] = torch.eye(d)
        for draft, source in zip(head.layers, layers, strict=False):
            pairs = {
                draft.q_proj.weight: source["q"],
                draft.kv_proj.weight: torch.cat([source["k"], source["v"]]),
                draft.o_proj.weight: source["o"],
                draft.gate_up.weight: torch.cat([source["gate"], source["up"]]),
                draft.down.weight: source["down"],
                draft.input_norm.weight: source["norm1"],
                draft.post_norm.weight: source["norm2"],
            }
            if all(a.shape == b.shape for a, b in pairs.items()):
                for a, b in pairs.items():
                    a.copy_(b)


def train_head(
    data: DistillSet,
    cfg: DSparkHeadConfig,
    target: TargetView,
    options: TrainOptions,
    source_layers: list[dict[str, torch.Tensor]] | None = None,
) -> TrainResult:
    """A head trained on ``data`` against the frozen ``target``, its draft vocabulary that of
    ``target``; ``source_layers``: the target layers the draft layers start from."""
    torch.manual_seed(options.seed)
    head = DSparkHead(cfg)
    if cfg.draft_vocab_size:
        head.draft_vocab.copy_(target.vocab)
    start_from_target(head, source_layers or [], target.embed)
    gen = torch.Generator().manual_seed(options.seed)
    picker = random.Random(options.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.01)
    result = TrainResult(head)
    start = time.perf_counter()
    bar = tqdm(range(options.steps), desc="train DSpark head", unit="step")
    running: dict[str, float] = {}
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, options)
        sequences = [picker.randrange(data.num_sequences) for _ in range(options.sequences_per_step)]
        blocks = cut_blocks(data, sequences, options.anchors_per_sequence, cfg.block_size, cfg.window, gen)
        out = run_blocks(head, data, blocks, target)
        loss, stats = block_loss(head, out, blocks, target, options.greedy_confidence, options.soft_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        stats["loss"] = float(loss.detach())
        for k, v in stats.items():
            running[k] = running.get(k, 0.0) + v
        if (step + 1) % options.log_every == 0 or step + 1 == options.steps:
            n = (step % options.log_every) + 1
            entry = {"step": step + 1, **{k: v / n for k, v in running.items()}}
            result.log.append(entry)
            running = {}
            bar.set_postfix(loss=f"{entry['loss']:.3f}", agree0=f"{entry['agree_0']:.2f}")
    result.seconds = time.perf_counter() - start
    head.eval().requires_grad_(False)
    return result


def draft_vocabulary(data: DistillSet, size: int) -> torch.Tensor:
    """The ``size`` tokens most frequent in the replies of ``data``, most frequent first (ties:
    the lower id; tokens never seen fill the rest by id)."""
    counts = torch.zeros(int(data.tokens.max()) + 1, dtype=torch.long)
    for s in range(data.num_sequences):
        rows = data.sequence(s)
        counts += torch.bincount(data.tokens[rows][int(data.reply_starts[s]) :], minlength=counts.numel())
    order = sorted(range(counts.numel()), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(order[:size], dtype=torch.long)


def reply_coverage(data: DistillSet, vocab: torch.Tensor) -> float:
    """Share of the reply tokens of ``data`` inside ``vocab``."""
    inside = torch.zeros(int(max(int(data.tokens.max()), int(vocab.max()))) + 1, dtype=torch.bool)
    inside[vocab] = True
    hits = total = 0
    for s in range(data.num_sequences):
        reply = data.tokens[data.sequence(s)][int(data.reply_starts[s]) :]
        hits += int(inside[reply].sum())
        total += reply.numel()
    return hits / total if total else 0.0


@torch.no_grad()
def free_running(
    head: DSparkHead, data: DistillSet, target: TargetView, max_blocks: int = 4000
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks at reply positions of ``data`` drafted greedily as an engine drafts them (from
    the draft vocabulary, the Markov head fed the head's own drafts), checked against the
    target's greedy tokens: (drafts accepted per row [A, g] bool, valid [A, g], raw confidence
    logits [A, g])."""
    g = head.config.block_size
    gen = torch.Generator().manual_seed(0)
    per_seq = max(1, max_blocks // max(1, data.num_sequences))
    markov_out = head.markov_head.weight[target.vocab]
    accepted, valid, logits = [], [], []
    for first in range(0, data.num_sequences, 8):
        seqs = list(range(first, min(first + 8, data.num_sequences)))
        blocks = cut_blocks(data, seqs, per_seq, g, head.config.window, gen)
        ring = head.window_kv(data.features[blocks.ctx_rows], blocks.ctx_positions)
        windows = [r[blocks.window_index] for r in ring]
        anchors = F.embedding(blocks.anchors, target.embed)
        hidden = head.block_hidden(anchors, blocks.positions, windows, blocks.visible)
        base = F.linear(head.norm(hidden), target.vocab_out).float()
        prev, drafts, embeds = blocks.anchors, [], []
        for k in range(g):
            emb = head.markov_embed(prev)
            prev = target.vocab[(base[:, k] + F.linear(emb, markov_out).float()).argmax(-1)]
            drafts.append(prev)
            embeds.append(emb)
        match = torch.stack(drafts, dim=1) == target.top[blocks.target_rows]
        accepted.append(torch.cumprod((match & blocks.valid).int(), dim=1).bool())
        valid.append(blocks.valid)
        logits.append(head.confidence_logits(hidden, torch.stack(embeds, dim=1)))
    return torch.cat(accepted), torch.cat(valid), torch.cat(logits)


def expected_calibration_error(predicted: torch.Tensor, observed: torch.Tensor) -> float:
    """ECE over ``ECE_BINS`` equal-width bins of the predicted probability."""
    if predicted.numel() == 0:
        return 0.0
    bins = (predicted * ECE_BINS).long().clamp(max=ECE_BINS - 1)
    err = 0.0
    for b in range(ECE_BINS):
        mask = bins == b
        if mask.any():
            err += float(mask.float().mean() * (predicted[mask].mean() - observed[mask].float().mean()).abs())
    return err


def survival(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Cumulative survival [A, g]: the product of the calibrated per-row confidences."""
    return torch.cumprod(torch.sigmoid(logits / temperatures), dim=1)


def calibrate(logits: torch.Tensor, survived: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sequential temperature scaling: row by row, the grid temperature that minimises the
    ECE of the cumulative survival, earlier rows fixed."""
    g = logits.shape[1]
    temps = torch.ones(g)
    for k in range(g):
        rows = valid[:, k]
        best, best_t = math.inf, 1.0
        for t in TEMPERATURE_GRID:
            temps[k] = t
            err = expected_calibration_error(survival(logits, temps)[rows, k], survived[rows, k])
            if err < best:
                best, best_t = err, t
        temps[k] = best_t
    return temps


def evaluate(head: DSparkHead, data: DistillSet, target: TargetView, fit_temperatures: bool) -> Evaluation:
    """Acceptance and calibration on ``data``; ``fit_temperatures``: first set the head's
    confidence temperatures by sequential temperature scaling on it."""
    survived, valid, logits = free_running(head, data, target)
    if fit_temperatures:
        head.confidence_temperature.copy_(calibrate(logits, survived, valid))
    g = head.config.block_size
    predicted = survival(logits, head.confidence_temperature[:g])
    by_pos, pred, obs, ece = [], [], [], []
    before = torch.ones(survived.shape[0], dtype=torch.bool)
    for k in range(g):
        rows = valid[:, k]
        cond = rows & before
        by_pos.append(float(survived[cond, k].float().mean()) if cond.any() else 0.0)
        pred.append(float(predicted[rows, k].mean()) if rows.any() else 0.0)
        obs.append(float(survived[rows, k].float().mean()) if rows.any() else 0.0)
        ece.append(expected_calibration_error(predicted[rows, k], survived[rows, k]))
        before = survived[:, k]
    tokens = 1.0 + float(survived.sum(dim=1).float().mean())
    return Evaluation(int(survived.shape[0]), by_pos, tokens, pred, obs, ece)
