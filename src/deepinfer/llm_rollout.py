"""``LLM``'s part for reinforcement-learning trainers: an engine over the module being trained,
weight updates between steps, pausing, and sleep.

The pieces follow vLLM's and SGLang's names (``sleep``/``wake_up``, ``update_weights``,
``load_weights_from_disk``, ``pause_generation``/``continue_generation``, a
``weight_version`` on every output), over one engine in this process. How the engine's copies
of the weights follow updates is ``engine/weight_sync.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.engine.driver import EngineDriver
from deepinfer.engine.weight_sync import write_parameters
from deepinfer.feature_modes import refusal
from deepinfer.models.base import CausalLM

if TYPE_CHECKING:
    from deepinfer.config import EngineConfig
    from deepinfer.engine.engine import Engine

# wrappers a trainer's parameter names may carry: DDP's, torch.compile's, FSDP's
_WRAPPER_PARTS = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


class RolloutMixin:
    """Weight updates, pausing and sleep for an ``LLM`` (see the module's docstring)."""

    engine: Engine
    driver: EngineDriver
    model: CausalLM
    config: EngineConfig
    path: Path | None
    _replicas: Any

    def _init_rollout(self, following: bool) -> None:
        self._following = following  # over a trainer's module (``LLM.from_model``)
        self._disk_version: str | None = None if following else "0"  # the weights on disk

    def _one_process(self, what: str) -> None:
        cfg = self.config
        if self._replicas is not None or cfg.tensor_parallel_size != 1 or cfg.data_parallel_size != 1:
            raise ValueError(
                f"{what}: the engine's weights must be this process's (no tensor_parallel_size, "
                "data_parallel_size or data_parallel_replicas > 1)"
            )

    # ---- weights ----------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        """The weights' version, carried by every output: "0" as loaded, then the version
        each update names (or the count of updates)."""
        return self.engine.weights.version

    def update_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        weight_version: str | None = None,
    ) -> str:
        """Write new values into the named parameters, in place, between steps. Names are the
        model's (``model.named_parameters()``, which are the checkpoint's), optionally with a
        trainer's wrapper prefixes (``module.``, ``_orig_mod.``). Every name, shape, dtype and
        value is checked before anything is written: a bad update raises and leaves the old
        weights. Requests running meanwhile are computed again under the new weights; no
        cached prefix of the old weights is reused. Returns the new weight version."""
        self._one_process("update_weights")
        pairs = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        targets = resolve_updates(self.model, pairs)
        with self.driver.between_steps():
            write_parameters(targets)
            return self.driver.apply_weight_writes(None, weight_version)

    def load_weights_from_disk(self, path: str | Path, weight_version: str | None = None) -> str:
        """``update_weights`` with every tensor of the checkpoint directory at ``path`` that
        this model holds (read in full before any is written). Returns the new version."""
        from deepinfer.models.registry import load_config_json, resolve
        from deepinfer.weights.loader import read_checkpoint

        path = Path(path)
        raw = load_config_json(path)
        _, cls = resolve(raw)
        if cls is not type(self.model):
            raise ValueError(f"{path} holds a {cls.__name__}; this engine runs a {type(self.model).__name__}")
        quant = getattr(self.model.config, "quantization", None) or raw.get("quantization_config")
        version = self.update_weights(read_checkpoint(self.model, path, quant), weight_version)
        if not self._following:
            self.path, self._disk_version = path, version
        return version

    def sync_weights(self, weight_version: str | None = None) -> str:
        """Apply now what the next step would find: the copies of every parameter written in
        place since the last sync are made again (an engine over a trainer's module does this
        before each step by itself; calling it after an optimizer step puts the cost there).
        Returns the weight version."""
        return self.driver.apply_weight_writes(None, weight_version)

    def refresh_weights(self, weight_version: str | None = None) -> str:
        """Announce writes PyTorch's version counters do not see (through ``p.data`` or raw
        pointers): every copy the engine derives from the parameters is made again."""
        return self.driver.apply_weight_writes(list(range(len(self.engine.weights.params))), weight_version)

    # ---- pausing ----------------------------------------------------------------------------

    def pause_generation(self) -> None:
        """Run no step until ``continue_generation``; returns once a step in progress (on
        another thread) has ended, so weights may be written between steps."""
        self.driver.pause()

    def continue_generation(self) -> None:
        self.driver.resume()

    @property
    def is_paused(self) -> bool:
        return self.driver.paused

    # ---- sleep ------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Give memory back to the system until ``wake_up`` (an RL trainer's use between
        rollouts). Level 1: the K/V cache's pages (zeroed; every cached prefix forgotten).
        Level 2 also the weights' pages: the parameters (read again from the checkpoint on
        waking; weights pushed by ``update_weights`` since must be pushed again, as with
        vLLM's level 2) and the engine's packed and quantized copies (made again on waking).
        An engine over a trainer's module (``from_model``) never frees the trainer's
        parameters, only its own copies. Refused while requests are unfinished, and where
        the memory is not this process's CPU memory."""
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 (the K/V cache) or 2 (also the weights), got {level!r}")
        if self.config.device != "cpu":
            raise ValueError("sleep: frees CPU memory (device='cpu')")
        self._one_process("sleep")
        self.driver.sleep(level, free_parameters=not self._following)

    def wake_up(self) -> None:
        """Take requests again after ``sleep``; after level 2 the weights are back first
        (read again from the checkpoint, unless they are a trainer's)."""
        self.driver.wake_up(None if self._following else self._reload_parameters, self._disk_version)

    def _reload_parameters(self) -> None:
        from deepinfer.weights.loader import read_checkpoint

        assert self.path is not None
        quant = getattr(self.model.config, "quantization", None)
        write_parameters(resolve_updates(self.model, read_checkpoint(self.model, self.path, quant)))

    @property
    def is_sleeping(self) -> bool:
        return self.driver.asleep


