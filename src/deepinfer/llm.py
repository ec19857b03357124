"""``LLM``: the user's entry point for offline generation."""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing.connection
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.config import EngineConfig
from deepinfer.distributed.replicas import ReplicaPool, RequestSpec, balanced_shares, serve, torch_threads
from deepinfer.engine.driver import EngineDriver
from deepinfer.engine.engine import Engine
from deepinfer.engine.memory import engine_kv_cache_report, weight_bytes
from deepinfer.engine.request import Request
from deepinfer.llm_rollout import RolloutMixin, check_trainer_model
from deepinfer.lora.request import LoRARequest, per_prompt
from deepinfer.models.base import CausalLM
from deepinfer.models.loading import load_model
from deepinfer.outputs import Metric, RequestOutput
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.chat import ChatFormat
    from deepinfer.lora.registry import LoraRegistry

PromptType = str | list[int] | dict[str, Any]

logger = logging.getLogger("deepinfer")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def engine_config(**kwargs: Any) -> EngineConfig:
    """EngineConfig from keyword arguments, naming any unknown field."""
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, torch.dtype):
        kwargs["dtype"] = str(dtype).removeprefix("torch.")
    config = EngineConfig(**kwargs)
    parse_dtype(config.dtype)
    config.validate()
    return config


class LLM(RolloutMixin):
    """Load a checkpoint directory and generate from it.

    ``LLM(path, **EngineConfig fields).generate(prompts, SamplingParams(...))`` returns one
    ``RequestOutput`` per prompt, in order. Prompts may be text (needs a tokenizer in the
    checkpoint), token ids, ``{"prompt_token_ids": [...]}``, or a list of those.
    ``LLM.from_model(module)`` generates from a module being trained (``llm_rollout.py``).
    """

    def __init__(self, model: str | Path, **engine_kwargs: Any) -> None:
        self.config = engine_config(**engine_kwargs)
        from deepinfer.weights.catalog import resolve_model

        self.path = resolve_model(model)
        # data_parallel_replicas: the workers load while this process does
        self._replicas: ReplicaPool | None = None
        self._replica_threads = torch.get_num_threads()
        replicas = self.config.data_parallel_replicas
        if replicas > 1:
            self._replica_threads = torch.get_num_threads() // replicas
            if self._replica_threads < 1:
                raise ValueError(
                    f"data_parallel_replicas={replicas} needs at least {replicas} CPU threads; "
                    f"torch.get_num_threads() is {torch.get_num_threads()}"
                )
            worker_kwargs = {**engine_kwargs, "data_parallel_replicas": 1}
            self._replicas = ReplicaPool(
                replicas - 1, _replica_worker, (str(self.path), worker_kwargs, self._replica_threads)
            )
            weakref.finalize(self, self._replicas.close)
        quantization = self.config.quantization
        self.model = load_model(
            self.path,
            dtype=parse_dtype(self.config.dtype),
            device=self.config.device,
            fake_quant=self.config.fake_quant,
            keep_quantized=quantization in (None, "fp8"),
        )
        self._start_engine(self._load_tokenizer(), following=False)
        if self._replicas is not None:
            self._replicas.wait_ready()

    @classmethod
    def from_model(cls, model: CausalLM, tokenizer: Any = None, **engine_kwargs: Any) -> LLM:
        """An engine over a live module (``load_model(..., requires_grad=True)``) that shares
        its parameters' storage: what the trainer writes in place (optimizer steps,
        ``param.copy_``) is what the next step computes with; the engine's derived copies
        follow its version counters (``engine/weight_sync.py``). ``tokenizer``: a tokenizer
        or a directory holding one (None: token-id prompts only). ``dtype`` and ``device``
        are the module's."""
        self = cls.__new__(cls)
        self.config = engine_config(**check_trainer_model(model, engine_kwargs))
        self.path, self._replicas = None, None
        self._replica_threads = torch.get_num_threads()
        self.model = model
        if isinstance(tokenizer, str | Path):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self._start_engine(tokenizer, following=True)
        return self

    def _start_engine(self, tokenizer: Any, following: bool) -> None:
        self.tokenizer = tokenizer
        self.engine = Engine(
            self.model, self.config, tokenizer, checkpoint=self.path, follow_parameters=following
        )
        by_dtype = weight_bytes(self.model)
        logger.info(
            "weights: %.1f MiB resident (%s)",
            sum(by_dtype.values()) / 2**20,
            ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(by_dtype.items())),
        )
        self.driver = EngineDriver(self.engine)
        self._counter = itertools.count()
        self._init_rollout(following)

    def close(self) -> None:
        """Release what outlives this object otherwise: tensor-parallel worker processes and
        replica processes."""
        if self._replicas is not None:
            self._replicas.close()
            self._replicas = None
        self.engine.close()

    def memory_report(self) -> dict[str, Any]:
        """Where the memory goes: resident weight bytes by dtype, and the KV cache (bytes
        allocated and in use, bytes per token by layer kind; ``engine_kv_cache_report``)."""
        by_dtype = weight_bytes(self.model)
        return {
            "weights": {"bytes": sum(by_dtype.values()), "by_dtype": by_dtype},
            "kv_cache": engine_kv_cache_report(self.engine),
        }

    def kv_cache_usage(self) -> float:
        """The fraction of the paged cache's blocks in use, over every data-parallel rank."""
        pools = self.engine.block_pools
        return 1.0 - sum(p.num_free for p in pools) / sum(p.num_blocks for p in pools)

    def get_metrics(self) -> list[Metric]:
        """The cache's metrics now (vLLM's method name): prefix-cache queries and hits, and
        the host and disk tiers' hits, bytes moved and load time; ``/metrics`` shows the same."""
        return self.engine.metrics()

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request can hold: ``max_model_len``, or fewer where the cache
        holds fewer."""
        engine = self.engine
        return min(engine.max_model_len, engine.num_blocks * engine.layout.block_size)

    @property
    def lora_registry(self) -> LoraRegistry | None:
        """The served adapters (``enable_lora``; None without)."""
        return self.engine.lora

    def moe_lb(self) -> float:
        """Slowest rank / mean rank of the counted routed-expert load (EPLB's balance)."""
        return self.engine.executor.moe_lb()

    @functools.cached_property
    def chat_format(self) -> ChatFormat:
        """How this checkpoint's conversations become prompts (``chat/formats.py``)."""
        from deepinfer.chat import chat_format_for

        return chat_format_for(getattr(self.model.config, "architecture", ""), self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return self.engine.eos_token_ids

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _load_tokenizer(self) -> Any:
        if not any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer, PretrainedConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        # A model type transformers does not know (deepseek_v41 in 5.24) would make AutoTokenizer
        # warn while reading config.json; the tokenizer files alone say which class to build.
        arch = getattr(getattr(self.model, "config", None), "architecture", "")
        unknown = arch == "DeepseekV41ForCausalLM" and "deepseek_v41" not in CONFIG_MAPPING
        extra = {"config": PretrainedConfig()} if unknown else {}
        return AutoTokenizer.from_pretrained(str(self.path), **extra)

    # ---- input handling -------------------------------------------------------------------

    def _normalize_prompts(self, prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        if isinstance(prompts, list | tuple):
            if not prompts:
                raise ValueError("prompts must not be empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
                return [list(prompts)]
            return list(prompts)
        raise ValueError(
            f"prompts must be str, list[int], dict or a list of those, got {type(prompts).__name__}"
        )

    def _prompt_ids(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        where = f"prompts[{index}]"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where} is text but this engine has no tokenizer; pass token ids instead")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"{where} is a dict without 'prompt_token_ids'")
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"{where} must be str, list[int] or dict, got {type(prompt).__name__}")

    def _params_list(
        self, params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} of them")
        return params

    def _add(
        self, prompt: PromptType, index: int, params: SamplingParams, lora: LoRARequest | None = None
    ) -> list[Request]:
        """Queue one prompt (n siblings for n > 1); on a bad prompt nothing is queued."""
        if self.driver.asleep:
            raise RuntimeError("the engine is asleep (LLM.sleep): call wake_up() before adding requests")
        text, ids = self._prompt_ids(prompt, index)
        base = str(next(self._counter))
        child = replace(params, n=1) if params.n > 1 else params
        added: list[Request] = []
        try:
            for i in range(params.n):
                rid = base if params.n == 1 else f"{base}-{i}"
                req = self.engine.add_request(
                    rid, ids, child, prompt=text, generator_offset=i, lora_request=lora
                )
                req.parent_id = base if params.n > 1 else None
                added.append(req)
        except ValueError as exc:
            self._drop([added])
            raise ValueError(f"prompts[{index}]: {exc}") from exc
        return added

    # ---- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt. All inputs are validated before any work starts: a bad
        prompt raises ValueError naming it, and nothing of the call is queued.
        ``lora_request``: the adapter every prompt runs with, or one per prompt (None: the
        base model; needs ``enable_lora=True``)."""
        items = self._normalize_prompts(prompts)
        params = self._params_list(sampling_params, len(items))
        adapters = per_prompt(lora_request, len(items))
        groups: list[list[Request]] = []
        try:
            for i, (prompt, p) in enumerate(zip(items, params, strict=True)):
                groups.append(self._add(prompt, i, p, adapters[i]))
        except ValueError:
            self._drop(groups)
            raise
        show = len(items) >= 8 if use_tqdm is None else use_tqdm
        progress = None
        if show:
            from tqdm import tqdm

            progress = tqdm(total=sum(len(g) for g in groups), desc="generate", unit="req")
        on_finished = progress.update if progress is not None else None
        try:
            if self._replicas is not None and len(groups) > 1:
                return self._run_on_replicas(groups, self._replicas, on_finished)
            return self._run(groups, on_finished)
        finally:
            if progress is not None:
                progress.close()

    def _run(
        self,
        groups: list[list[Request]],
        on_finished: Callable[[int], Any] | None = None,
        each_step: Callable[[], None] | None = None,
    ) -> list[RequestOutput]:
        """Step the engine until every queued request of ``groups`` has finished; one output
        per group. ``on_finished(count)`` hears of finished requests, ``each_step`` runs
        after every step."""
        pending = {req.request_id for group in groups for req in group}
        with self.driver.closed_batch():  # nothing else arrives until the call returns
            while pending:
                for req in self.driver.step():
                    if req.finished and req.request_id in pending:
                        pending.discard(req.request_id)
                        if on_finished is not None:
                            on_finished(1)
                if each_step is not None:
                    each_step()
        return [self._merge([self.engine.pop_finished(r.request_id) for r in group]) for group in groups]

    def _run_on_replicas(
        self, groups: list[list[Request]], pool: ReplicaPool, on_finished: Callable[[int], Any] | None
    ) -> list[RequestOutput]:
        """Split the queued groups over the replicas by their token count (prompt plus the
        most it may generate), the lightest share here: the others' requests leave this engine
        for the workers, this share runs on this replica's threads, then the workers' outputs
        are read back. Outputs in the order of ``groups``."""
        costs = [sum(len(r.prompt_token_ids) + r.params.max_tokens for r in g) for g in groups]
        shares = balanced_shares(costs, pool.size + 1)
        outputs: list[RequestOutput | None] = [None] * len(groups)
        try:
            for k, share in enumerate(shares[1:]):
                specs = [
                    [
                        RequestSpec(r.request_id, r.prompt_token_ids, r.params, r.prompt, i)
                        for i, r in enumerate(groups[g])
                    ]
                    for g in share
                ]
                self._drop([groups[g] for g in share])  # validated here; computed there
                pool.submit(k, specs, report_progress=on_finished is not None)
            drain = (lambda: pool.drain_progress(on_finished)) if on_finished is not None else None
            with torch_threads(self._replica_threads):
                local = self._run([groups[g] for g in shares[0]], on_finished, drain)
        except BaseException:
            self._drop(groups)  # a failed call leaves nothing queued here ...
            pool.discard_results()  # ... nor a worker's result for the next call to read
            raise
        for g, out in zip(shares[0], local, strict=True):
            outputs[g] = out
        try:
            for k, share in enumerate(shares[1:]):
                for g, out in zip(share, pool.collect(k, on_finished), strict=True):
                    outputs[g] = out
        except BaseException:
            pool.discard_results()
            raise
        assert all(out is not None for out in outputs)
        return outputs  # type: ignore[return-value]

    def _drop(self, groups: list[list[Request]]) -> None:
        """Abort and forget the requests of ``groups`` this engine still holds."""
        for group in groups:
            for req in group:
                if req.request_id in self.engine.requests:
                    self.engine.abort(req.request_id)
                    self.engine.pop_finished(req.request_id)

    def _run_specs(
        self, specs: list[list[RequestSpec]], on_finished: Callable[[int], Any] | None
    ) -> list[RequestOutput]:
        """A replica worker's share: queue the caller's requests under their ids, run them (a
        failure leaves nothing queued for the next share)."""
        groups: list[list[Request]] = []
        try:
            for group in specs:
                groups.append([])
                for s in group:
                    groups[-1].append(
                        self.engine.add_request(
                            s.request_id,
                            s.prompt_token_ids,
                            s.params,
                            prompt=s.prompt,
                            generator_offset=s.generator_offset,
                        )
                    )
            return self._run(groups, on_finished)
        except BaseException:
            self._drop(groups)
            raise

    def _merge(self, siblings: list[Request]) -> RequestOutput:
        out = self.engine.make_output(siblings[0])
        out.request_id = siblings[0].parent_id or out.request_id  # siblings of n > 1 name their parent
        for i, req in enumerate(siblings[1:], 1):
            completion = self.engine.make_output(req).outputs[0]
            completion.index = i
            out.outputs.append(completion)
        return out

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` messages) or
        several, in the checkpoint's chat format (its template; DeepSeek-V4's message format,
        where ``chat_template_kwargs={"thinking": False}`` turns thinking off); message text
        never becomes a control token (``chat/``). The reply text is returned as generated."""
        from deepinfer.chat import ChatOptions

        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations")
        conversations = messages if isinstance(messages[0], list) else [messages]
        options = ChatOptions.from_request(chat_template_kwargs)
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                ids = self.chat_format.encode(conv, tools, add_generation_prompt, options)
            except ValueError as exc:
                raise ValueError(f"messages[{i}]: {exc}" if len(conversations) > 1 else str(exc)) from exc
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def stream(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield one ``RequestOutput`` per new token holding only that step's delta (new token
        ids, logprobs and newly decodable text); the last one has ``finished=True``."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream supports n=1 only")
        (req,) = self._add(prompt, 0, params, lora_request)
        sent_tokens, sent_text = 0, ""
        try:
            while True:
                updated = self.driver.step()
                if req not in updated:
                    if req.finished:
                        break
                    continue
                out = self.engine.make_output(req)
                completion = out.outputs[0]
                text = completion.text
                if text.endswith("\ufffd") and not req.finished:
                    new_text = ""  # wait for the rest of a multi-byte character
                else:
                    new_text, sent_text = text[len(sent_text) :], text
                completion.token_ids = completion.token_ids[sent_tokens:]
                if completion.logprobs is not None:
                    completion.logprobs = completion.logprobs[sent_tokens:]
                completion.text = new_text
                sent_tokens = len(req.output_token_ids)
                yield out
                if req.finished:
                    break
        finally:  # also when the caller stops iterating early
            if not req.finished:
                self.engine.abort(req.request_id)
            self.engine.pop_finished(req.request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


def _replica_worker(
    conn: multiprocessing.connection.Connection, model: str, engine_kwargs: dict[str, Any], threads: int
) -> None:
    """Entry point of a ``data_parallel_replicas`` worker process: an engine of its own on
    ``threads`` threads, serving the shares its caller sends (``replicas.serve``)."""
    torch.set_num_threads(threads)
    serve(conn, lambda: LLM(model, **engine_kwargs)._run_specs)
