"""What every model class gives the engine, the loader and research code."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch, Grid, RoutingTrace
from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.cache.session import research_batch
from deepinfer.kernels.batch_invariant import invariant_products
from deepinfer.models.layers.moe import MoE
from deepinfer.models.layers.quantized_linear import Fp8BlockLinear, quantize_linears_fp8, replace_linear


@dataclass
class CausalLMOutput:
    """What ``model(input_ids, ...)`` returns, shaped as transformers' causal-LM outputs."""

    logits: torch.Tensor  # [B, S, V] fp32 (zero at padded cells)
    loss: torch.Tensor | None = None  # mean next-token cross entropy, when labels are given
    # with output_hidden_states: the embedding streams, then every layer's output, each on
    # the [B, S, ...] grid ([B, S, n, d] hyper-connection streams for V4/V4.1)
    hidden_states: tuple[torch.Tensor, ...] | None = None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of position t's logits against label t + 1 (labels of -100 are
    ignored), as transformers computes the ``labels=`` loss."""
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"labels must be shaped like input_ids {tuple(logits.shape[:2])}, got {tuple(labels.shape)}"
        )
    shifted = labels[:, 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), shifted, ignore_index=-100)


def _expert_slot(model: nn.Module, name: str) -> tuple[MoE, int, str] | None:
    """(MoE layer, expert index, "w1"/"w2"/"w3") for a routed expert's weight name."""
    parts = name.split(".")
    if len(parts) < 5 or parts[-4] != "experts" or not parts[-3].isdigit():
        return None
    owner = model.get_submodule(".".join(parts[:-4]))
    return (owner, int(parts[-3]), parts[-2]) if isinstance(owner, MoE) else None


