"""``LLM``: the user's entry point for offline generation (DESIGN.md §6)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from deepinfer.engine.lockstep import RowState, lockstep_generate, run_to_completion
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.weights.loader import load_model

PromptType = str | list[int] | dict[str, Any]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


class LLM:
    """Load a checkpoint directory and generate from it.

    ``LLM(path).generate(prompts, SamplingParams(...))`` returns one ``RequestOutput`` per
    prompt, in order. Prompts may be text (needs a tokenizer in the checkpoint), token ids,
    ``{"prompt_token_ids": [...]}``, or a list of those.
    """

    def __init__(
        self,
        model: str | Path,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        fake_quant: bool = False,
    ) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        self.path = Path(model)
        self.model = load_model(self.path, dtype=parse_dtype(dtype), device=device, fake_quant=fake_quant)
        cfg = self.model.config
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.max_num_seqs = max_num_seqs
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(cfg.eos_token_id)
        self.tokenizer = self._load_tokenizer()
        self._request_counter = itertools.count()

    def _load_tokenizer(self) -> Any:
        if not any((self.path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))

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
                raise ValueError(f"{where} is text but {self.path} has no tokenizer; pass token ids instead")
            ids = self.tokenizer(prompt).input_ids
            text: str | None = prompt
        elif isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"{where} is a dict without 'prompt_token_ids'")
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif isinstance(prompt, list | tuple):
            ids, text = prompt, None
        else:
            raise ValueError(f"{where} must be str, list[int] or dict, got {type(prompt).__name__}")
        if not isinstance(ids, list | tuple) or not ids:
            raise ValueError(f"{where}: prompt token ids must be a non-empty list of integers")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{where}: token id {t!r} is not an integer in [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{where}: prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        return text, list(ids)

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

    # ---- generation -----------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; all inputs are validated before any work starts."""
        items = self._normalize_prompts(prompts)
        parsed = [self._prompt_ids(p, i) for i, p in enumerate(items)]
        params = self._params_list(sampling_params, len(items))
        request_ids = [str(next(self._request_counter)) for _ in items]
        results: list[RequestOutput | None] = [None] * len(items)
        groups: dict[int, list[int]] = {}
        for i, (_, ids) in enumerate(parsed):
            groups.setdefault(len(ids), []).append(i)
        batches = [
            members[k : k + self.max_num_seqs]
            for members in groups.values()
            for k in range(0, len(members), self.max_num_seqs)
        ]
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(items), desc="generate")
        for members in batches:
            rows = run_to_completion(
                lockstep_generate(
                    self.model,
                    [parsed[i][1] for i in members],
                    [params[i] for i in members],
                    self.eos_token_ids,
                    self.max_model_len,
                )
            )
            for i, row in zip(members, rows, strict=True):
                text, ids = parsed[i]
                results[i] = self._request_output(request_ids[i], text, ids, row, finished=True)
            if progress is not None:
                progress.update(len(members))
        if progress is not None:
            progress.close()
        return [r for r in results if r is not None]

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield one ``RequestOutput`` per new token holding only that step's delta
        (new token ids and the newly decodable text); the last one has ``finished=True``."""
        text, ids = self._prompt_ids(prompt, 0)
        params = self._params_list(sampling_params, 1)
        request_id = str(next(self._request_counter))
        emitted_tokens, emitted_text = 0, ""
        for (row,) in lockstep_generate(self.model, [ids], params, self.eos_token_ids, self.max_model_len):
            finished = row.finish_reason is not None
            full_text = self._decode(row.token_ids)
            if full_text.endswith("\ufffd") and not finished:
                new_text = ""  # wait for the rest of a multi-byte character
            else:
                new_text, emitted_text = full_text[len(emitted_text) :], full_text
            delta = RowState(row.params, row.token_ids[emitted_tokens:], finish_reason=row.finish_reason)
            if row.logprobs is not None:
                delta.logprobs = row.logprobs[emitted_tokens:]
            delta.cumulative_logprob = row.cumulative_logprob
            emitted_tokens = len(row.token_ids)
            out = self._request_output(request_id, text, ids, delta, finished=finished)
            out.outputs[0].text = new_text
            yield out

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _request_output(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], row: RowState, finished: bool
    ) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self._decode(row.token_ids),
            token_ids=list(row.token_ids),
            cumulative_logprob=row.cumulative_logprob if row.params.logprobs is not None else None,
            logprobs=row.logprobs,
            finish_reason=row.finish_reason,
        )
        return RequestOutput(request_id, prompt, prompt_ids, [completion], finished=finished)
