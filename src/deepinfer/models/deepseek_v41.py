"""DeepSeek-V4.1-Flash in plain PyTorch, on the V4 layers.

What differs from V4 (``deepseek_v4.py``), each in one place:
- KV sharing ("CSA2"): only KV-source layers own a compressor (ratio 2 pooled, ratio 1 a plain
  projection; no ``ape``, no overlap); later layers of the same ratio read its entries and
  index keys, which ``cache_spec`` declares as shared so the cache holds one copy.
- top-k sharing and the two-level top-k: only index-source layers score; the others reuse the
  latest source's choice; index sources after the candidate source score inside its blocks.
- the one-site mHC lag: a sublayer's input is collapsed with the *previous* site's ``pre`` mix,
  and the model ends with the last FFN site's ``pre`` (no ``hc_head``).
- Engram before layers ``engram_layer_ids``; no hash-routed MoE; no per-head query norm.

The model is a pure function of ``(input_ids, positions, ForwardBatch)``; what one layer
publishes to later ones (top-k, candidates) lives only for the step, in ``StepShared``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.cache.layer_spec import LayerCacheSpec
from deepinfer.errors import CheckpointError
from deepinfer.models.base import CausalLM
from deepinfer.models.deepseek_v41_blocks import LaggedBlock, StepShared, first_site_pre_mix
from deepinfer.models.deepseek_v41_config import DeepseekV41Config, LayerRole
from deepinfer.models.dspark_stages import DSparkDraftModel, build_dspark_stages
from deepinfer.models.layers.engram import (
    DEAD,
    EngramLayout,
    EngramTable,
    build_compressed_token_map,
    engram_hash_ids,
)
from deepinfer.models.layers.mhc import MIXING_FUNCTIONS, hc_collapse
from deepinfer.models.layers.moe import ROUTER_WEIGHT
from deepinfer.models.layers.norms import RMSNorm
from deepinfer.models.layers.rope import Rotary
from deepinfer.weights.writer import FP8_LINEARS

logger = logging.getLogger(__name__)


class DeepseekV41ForCausalLM(CausalLM):
    """The V4.1-Flash backbone + head (+ the DSpark stages ``mtp.*``, loaded for the drafter)."""

    cpu_compile_pays = True  # compiled beats eager at bs 1 on the tiny V4.1 (benchmarks/RESULTS.md)

    # Kept in fp32 whatever the compute dtype (DeepSeek's reference code keeps the pooling
    # compressor, the head and the DSpark confidence head in fp32 too).
    fp32_param_markers = (
        "norm.weight",
        "hc_",
        "attn_sink",
        "gate.bias",
        "compressor.wgate",
        "head.weight",
        "confidence_head",
    )
    # the linears the release format stores as fp8 blocks (``quantization="fp8"``)
    fp8_linear_markers = FP8_LINEARS
    # Vision tower and the image routing bias: deepinfer serves text (skipped with one warning).
    skipped_checkpoint_prefixes = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
    skipped_checkpoint_suffixes = (".bias_vl",)
    # The DSpark stages: unused when the config asks for none, optional when it does.
    ignored_checkpoint_prefixes = ("mtp.",)
    optional_checkpoint_prefix = "mtp."

    # compiled CPU steps run its projections on packed copies: these beside nn.Linear weights
    projection_params = (*MIXING_FUNCTIONS, ROUTER_WEIGHT)

    def __init__(self, cfg: DeepseekV41Config) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.plan = cfg.plan()
        rd = cfg.qk_rope_head_dim
        main_rope = Rotary(rd, cfg.rope_theta, None)
        compress_rope = Rotary(rd, cfg.compress_rope_theta, cfg.yarn)
        self.engram_layout: EngramLayout | None = None
        rows: dict[int, int] = {}
        if cfg.engram_layer_ids:
            self.engram_layout = EngramLayout.build(
                cfg.engram_layer_ids,
                cfg.engram_max_ngram_size,
                cfg.engram_n_heads,
                cfg.engram_vocab_size,
                cfg.engram_compressed_vocab_size,
            )
            derived = self.engram_layout.table_rows()
            if derived != list(cfg.engram_num_embeddings):
                raise CheckpointError(
                    f"config.json: engram_num_embeddings {cfg.engram_num_embeddings} differs from the sums of "
                    f"the hash primes {derived} (engram_vocab_size / engram_n_heads / engram_max_ngram_size)"
                )
            rows = dict(zip(cfg.engram_layer_ids, derived, strict=True))
        h = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(
            LaggedBlock(cfg, role, main_rope, compress_rope, rows.get(i, 0))
            for i, role in enumerate(self.plan)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.mtp = build_dspark_stages(cfg, main_rope)
        # Engram's token normalisation map (vocab -> compressed id); see ``bind_tokenizer``.
        # An identity map (compressed vocabulary == vocabulary) needs no tokenizer; it is made
        # after loading, on the weights' device (the model is built on the meta device).
        self.token_map: torch.Tensor | None = None
        self._identity_map = cfg.engram_compressed_vocab_size == cfg.vocab_size
        self._engram_pad = cfg.engram_pad_token_id  # the pad's compressed id (identity map)
        self._engram_slot = {layer: k for k, layer in enumerate(cfg.engram_layer_ids)}
        self._history_layer = min(cfg.engram_layer_ids) if cfg.engram_layer_ids else None
        self.ced_split = ced_split_layer(self.plan)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def keeps_fp32(self, name: str) -> bool:
        """Whether a loaded tensor stays fp32: the markers, plus the pooling (ratio > 1)
        compressor's ``wkv``; the ratio-1 compressor is a plain projection in compute dtype."""
        if super().keeps_fp32(name):
            return True
        if name.endswith("attn.compressor.wkv.weight") and name.startswith("layers."):
            return self.plan[int(name.split(".")[1])].ratio > 1
        return False

    def keeps_stored(self, name: str) -> bool:
        """Engram tables stay fp8 with their per-32 scales (dequantised per looked-up row),
        whatever ``keep_quantized`` says; other tensors as ``CausalLM`` decides."""
        owner, _, leaf = name.rpartition(".")
        if leaf == "weight" and isinstance(self.get_submodule(owner), EngramTable):
            return True
        return super().keeps_stored(name)

    def keep_stored(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
    ) -> None:
        table = self.get_submodule(name.rpartition(".")[0])
        if isinstance(table, EngramTable):
            table.keep_stored(weight, scale)
        else:
            super().keep_stored(name, weight, scale, block)

    def drop_optional_layers(self) -> None:
        self.mtp = nn.ModuleList()

    def draft_model(self, method: str) -> DSparkDraftModel | None:
        """The DSpark stages (``method="dspark"``), when the checkpoint has them."""
        if method != "dspark" or not len(self.mtp):
            return None
        return DSparkDraftModel(self.mtp, self.embed, self.head, self.config)

    # -- Engram token map ------------------------------------------------------------------

    def bind_tokenizer(self, tokenizer) -> None:
        """Build Engram's compressed token map from a ``tokenizers.Tokenizer`` or a
        transformers tokenizer; its size must equal ``engram_compressed_vocab_size``."""
        cfg = self.config
        lookup = build_compressed_token_map(tokenizer)
        size = max(lookup) + 1 if lookup else 0
        if size != cfg.engram_compressed_vocab_size:
            raise CheckpointError(
                f"the tokenizer's Engram map has {size} compressed ids, but config.json says "
                f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}"
            )
        if len(lookup) > cfg.vocab_size:
            raise CheckpointError(
                f"the tokenizer has {len(lookup)} ids, more than vocab_size={cfg.vocab_size}"
            )
        # Ids past the tokenizer (padding rows of the embedding) hash like the pad token.
        pad = lookup[cfg.engram_pad_token_id]
        self.token_map = torch.tensor(lookup + [pad] * (cfg.vocab_size - len(lookup)), dtype=torch.long)
        self._engram_pad = pad

    def post_load(self, path: Path) -> None:
        """After loading: bind the checkpoint's tokenizer for Engram (when the model has it)."""
        if not self.config.engram_layer_ids:
            return
        file = Path(path) / "tokenizer.json"
        if file.is_file():
            from tokenizers import Tokenizer

            self.bind_tokenizer(Tokenizer.from_file(str(file)))
        elif not self._identity_map:
            raise CheckpointError(
                f"{path}: Engram needs the tokenizer (tokenizer.json) to build its token map; "
                "none was found and the compressed vocabulary is not the identity"
            )
        else:
            logger.warning("%s: no tokenizer.json; Engram uses the identity token map", path)
            self.token_map = torch.arange(self.config.vocab_size, device=self.head.weight.device)

    # -- engine interface ------------------------------------------------------------------

    def cache_spec(self) -> list[LayerCacheSpec]:
        cfg = self.config
        specs = []
        for i, role in enumerate(self.plan):
            owns = role.owns_kv
            specs.append(
                LayerCacheSpec(
                    window=cfg.sliding_window,
                    kv_dim=cfg.head_dim,
                    ratio=role.ratio,
                    compressor_width=cfg.head_dim if owns else 0,
                    index_dim=cfg.index_head_dim if owns else 0,
                    shared_from=role.kv_source if role.ratio and not owns else None,
                    token_ids=i == self._history_layer,
                    # the QAT formats every written value has (fake-quant on)
                    window_format="fp8_pow2_32" if cfg.fake_quant else None,
                    entry_format="fp4_e4m3_16" if cfg.fake_quant and role.ratio and owns else None,
                    index_format="fp4_pow2_32" if cfg.fake_quant and role.ratio and owns else None,
                )
            )
        return specs

    def _ced_split_for(self, batch: ForwardBatch) -> int | None:
        if batch.decoder_rows is None:
            return None
        if self.ced_split is None:
            raise ValueError(
                "ced_prefill: this model has no causal encoder/decoder split (no ratio-1 KV source)"
            )
        return self.ced_split

    def engram_ids(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Hash ids [T, engram layers, cols]; records this step's compressed ids as history."""
        layout = self.engram_layout
        if layout is None:
            return None
        if self.token_map is None and self._identity_map:
            self.token_map = torch.arange(self.config.vocab_size, device=input_ids.device)
        if self.token_map is None:
            raise RuntimeError("Engram's token map is unbound: call bind_tokenizer(tokenizer) first")
        if self.token_map.device != input_ids.device:
            self.token_map = self.token_map.to(input_ids.device)
        history = batch.pools[self._history_layer].token_ids
        assert history is not None
        history = batch.write(history, batch.window_write, self.token_map[input_ids])
        n = layout.max_ngram
        past = history[batch.window_idx[:, :n]]
        past = torch.where(batch.window_valid[:, :n], past, DEAD)
        return engram_hash_ids(past, layout, self._engram_pad)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """With ``batch.feature_idx``: ``(logits, features [N, m * d])``, the DSpark features
        (the mean stream entering each ``dspark_target_layer_ids`` layer) of those rows."""
        cfg = self.config
        hash_ids = self.engram_ids(input_ids, batch)
        h = self.embed(input_ids)
        streams = h.unsqueeze(1).expand(h.shape[0], cfg.hc_mult, h.shape[-1]).contiguous()
        pre_mix = first_site_pre_mix(h.shape[0], cfg.hc_mult, h.device)
        shared = StepShared()
        batch.record(batch.to_grid(streams))
        narrow_at = self._ced_split_for(batch)
        targets = set(cfg.dspark_target_layer_ids) if batch.feature_idx is not None else set()
        features: list[torch.Tensor] = []
        for i, (layer, pools) in enumerate(zip(self.layers, batch.pools, strict=True)):
            if layer.engram is not None:
                streams = layer.engram(streams, hash_ids[:, self._engram_slot[i]])
            if i in targets:  # DSpark reads the mean stream entering its target layers
                features.append(streams[batch.feature_idx].mean(dim=1))
            compressed = i == narrow_at
            if compressed:  # CED: the decoder's KV source sees every row, the decoder only some
                assert batch.decoder_rows is not None
                layer.attn.compress(layer.attn_norm(hc_collapse(streams, pre_mix)), pools, batch, shared)
                rows = batch.decoder_rows
                if rows.numel() == 0:  # every row is encoder-only: nothing left to run or return
                    return torch.zeros(0, cfg.vocab_size, device=streams.device)
                streams, pre_mix, positions, input_ids = (
                    streams[rows],
                    pre_mix[rows],
                    positions[rows],
                    input_ids[rows],
                )
                hash_ids = hash_ids[rows] if hash_ids is not None else None
                batch = batch.decoder_batch()
            grid = batch.to_grid(streams), batch.to_grid(pre_mix)  # hooks see [B, S, ...] (research)
            out, out_pre = layer(*grid, positions, input_ids, pools, batch, shared, compressed)
            batch.record(out)
            streams, pre_mix = batch.to_flat(out), batch.to_flat(out_pre)
        if batch.logits_idx is not None:
            streams, pre_mix = streams[batch.logits_idx], pre_mix[batch.logits_idx]
        x = self.norm(hc_collapse(streams, pre_mix))
        logits = F.linear(x.float(), self.head.weight.float())
        if batch.feature_idx is not None:
            return logits, torch.cat(features, dim=-1)
        return logits


def ced_split_layer(plan: list[LayerRole]) -> int | None:
    """The first decoder layer of the causal encoder/decoder split:
    the first ratio-1 layer, which must be the only KV source from there on, with no layer
    after it pooling at a ratio > 1. None when the model has no such split."""
    split = next((i for i, r in enumerate(plan) if r.ratio == 1), None)
    if split is None:
        return None
    after = plan[split:]
    if any(r.ratio > 1 for r in after) or any(r.ratio and r.kv_source != split for r in after):
        return None
    return split
