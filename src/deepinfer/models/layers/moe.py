"""Mixture of experts with a shared expert (V4 variant with hash routing).

Routing scores are ``sqrt(softplus(logits))`` (or softmax/sigmoid); a learned bias shifts the
*selection* only; the selected scores are normalised and scaled by ``routed_scaling_factor``.
Hash layers select experts with a frozen ``tid2eid[token]`` table instead. The routed experts
run as one custom op (``deepinfer::routed_experts``, kernels/moe.py). After its projection the
router runs as ``deepinfer::moe_gate`` on eager non-CPU steps (one launch on CUDA instead of
some ten; ``kernels/moe_gate_triton.py``, whose plain form every other step runs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.forward_batch import RoutingTrace
from deepinfer.kernels import batch_invariant
from deepinfer.kernels import moe_gate_triton as gate_forms
from deepinfer.kernels.moe import routed_experts, routed_experts_reference
from deepinfer.kernels.quantized import routed_experts_fp4
from deepinfer.models.deepseek_v4_config import DeepseekV4Config
from deepinfer.models.layers.fused_ops import runs_fused
from deepinfer.models.layers.lora import ExpertStack, current_step

# The router's weight (``Gate.weight``), a projection the step multiplies with through
# ``F.linear``, packed for compiled CPU steps.
ROUTER_WEIGHT = "gate.weight"


def replica_slots(ids: torch.Tensor, log2phy: torch.Tensor, replicas: torch.Tensor) -> torch.Tensor:
    """The physical slot serving each (token, choice) of logical ``ids`` [N, k]: a logical
    expert's pairs go round-robin over its replicas in token order, so each replica gets an
    even share (EPLB; ``log2phy`` [E, R] slots, -1 padded; ``replicas`` [E] counts)."""
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    sorted_ids = flat[order]
    first = torch.searchsorted(sorted_ids, sorted_ids)  # each pair's expert's first sorted pair
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - first
    return log2phy[flat, rank % replicas[flat]].view(ids.shape)


class Expert(nn.Module):
    """SwiGLU with the V4 clamp: gate <= limit, |up| <= limit."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.top_k, self.hashed = cfg.num_experts_per_tok, hashed
        self.scoring, self.normalize = cfg.scoring_func, cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, routing: RoutingTrace | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (weights [N, k], expert ids [N, k]); ``routing`` records the choice or
        replays a given one (the weights are then the scores of the replayed experts)."""
        logits = F.linear(x, self.weight.to(x.dtype))
        table = self.tid2eid if self.hashed else None
        bias = None if self.hashed else self.bias
        if routing is None and runs_fused(logits, bias):
            args = (self.top_k, self.scoring, self.normalize, float(self.scale))
            return gate_forms.moe_gate(logits, bias, table, input_ids, *args)
        scores = gate_forms.scores(logits, self.scoring)
        if table is not None:
            ids = table[input_ids.reshape(-1)].long()
        else:
            ids = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False).indices
        if routing is not None:
            ids = routing.route(ids)
        return gate_forms.weigh(scores, ids, self.normalize, self.scale), ids


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(cfg, hashed=cfg.hash_layers[layer])
        self.experts = nn.ModuleList(Expert(h, inter, cfg.swiglu_limit) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(h, inter * cfg.n_shared_experts, cfg.swiglu_limit)
        self.limit = cfg.swiglu_limit
        # The experts' weights stacked per expert ([E, I, d], [E, d, I], [E, I, d]), made once
        # after loading; each expert's own weight is then a view into them (no second copy).
        self.register_buffer("w1_stacked", None, persistent=False)
        self.register_buffer("w2_stacked", None, persistent=False)
        self.register_buffer("w3_stacked", None, persistent=False)
        # Routed experts kept as stored (fp4 e2m1 bytes [E, N, K/2] and ue8m0 scales
        # [E, N, K/32] per matrix), filled by ``keep_fp4``; they replace the float copies.
        for name in ("w1", "w2", "w3"):
            self.register_buffer(f"{name}_fp4", None, persistent=False)
            self.register_buffer(f"{name}_fp4_scale", None, persistent=False)
        # Tokens routed to each expert since the last read ([E] int64, on the device; None:
        # not counted). EPLB's load window sets and drains it (distributed/eplb.py).
        self.register_buffer("expert_load", None, persistent=False)
        # Expert parallel (distributed/expert_parallel.py): this rank holds the experts
        # expert_offset .. expert_offset + its stacked count, and ``reduce`` sums the ranks'
        # routed outputs (None on one device)
        self.expert_offset = 0
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Data-parallel attention: each rank holds different tokens, and ``dispatch(moe, x,
        # weights, ids)`` sends them to the ranks holding their experts and back (all-to-all,
        # distributed/expert_parallel.py), returning the routed output of this rank's tokens
        self.dispatch: Callable[..., torch.Tensor] | None = None
        # with EPLB: (logical -> its physical slots [E, R] (-1 padded), replica counts [E]);
        # expert_offset is then this rank's first physical slot (None: slot = expert id)
        self.replica_maps: tuple[torch.Tensor, torch.Tensor] | None = None
        # served adapters' slots on the routed experts (``layers/lora.ExpertStack``)
        self.lora_experts: ExpertStack | None = None

    @torch.no_grad()
    def stack_experts(self) -> None:
        """Stack the experts' current weights (models built in memory, not loaded)."""
        for name in ("w1", "w2", "w3"):
            self._adopt(name, torch.stack([getattr(e, name).weight for e in self.experts]))

    def allocate_stacked_experts(self, dtype: torch.dtype, device: torch.device) -> None:
        """Before loading: empty stacked tensors whose slices the loader fills in place."""
        for name in ("w1", "w2", "w3"):
            shape = (len(self.experts), *getattr(self.experts[0], name).weight.shape)
            self._adopt(name, torch.empty(shape, dtype=dtype, device=device))

    @torch.no_grad()
    def keep_fp4(self, expert: int, which: str, packed: torch.Tensor, scale: torch.Tensor) -> None:
        """Store expert ``expert``'s ``which`` ("w1"/"w2"/"w3") matrix as the checkpoint has
        it: packed fp4 bytes and per-32 scales. The first one drops the float stacked
        tensors and the experts' float parameters (never filled: no memory was touched)."""
        linear = getattr(self.experts[expert], which)
        out_f, in_f = (linear.out_features, linear.in_features)
        if tuple(packed.shape) != (out_f, in_f // 2) or tuple(scale.shape) != (out_f, in_f // 32):
            raise ValueError(
                f"fp4 expert matrix {tuple(packed.shape)} with scales {tuple(scale.shape)}, expected "
                f"{(out_f, in_f // 2)} and {(out_f, in_f // 32)}"
            )
        if not self.holds_fp4:
            for name in ("w1", "w2", "w3"):
                setattr(self, f"{name}_stacked", None)
                for e in self.experts:
                    getattr(e, name).weight = None
        if getattr(self, f"{which}_fp4") is None:
            n = len(self.experts)
            setattr(self, f"{which}_fp4", packed.new_empty(n, *packed.shape).view(torch.uint8))
            setattr(self, f"{which}_fp4_scale", scale.new_empty(n, *scale.shape))
        getattr(self, f"{which}_fp4")[expert].copy_(packed.view(torch.uint8))
        getattr(self, f"{which}_fp4_scale")[expert].copy_(scale)

    @property
    def holds_fp4(self) -> bool:
        """Whether the routed experts are resident as fp4 (``keep_fp4``)."""
        return self.w1_fp4 is not None or self.w2_fp4 is not None or self.w3_fp4 is not None

    @property
    def held_experts(self) -> int:
        """Expert slots this rank holds (all experts on one device)."""
        if self.holds_fp4:
            return self.w1_fp4.shape[0]
        return len(self.experts) if self.w1_stacked is None else self.w1_stacked.shape[0]

    def _expert_parallel(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on their (token, choice) pairs (the others' pairs weighted 0),
        summed over the ranks, plus the shared expert (computed on every rank, added once)."""
        held = self.held_experts
        if self.replica_maps is not None:
            ids = replica_slots(ids, *self.replica_maps)
        local = (ids >= self.expert_offset) & (ids < self.expert_offset + held)
        ids = (ids - self.expert_offset).clamp(0, held - 1)
        assert self.reduce is not None
        return self.reduce(self.run_routed(flat, weights * local, ids)) + self.shared_experts(flat)

    def run_routed(self, flat: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' op over the stacked copies: fp4 as stored, or float."""
        if self.holds_fp4:
            fp4 = (
                self.w1_fp4,
                self.w1_fp4_scale,
                self.w2_fp4,
                self.w2_fp4_scale,
                self.w3_fp4,
                self.w3_fp4_scale,
            )
            return routed_experts_fp4(flat, weights, ids, *fp4, self.limit)
        if self.w1_stacked is None:
            self.stack_experts()
        step = current_step() if self.lora_experts is not None and self.lora_experts.any else None
        if step is not None:  # the reference form, with each pair's low-rank term in its SwiGLU
            mask, stack = step.rows_mask(flat), self.lora_experts

            def term(expert: int, name: str, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
                return stack.term(expert, name, rows, mask[tokens])

            stacked = (self.w1_stacked, self.w2_stacked, self.w3_stacked)
            return routed_experts_reference(flat, weights, ids, *stacked, self.limit, adapter=term)
        if batch_invariant.active():  # the plain form, whose products the mode makes invariant
            return routed_experts_reference(
                flat, weights, ids, self.w1_stacked, self.w2_stacked, self.w3_stacked, self.limit
            )
        return routed_experts(
            flat, weights, ids, self.w1_stacked, self.w2_stacked, self.w3_stacked, self.limit
        )

    def _adopt(self, name: str, stacked: torch.Tensor) -> None:
        setattr(self, f"{name}_stacked", stacked)
        for i, expert in enumerate(self.experts):
            getattr(expert, name).weight = nn.Parameter(stacked[i], requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        functional: bool = False,
        routing: RoutingTrace | None = None,
    ) -> torch.Tensor:
        """``functional`` (the research binding): the experts run from their own parameters
        through the op's differentiable reference, so gradients and ``functional_call``
        reach them; the engine runs the op on the stacked copies. ``routing``: the step's
        record or replay of expert choices (``ForwardBatch.routing``)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat, input_ids, routing)
        if self.expert_load is not None and not torch.compiler.is_compiling():
            self.expert_load.index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        if self.dispatch is not None:
            return (self.dispatch(self, flat, weights, ids) + self.shared_experts(flat)).view(shape)
        if self.reduce is not None:
            return self._expert_parallel(flat, weights, ids).view(shape)
        if functional and not self.holds_fp4:  # fp4 experts have no float parameters
            w1, w2, w3 = ([getattr(e, name) for e in self.experts] for name in ("w1", "w2", "w3"))
            routed = routed_experts_reference(flat, weights, ids, w1, w2, w3, self.limit)
            return (routed + self.shared_experts(flat)).view(shape)
        return (self.run_routed(flat, weights, ids) + self.shared_experts(flat)).view(shape)