class CausalLM(nn.Module):
    """Two ways in, shared by every architecture, through the same layers.

    ``model(input_ids [B, S], attention_mask=None, labels=None, output_hidden_states=False)``:
    research code's way (docs/architecture.md, 'The cache'): every row is a sequence from
    position 0 (its real tokens only, under left or right padding), one step over throwaway
    pools written out of place, so the call is differentiable and works under hooks,
    ``torch.func`` and ``torch.compile``; returns a ``CausalLMOutput``.

    ``model.step(input_ids [T], positions [T], batch)``: the engine's way, one step over a
    flat batch of tokens from many sequences against the persistent paged cache.

    The class also declares, with defaults, every hook the checkpoint loader calls
    (``deepinfer.weights.loader.LoadableModel``) and the draft layers speculative decoding
    may run (``draft_model``), so neither probes the model with ``hasattr``.
    """

    # Whether a compiled step measured faster than the eager one on the CPU (RESULTS.md): with
    # ``compile=None`` the CPU engine then runs a compiled step saved by an earlier process.
    # Llama's eager CPU decode is one C++ call per step, which compiling only slows.
    cpu_compile_pays: ClassVar[bool] = False

    # -- loader hooks ----------------------------------------------------------------------
    # Parameter names containing one of these stay fp32 whatever the compute dtype.
    fp32_param_markers: ClassVar[tuple[str, ...]] = ()
    # Checkpoint tensors this model may leave unused without a word (e.g. draft layers the
    # config does not ask for).
    ignored_checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    # Checkpoint tensors skipped with one warning (a vision tower of a text-only port).
    skipped_checkpoint_prefixes: ClassVar[tuple[str, ...]] = ()
    skipped_checkpoint_suffixes: ClassVar[tuple[str, ...]] = ()
    # Layers the model builds but can serve without when a checkpoint lacks all of them.
    optional_checkpoint_prefix: ClassVar[str | None] = None

    def keeps_fp32(self, name: str) -> bool:
        """Whether the loaded tensor ``name`` stays fp32."""
        return any(m in name for m in self.fp32_param_markers)

    # Set by ``load_model`` before loading: linears stored as fp8 blocks and routed experts
    # stored as fp4 stay so in memory (``keeps_stored``) instead of being dequantised
    keep_quantized: bool = False
    # the linears ``quantization="fp8"`` quantizes on load (the released format's choice);
    # none for models without an fp8 release format
    fp8_linear_markers: ClassVar[tuple[str, ...]] = ()

    def keeps_stored(self, name: str) -> bool:
        """Whether a quantized tensor ``name`` (fp8 / packed fp4, with a ``.scale``) is
        handed over as stored through ``keep_stored`` instead of being dequantised on load:
        with ``keep_quantized``, a linear's weight or a routed expert's."""
        if not self.keep_quantized or not name.endswith(".weight"):
            return False
        return _expert_slot(self, name) is not None or isinstance(self.get_submodule(name[:-7]), nn.Linear)

    def keep_stored(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
    ) -> None:
        """Adopt the stored ``weight`` and its ``scale`` (see ``keeps_stored``): a routed
        expert's fp4 matrix into its MoE layer's stacked fp4 tensors, an fp8 linear's as an
        ``Fp8BlockLinear`` with scale blocks ``block``."""
        slot = _expert_slot(self, name)
        if slot is not None:
            moe, expert, which = slot
            moe.keep_fp4(expert, which, weight, scale)
        elif weight.dtype == torch.float8_e4m3fn and block is not None:
            replace_linear(self, name[:-7], Fp8BlockLinear(weight, scale, block))
        else:
            raise ValueError(
                f"{weight.dtype} weight with {scale.dtype} scales is not a format deepinfer keeps"
            )

    def quantize_fp8(self, block: tuple[int, int]) -> None:
        """``quantization="fp8"``: the float linears the release format stores in fp8
        (``fp8_linear_markers``) become resident fp8 blocks."""
        if not self.fp8_linear_markers:
            raise ValueError(
                f"quantization='fp8' is not supported for {type(self).__name__} (use 'int8' or 'int4')"
            )
        names = [
            n
            for n, m in self.named_modules()
            if isinstance(m, nn.Linear) and any(marker in n + "." for marker in self.fp8_linear_markers)
        ]
        quantize_linears_fp8(self, names, block)

    def drop_optional_layers(self) -> None:
        """The checkpoint has none of ``optional_checkpoint_prefix``: serve without them."""
        raise NotImplementedError(f"{type(self).__name__} has no optional layers")

    def allocate_stacked_experts(self, dtype: torch.dtype, device: torch.device) -> None:
        """Before loading: give every MoE layer its stacked expert tensors, so experts load
        straight into them (no second copy)."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.allocate_stacked_experts(dtype, device)

    def post_load(self, path: Path) -> None:
        """After loading the weights of the checkpoint at ``path`` (fusions, tokenizer-bound
        tables)."""

    # Under ``batch_invariant``, whether every op of a step computes each token's row alone
    # (row-wise ops, ``invariant_products``' matrix products, the prefix attention): the
    # step then runs its chunks together. False: each chunk runs as a forward of its own.
    invariant_rows: ClassVar[bool] = False

    # For a model whose compiled CPU steps run projections on packed copies: the parameters
    # besides ``nn.Linear`` weights that its step multiplies with through ``F.linear`` (name
    # suffixes, possibly none). None: the model packs nothing.
    projection_params: tuple[str, ...] | None = None

    def register_packed_projections(self) -> int:
        """Packed copies of the fp32 weights a compiled CPU step multiplies with
        (``deepinfer::packed_linear``, ``kernels/cpu/linear_op.py``): ``nn.Linear`` weights but
        routed experts' (their own kernels), and the ``projection_params`` the model names.
        Tables read by index (embeddings, Engram) are never packed. A weight left out only runs
        on ``aten::mm``. The engine calls this when compiled steps may run. Returns how many
        were registered (0 where the op did not build or the model does not pack)."""
        from deepinfer.kernels.cpu import linear_op as cpu_linear_op

        if self.projection_params is None or not cpu_linear_op.available():
            return 0
        linear = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)}
        count = 0
        for name, param in self.named_parameters():
            if param.dim() != 2 or param.dtype != torch.float32 or param.device.type != "cpu":
                continue
            if ".experts." in f".{name}" or param.is_inference():
                continue
            if id(param) in linear or name.endswith(self.projection_params):
                cpu_linear_op.register(param)
                count += 1
        return count

    # -- speculative decoding --------------------------------------------------------------

    def draft_model(self, method: str) -> Any | None:
        """The draft layers of this checkpoint for speculative ``method`` ("mtp", "dspark"),
        wrapped with what they share of the target (embedding, head); None when it has none."""
        return None

    def draft_head(self, head: Any) -> Any:
        """A separately trained DSpark head (``models.dspark_head.DSparkHead``, from
        ``speculative_config.model``) joined with what it shares of this target; ValueError
        for a family that drafts with its own layers."""
        raise ValueError(
            f"speculative_config.model: a separately trained DSpark head drafts for Llama-family "
            f"targets; {type(self).__name__} drafts with the layers of its own checkpoint (leave model unset)"
        )

    # -- engine interface ------------------------------------------------------------------

    # V4.1's causal encoder/decoder prefill: the first decoder layer (None: no such split,
    # ``ced_prefill`` is refused).
    ced_split: int | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def step_tables(self, device: torch.device) -> list[torch.Tensor]:
        """Per-device tensors the step reads that are neither parameters nor buffers (RoPE
        tables); ``torch.compile`` marks them static so a new device copy recompiles nothing."""
        return []

    def cache_spec(self) -> list[LayerCacheSpec]:
        raise NotImplementedError

    def step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One engine step: fp32 logits [N, V] for ``batch.logits_idx`` (every row when None);
        with ``batch.feature_idx`` set, ``(logits, features [F, ...])``, the hidden states a
        model drafter reads for those rows."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        batch_invariant: bool = False,
        routed_experts: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> CausalLMOutput:
        """``batch_invariant``: compute as a ``batch_invariant=True`` engine step does
        (matrix products on the row-invariant packed kernel, ``kernels/batch_invariant.py``;
        plain torch elsewhere), so on float weights the logits, and their ``log_softmax``,
        equal the engine's bit for bit (an RL trainer's logprobs are then the rollout's).
        ``routed_experts``: the MoE layers route each token to these experts (R3, routing
        replay): [B, S', layers, k], or one [S'_b, layers, k] per row (an output's
        ``routed_experts``), S' <= S; positions past them, and entries < 0, route as the
        model does."""
        flat_ids, positions, batch = research_batch(self, input_ids, attention_mask)
        batch.invariant = batch_invariant
        if routed_experts is not None:
            batch.routing = RoutingTrace(replay=replay_rows(routed_experts, input_ids.shape, batch.grid))
        vocab = self.config.vocab_size
        if flat_ids.numel() and (int(flat_ids.min()) < 0 or int(flat_ids.max()) >= vocab):
            raise ValueError(f"input_ids: token ids must lie in [0, {vocab})")
        if output_hidden_states:
            batch.hidden_states = []
        with invariant_products(batch_invariant):
            out = self.step(flat_ids, positions, batch)
        if batch.routing is not None and batch.routing.replay is not None:
            if len(batch.routing.recorded) != batch.routing.replay.shape[1]:
                raise ValueError(
                    f"routed_experts: holds {batch.routing.replay.shape[1]} MoE layers, "
                    f"the model has {len(batch.routing.recorded)}"
                )
        logits = batch.to_grid(out[0] if isinstance(out, tuple) else out)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        hidden = tuple(batch.hidden_states) if batch.hidden_states is not None else None
        return CausalLMOutput(logits, loss, hidden)


def replay_rows(
    routed: torch.Tensor | Sequence[torch.Tensor], shape: tuple[int, ...], grid: Grid | None
) -> torch.Tensor:
    """The research forward's ``routed_experts`` as [T, layers, k] rows in step order (the
    grid's real cells), -1 where a row routes itself."""
    b, s = shape
    rows = list(routed) if not isinstance(routed, torch.Tensor) else list(routed.unbind(0))
    if len(rows) != b or any(not isinstance(r, torch.Tensor) or r.dim() != 3 for r in rows):
        raise ValueError(
            f"routed_experts: {b} tensors of [positions, MoE layers, top-k] (or one [B, S, L, k])"
        )
    if len({tuple(r.shape[1:]) for r in rows}) != 1 or any(r.shape[0] > s for r in rows):
        raise ValueError(
            f"routed_experts: rows must share [MoE layers, top-k] and hold at most {s} positions"
        )
    layers, k = rows[0].shape[1:]
    out = torch.full((b, s, layers, k), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r.long()
    flat = out.view(b * s, layers, k)
    return flat if grid is None or grid.rows is None else flat[grid.rows.cpu()]
