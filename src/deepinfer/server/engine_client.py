"""What the routes ask of the engine, and the one adapter that answers from a local ``LLM``.

The routes see only ``EngineClient``: model facts (checkpoint path, context length, vocabulary
size, how many sequences run at once, how many tokens one request's cache can hold), the
tokenizer and chat format, request submission and abort, health, the served LoRA adapters
(loaded and unloaded between steps), and the load figures ``/metrics`` reports. Only
``LocalEngineClient`` knows how those are found on an ``LLM`` and its ``AsyncLLM``, so a change
inside the engine is met here, not in every handler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from deepinfer.chat import ChatFormat
from deepinfer.llm import LLM
from deepinfer.lora.registry import LoraRegistry
from deepinfer.lora.request import LoRARequest
from deepinfer.outputs import Metric, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.async_llm import AsyncLLM


class LoraDisabledError(ValueError):
    """An adapter was named to a server started without ``--enable-lora``: answer 400."""


class UnknownAdapterError(ValueError):
    """The adapter to unload is not loaded: answer 404."""


@dataclass(frozen=True)
class AdapterInfo:
    """A served adapter as ``/v1/models`` lists it."""

    name: str
    path: str
    parent: str | None  # the base model it was made for, when its loader said (else the served one)


@dataclass(frozen=True)
class LoraLoad:
    """The adapter figures ``/metrics`` refreshes on each scrape."""

    loaded: int
    running: list[str]  # distinct adapters of the running requests
    waiting: list[str]  # distinct adapters of the waiting ones
    max_loras: int


@dataclass(frozen=True)
class EngineLoad:
    """The figures ``/metrics`` refreshes on each scrape."""

    running: int
    waiting: int
    kv_usage: float  # share of KV cache blocks in use, 0-1
    moe_lb: float  # slowest expert-parallel rank's routed tokens / the mean (1: even)
    lora: LoraLoad | None = None  # None: the server serves no adapters
    cache: list[Metric] = field(default_factory=list)  # ``LLM.get_metrics()``


class EngineClient(Protocol):
    """The engine as the HTTP routes use it."""

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, or None (such a model takes token ids only)."""
        ...

    @property
    def chat_format(self) -> ChatFormat: ...

    @property
    def model_path(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_num_seqs(self) -> int:
        """Sequences run at once: a request wider than this can never be admitted."""
        ...

    @property
    def cache_capacity(self) -> int:
        """Tokens one request can hold: the context, or the whole cache when that is smaller."""
        ...

    def healthy(self) -> bool:
        """The engine loop runs and takes new requests."""
        ...

    async def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed_offset: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request; its outputs once the engine took it (``AsyncLLM.add``)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def on_finished(self, callback: Callable[[RequestOutput], None]) -> None:
        """Call ``callback`` with each finished request's output (in the engine thread)."""
        ...

    async def control(self, action: str, **options: Any) -> Any:
        """An RL control action between two steps (``CONTROL_ACTIONS``): its result, or the
        engine's error for it."""
        ...

    @property
    def lora_enabled(self) -> bool:
        """The engine serves LoRA adapters (``--enable-lora``)."""
        ...

    def lora_request(self, name: str) -> LoRARequest | None:
        """The request field that runs the loaded adapter ``name``; None when none is."""
        ...

    def lora_adapters(self) -> list[AdapterInfo]:
        """The loaded adapters, oldest first."""
        ...

    async def load_lora(self, name: str, path: str, parent: str | None = None) -> None:
        """Load an adapter between two steps; ``ValueError`` naming the problem, and the
        served adapters unchanged, when it cannot be served."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter between two steps (running requests finish with it);
        ``UnknownAdapterError`` when it is not loaded."""
        ...


# what ``EngineClient.control`` does: the ``LLM`` methods it calls (``llm_rollout.py``)
CONTROL_ACTIONS = (
    "load_weights_from_disk",
    "sleep",
    "wake_up",
    "is_sleeping",
    "pause_generation",
    "continue_generation",
    "weight_version",
)


class LocalEngineClient:
    """``EngineClient`` over an in-process ``LLM`` driven by an ``AsyncLLM``, through their
    public surface only."""

    def __init__(self, llm: LLM, async_llm: AsyncLLM) -> None:
        self._llm = llm
        self._async_llm = async_llm
        self._parents: dict[str, str] = {}  # adapters whose loader named their base model

    @property
    def tokenizer(self) -> Any:
        return self._llm.tokenizer

    @property
    def chat_format(self) -> ChatFormat:
        return self._llm.chat_format

    @property
    def model_path(self) -> str:
        return str(self._llm.path)

    @property
    def max_model_len(self) -> int:
        return self._llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._llm.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self._llm.config.max_num_seqs

    @property
    def cache_capacity(self) -> int:
        return self._llm.max_request_tokens

    def healthy(self) -> bool:
        return self._async_llm.serving

    async def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed_offset: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        return await self._async_llm.add(
            request_id, prompt_ids, params, seed_offset, cache_salt, lora_request
        )

    def abort(self, request_id: str) -> None:
        self._async_llm.abort(request_id)

    def load(self) -> EngineLoad:
        running, waiting = self._async_llm.num_requests()
        llm = self._llm
        return EngineLoad(
            running, waiting, llm.kv_cache_usage(), llm.moe_lb(), self._lora_load(), llm.get_metrics()
        )

    def on_finished(self, callback: Callable[[RequestOutput], None]) -> None:
        self._async_llm.stats_callbacks.append(callback)

    async def control(self, action: str, **options: Any) -> Any:
        if action not in CONTROL_ACTIONS:
            raise ValueError(f"unknown control action {action!r}")
        llm, loop = self._llm, self._async_llm

        def run() -> Any:
            if action in ("is_sleeping", "weight_version"):
                return getattr(llm, action)
            return getattr(llm, action)(**options)

        return await loop.between_steps(run)

    # ---- LoRA adapters --------------------------------------------------------------------

    @property
    def _registry(self) -> LoraRegistry | None:
        return self._llm.lora_registry

    def _require_lora(self) -> LoraRegistry:
        registry = self._registry
        if registry is None:
            raise LoraDisabledError("LoRA is not enabled on this server (start it with --enable-lora)")
        return registry

    @property
    def lora_enabled(self) -> bool:
        return self._registry is not None

    def lora_request(self, name: str) -> LoRARequest | None:
        registry = self._registry
        loaded = None if registry is None else registry.adapters.get(name)
        # no path: an adapter unloaded before the engine takes the request is an error then,
        # never read again from its directory behind the unload
        return None if loaded is None else LoRARequest(name, loaded.int_id)

    def lora_adapters(self) -> list[AdapterInfo]:
        registry = self._registry
        if registry is None:
            return []
        held = list(registry.adapters.values())  # one copy: the engine thread reorders the dict
        return [AdapterInfo(a.name, str(a.adapter.path), self._parents.get(a.name)) for a in held]

    def load_lora_now(self, name: str, path: str, parent: str | None = None) -> None:
        """Load on the calling thread: before the engine loop starts (``--lora-modules``),
        or on it (``load_lora``)."""
        self._require_lora().load(name, path)
        if parent is not None:
            self._parents[name] = parent

    async def load_lora(self, name: str, path: str, parent: str | None = None) -> None:
        self._require_lora()
        await self._async_llm.between_steps(lambda: self.load_lora_now(name, path, parent))

    def _unload_now(self, name: str) -> None:
        registry = self._require_lora()
        try:
            registry.unload(name)
        except ValueError as exc:  # the registry's only refusal: not loaded
            raise UnknownAdapterError(str(exc)) from exc
        self._parents.pop(name, None)

    async def unload_lora(self, name: str) -> None:
        self._require_lora()
        await self._async_llm.between_steps(lambda: self._unload_now(name))

    def _lora_load(self) -> LoraLoad | None:
        registry = self._registry
        if registry is None:
            return None
        # copies: the engine thread moves requests between these while a scrape reads
        running, waiting = self._async_llm.queues()
        return LoraLoad(
            len(registry.adapters),
            registry.running([r.lora for r in running]),
            registry.running([r.lora for r in waiting]),
            registry.max_loras,
        )
