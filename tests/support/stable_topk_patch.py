"""transformers' V4 indexer under the model's tie rule (ours too, ``models/layers/topk.py``): among
equal scores the older entry wins, as a stable descending sort gives. ``Tensor.topk`` leaves
the order of ties unspecified, so without this patch the reference itself would pick
entries that depend on the row width."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class _StableTopk(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func not in (torch.Tensor.topk, torch.topk):
            return func(*args, **kwargs)
        x, k = args[0], args[1] if len(args) > 1 else kwargs.pop("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = kwargs.get("largest", True)
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def stable_indexer_topk(model: torch.nn.Module) -> torch.nn.Module:
    """Patch every transformers ``DeepseekV4Indexer`` in ``model`` (in place) to the rule."""
    patched = 0
    for module in model.modules():
        if type(module).__name__ == "DeepseekV4Indexer":
            forward = module.forward

            def stable_forward(*args, _forward=forward, **kwargs):
                with _StableTopk():
                    return _forward(*args, **kwargs)

            module.forward = stable_forward
            patched += 1
    assert patched or not any("Indexer" in type(m).__name__ for m in model.modules())
    return model