def resolve_updates(model: CausalLM, pairs: list[tuple[str, Any]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each named value beside the tensor it replaces, cast to its dtype and device; raises
    ValueError (TypeError for a value that is no tensor) naming the first bad entry."""
    held = dict(model.named_parameters())
    for name, buffer in model.state_dict(keep_vars=True).items():
        held.setdefault(name, buffer)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i, entry in enumerate(pairs):
        if not (isinstance(entry, tuple | list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise ValueError(f"update_weights: entry {i} is not a (name, tensor) pair")
        given, value = entry
        name = _model_name(given)
        target = held.get(name)
        where = f"update_weights: {given!r}"
        if target is None:
            close = [n for n in held if n.endswith(name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1])][
                :3
            ]
            hint = f" (e.g. {', '.join(close)})" if close else ""
            raise ValueError(f"{where} is not a parameter of this {type(model).__name__}{hint}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}: expected a torch.Tensor, got {type(value).__name__}")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"{where}: shape {tuple(value.shape)}, the parameter's is {tuple(target.shape)}")
        if target.dtype in (torch.float8_e4m3fn, torch.uint8) and value.dtype != target.dtype:
            raise ValueError(
                f"{where}: the engine holds it quantized as stored ({target.dtype}); update a model "
                "loaded with quantization=None or quantization='int8'/'int4'"
            )
        if value.is_floating_point() != target.is_floating_point():
            raise ValueError(f"{where}: dtype {value.dtype}, the parameter's is {target.dtype}")
        value = value.detach().to(device=target.device, dtype=target.dtype)
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{where}: holds NaN or infinite values")
        out.append((target, value))
    return out


def _model_name(name: str) -> str:
    """``name`` without a trainer's wrapper prefixes."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def check_trainer_model(model: Any, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM.from_model``'s options: the model's own dtype and device unless given alike;
    what a trainer's module cannot be served with is refused."""
    if not isinstance(model, CausalLM):
        raise TypeError(
            f"LLM.from_model: takes a deepinfer model (deepinfer.load_model(..., requires_grad=True)), "
            f"got {type(model).__name__}"
        )
    param = next(model.parameters())
    kwargs = dict(engine_kwargs)
    for key, have in (("dtype", str(param.dtype).removeprefix("torch.")), ("device", param.device.type)):
        given = kwargs.setdefault(key, have)
        if str(given).removeprefix("torch.") != have:
            raise ValueError(f"LLM.from_model: {key}={given!r}, but the model's parameters are {have}")
    for key, mode in (("tensor_parallel_size", "tp"), ("data_parallel_size", "dp")):
        if kwargs.get(key, 1) != 1:
            raise ValueError(f"LLM.from_model: {refusal('rl_updates', mode)}")
    if kwargs.get("enable_expert_parallel"):
        raise ValueError(f"LLM.from_model: {refusal('rl_updates', 'ep')}")
    if kwargs.get("data_parallel_replicas", 1) != 1:
        raise ValueError(
            "LLM.from_model: data_parallel_replicas must be 1 (the engine shares this process's parameters)"
        )
    return kwargs
