"""The drafter a speculative configuration names, built over the target model."""

from __future__ import annotations

from typing import Any

from deepinfer.speculative.config import SpeculativeConfig
from deepinfer.speculative.drafter import Drafter
from deepinfer.speculative.dspark import DSparkDrafter
from deepinfer.speculative.mtp import MtpDrafter
from deepinfer.speculative.ngram import NgramDrafter

# What each model drafter needs of the checkpoint (its error when the model has none).
_DRAFT_LAYERS = {
    "mtp": "a DeepSeek-V4 model with its MTP layer (mtp.0.*; num_nextn_predict_layers >= 1 in config.json)",
    "dspark": "a DeepSeek-V4.1 model with its DSpark stages (mtp.*; num_nextn_predict_layers and "
    "dspark_block_size in config.json)",
}


def build_drafter(model: Any, config: SpeculativeConfig, num_slots: int, head_draft: Any = None) -> Drafter:
    """The drafter ``config.method`` names: n-gram lookup, or a model drafter over the draft
    layers the target declares (``CausalLM.draft_model``), or over ``head_draft``: a
    separately trained DSpark head joined with the target (``CausalLM.draft_head``)."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        assert k is not None
        return NgramDrafter(k, config.prompt_lookup_min, config.prompt_lookup_max)
    if head_draft is not None:
        return DSparkDrafter(head_draft, num_slots, k)
    draft = model.draft_model(config.method)
    if draft is None:
        raise ValueError(
            f"speculative_config.method={config.method!r} needs {_DRAFT_LAYERS[config.method]}; "
            f"this {type(model).__name__} has none"
        )
    if config.method == "mtp":
        assert k is not None
        return MtpDrafter(draft, num_slots, k)
    return DSparkDrafter(draft, num_slots, k)
