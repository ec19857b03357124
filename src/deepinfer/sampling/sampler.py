"""Batched sampling: logits processors, then temperature / top-k / top-p / min-p, then one
inverse-CDF draw per row, all rows in one batch of device ops.

Each row's uniform is a hash of its request's seed (its generator's seed) and the position of
the token it draws, computed on the host with the step's other columns (``draw_uniforms``). A
seeded request therefore draws the same tokens whatever else is in the batch, and whenever
the host learns its previous token: the device can sample step N and feed its tokens to step
N+1 before the host reads them (asynchronous scheduling). SGLang's deterministic sampling
keys its draws by seed and position likewise.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import numpy as np
import torch

from deepinfer.sampling_params import SamplingParams

_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64)
# the token ``sample`` returns for a row whose distribution is not a distribution (NaN, or no
# token left): the engine fails that request alone instead of the whole step
INVALID_ROW = -1


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request at this step. ``greedy`` and ``plain``
    are read from ``params`` once, as the engine reads a request's params once (its generator
    is made at submission): per row and step they were most of a greedy batch's sampling."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    eos_ids: list[int]
    greedy: bool = field(init=False)
    plain: bool = field(init=False)  # no logits processor can apply, whatever the history
    # logit_bias as (token ids, values) tensors, on the device the logits were last on
    bias: tuple[torch.Tensor, torch.Tensor] | None = field(
        init=False, default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.greedy = self.params.greedy
        self.plain = not may_need_history(self.params)
        if self.params.logit_bias:
            self.bias = bias_tensors(self.params.logit_bias)

    def bias_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The bias tensors on ``device``, moved there once."""
        if self.bias is not None and self.bias[0].device != device:
            self.bias = (self.bias[0].to(device), self.bias[1].to(device))
        return self.bias


_PLAIN = operator.attrgetter("plain")
_GREEDY = operator.attrgetter("greedy")


def make_generator(params: SamplingParams, device: torch.device, offset: int = 0) -> torch.Generator:
    """A request's generator: seeded (``seed + offset`` for the n-th sibling) or random."""
    gen = torch.Generator(device=device)
    if params.seed is not None:
        gen.manual_seed(params.seed + offset)
    else:
        gen.seed()
    return gen


def bias_tensors(logit_bias: dict[int, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``logit_bias`` as token ids (long) and values (fp32), made once per request: applied
    with one ``index_add_`` per step, its cost per step does not grow with a Python loop
    over its entries."""
    ids = torch.tensor(list(logit_bias.keys()), dtype=torch.long)
    values = torch.tensor(list(logit_bias.values()), dtype=torch.float32)
    return ids, values


def apply_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias, min_tokens blocking and the three penalties, row by row (fp32 copy, made
    only when some row needs one: the common greedy step keeps the logits as they are).
    The bias is one ``index_add_`` of the row's tensors: its ids are distinct, so each
    logit gets one fp32 addition, as ``out[i, token] += bias`` gave."""
    if all(map(_PLAIN, rows)) or not any(
        needs_history(row.params, row.output_ids) for row in rows if not row.plain
    ):
        return logits.float()
    out = logits.float().clone()
    for i, row in enumerate(rows):
        p = row.params
        bias = row.bias_on(out.device)
        if bias is not None:
            out[i].index_add_(0, bias[0], bias[1])
        if len(row.output_ids) < p.min_tokens:
            blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_ids))
            if blocked:
                out[i, blocked] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = sorted(set(row.prompt_ids) | set(row.output_ids))
            seen = torch.tensor(seen, dtype=torch.long, device=out.device)
            if seen.numel():
                vals = out[i, seen]
                out[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=out.device)
            counts = out.new_zeros(out.shape[1]).index_add_(0, ids, out.new_ones(ids.shape[0]))
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


def may_need_history(p: SamplingParams) -> bool:
    """Whether ``needs_history`` can be true for these params at some point of the request
    (False: no logits processor ever applies to it)."""
    return bool(
        p.logit_bias
        or p.min_tokens > 0
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )


def needs_history(p: SamplingParams, output_ids: list[int]) -> bool:
    """Whether the logits processors change this row's distribution (bias, pending
    ``min_tokens``, penalties that depend on the tokens so far)."""
    return bool(
        p.logit_bias
        or len(output_ids) < p.min_tokens
        or p.repetition_penalty != 1.0
        or ((p.presence_penalty or p.frequency_penalty) and output_ids)
    )


def filter_log_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Log-distribution sampled from, per row: temperature, top-k, top-p, then min-p.

    logits [N, V]; temperature, top_p, min_p float [N]; top_k long [N] (<= 0: off).
    """
    scaled = logits / temperature.unsqueeze(1)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    vocab = scaled.shape[1]
    rank = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    drop = rank >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # top-p: drop a token when the tokens ranked above it already cover top_p
    # (top_p = 1 drops nothing: a cumulative sum that rounds up to 1 must not cut the tail)
    drop |= ((probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    # min-p: drop tokens below min_p times the best token's probability (after top-k/top-p)
    probs = sorted_logits.softmax(-1)
    drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    return filtered.log_softmax(-1)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first maximum of each row; a NaN counts as the maximum).
    On the CPU, fp32/fp64 rows go through NumPy's ``argmax``, which has that rule too: ATen's
    argmax reduces one element at a time, and both it and ``max(dim=-1)`` are slower than
    NumPy's vectorised argmax over a vocabulary-wide row (benchmarks/RESULTS.md). Elsewhere
    ``max(dim=-1)``, which returns the same indices."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_ARGMAX_DTYPES and logits.dim() == 2:
        return torch.from_numpy(np.argmax(logits.detach().numpy(), axis=-1))
    return logits.max(dim=-1).indices


def draw_uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """One uniform in [0, 1) per row, a pure function of the row's seed and the position of
    the token it draws (splitmix64 of both, 53 bits). A request's draws therefore depend on
    neither the batch around it nor when the host learns its previous token, so a step may
    be launched before the last one's tokens reach the host; a recompute after preemption
    draws the same token at the same position."""
    with np.errstate(over="ignore"):
        z = _splitmix64(np.asarray(seeds, dtype=np.uint64)) + np.asarray(positions, dtype=np.uint64)
        z = _splitmix64(z)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _splitmix64(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_seed(row: SamplingRow) -> int:
    """The key of a row's draws: its generator's seed (``seed + offset`` for a seeded
    request, a random one otherwise)."""
    return row.generator.initial_seed() if row.generator is not None else 0


def staged(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on ``device`` in one copy that does not wait for the device's queue
    (pinned memory on CUDA): a pageable copy would wait for the step before."""
    host = torch.from_numpy(values)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws: per row the first token whose cumulative probability exceeds
    ``uniform * total`` (fp64 sums); a token of probability 0 is never returned (the rare
    rounding that lands on one falls back to the row's most likely token)."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).clamp_max(probs.shape[1] - 1)
    hit = probs.gather(1, tokens) > 0
    return torch.where(hit, tokens, probs.argmax(-1, keepdim=True)).view(-1)


def sample_tokens(
    logits: torch.Tensor, rows: list[SamplingRow], positions: list[int], rowwise: bool = False
) -> torch.Tensor:
    """One token per row of ``logits`` [N, V], as a long tensor on the logits' device, with
    no host read of a device value: a step's tokens can feed the next step's input before
    the host sees them. ``positions``: the position of the token each row draws (the key
    of its random number with the row's seed). ``rowwise`` (batch-invariant mode): each
    row's filters and draw on that row alone, so no kernel sees how many rows there are.

    A row whose distribution is invalid gets ``INVALID_ROW``, and only it: a greedy row whose
    best logit is NaN, a sampled row whose probabilities are not finite (NaN logits, or
    every token filtered out)."""
    if rowwise and len(rows) > 1:
        parts = [sample_tokens(logits[i : i + 1], [row], positions[i : i + 1]) for i, row in enumerate(rows)]
        return torch.cat(parts)
    processed = apply_processors(logits, rows)
    best = greedy_tokens(processed).to(processed.device)
    # argmax takes a NaN as the maximum, so a row holding one shows it at its argmax
    nan_rows = torch.isnan(processed.gather(1, best.view(-1, 1))).view(-1)
    tokens = torch.where(nan_rows, INVALID_ROW, best)
    if all(map(_GREEDY, rows)):
        return tokens
    random_rows = [i for i, r in enumerate(rows) if not r.greedy]
    params = [rows[i].params for i in random_rows]
    table = np.empty((6, len(random_rows)), dtype=np.float64)  # one copy for the step's columns
    table[0] = random_rows
    table[1] = [p.temperature for p in params]
    table[2] = [p.top_k for p in params]
    table[3] = [p.top_p for p in params]
    table[4] = [p.min_p for p in params]
    table[5] = draw_uniforms([row_seed(rows[i]) for i in random_rows], [positions[i] for i in random_rows])
    cols = staged(table, processed.device)
    idx, temperature = cols[0].long(), cols[1].float()
    if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0 for p in params):
        # no filter: the same log-distribution without sorting the vocabulary
        logp = (processed[idx] / temperature.unsqueeze(1)).log_softmax(-1)
    else:
        logp = filter_log_probs(processed[idx], temperature, cols[2].long(), cols[3].float(), cols[4].float())
    probs = logp.exp()
    valid = torch.isfinite(probs).all(-1)
    drawn = torch.where(valid, draw_from(probs.nan_to_num(0.0), cols[5]), INVALID_ROW)
    return tokens.index_copy(0, idx, drawn)


def sample(
    logits: torch.Tensor, rows: list[SamplingRow], rowwise: bool = False, positions: list[int] | None = None
) -> list[int]:
    """``sample_tokens`` read back to the host. ``positions`` default to each row's next
    position (its prompt and output lengths): the token a lone request draws next."""
    if positions is None:
        positions = [len(r.prompt_ids) + len(r.output_ids) for r in rows]
    return sample_tokens(logits, rows, positions, rowwise).tolist()


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, position: int = 0
) -> int:
    """Convenience for one row of logits [V] with no history (tests, research code); the draw
    is keyed by the generator's seed and ``position``."""
    return sample(logits.unsqueeze(0), [SamplingRow(params, generator, [], [], [])], positions=[position])[0]


def filtered_log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The single-row target distribution of :func:`sample` for ``params`` (no history)."""
    one = torch.tensor([1.0])
    return filter_log_probs(
        logits.float().unsqueeze(0),
        one * params.temperature,
        torch.tensor([params.top_k]),
        one * params.top_p,
        one * params.min_p,
    )[0]
