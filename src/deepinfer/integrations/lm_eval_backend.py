"""The lm-evaluation-harness backend ``deepinfer`` (``--model deepinfer --model_args
pretrained=smollm2-135m,kv_cache_dtype=int8``). Importing this module registers it: lm-eval
0.4.x reads no entry points for models, so ``python -m deepinfer.integrations.lm_eval_cli`` is
lm-eval's command line with it registered.

Tokenization is lm-eval's own (``TemplateLM._encode_pair``, HFLM's BOS rule), so a score is
comparable with lm-eval's ``hf`` backend. Scoring runs every request of a call as one
``LLM.generate`` of ``max_tokens=1`` with ``prompt_logprobs=1``: the continuation's logprobs
are read at its prompt positions (the engine computes every prompt token's logits for such a
request and skips the prefix cache for it)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import jinja2
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    maybe_truncate,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from deepinfer.integrations.model_args import convert, engine_options, split_arg_string
from deepinfer.llm import LLM
from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer")

NAME = "deepinfer"
# the backend's own model_args (HFLM's names) and their types; every other key is an engine option
OWN_ARGS: dict[str, tuple[type, ...]] = {
    "pretrained": (str,),
    "add_bos_token": (bool, type(None)),
    "prefix_token_id": (int, type(None)),
    "max_length": (int, type(None)),
    "max_gen_toks": (int,),
}
# what lm-eval's command line passes to every backend: the engine batches a whole call itself
# and has no remote code to trust, so these are accepted and unused
IGNORED_ARGS = ("batch_size", "max_batch_size", "trust_remote_code")
# one step per request: its prompt tokens' logprobs (the token and the top-1, with its rank)
SCORING = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)


def continuation_score(
    tokens: Sequence[int], entries: Sequence[dict[int, Logprob] | None], ctxlen: int
) -> tuple[float, bool]:
    """The log-likelihood of ``tokens[ctxlen:]`` and whether each of them was the most likely
    token at its position (lm-eval's ``is_greedy``: no token had a strictly higher logprob,
    which the engine's rank says exactly). ``entries[i]`` is prompt token i's entry."""
    if ctxlen < 1:
        raise ValueError(f"ctxlen must be >= 1 (the first token has no logprob), got {ctxlen}")
    picked = [entries[i][tokens[i]] for i in range(ctxlen, len(tokens))]
    return sum(p.logprob for p in picked), all(p.rank == 1 for p in picked)


def _device(requested: str | None) -> str | None:
    """lm-eval's ``--device`` (default ``cuda:0``) as the engine's device: CUDA only where
    there is CUDA, else the CPU (HFLM's rule)."""
    if requested is None or not requested.startswith("cuda") or torch.cuda.is_available():
        return requested
    logger.info("device %s: CUDA is not available, using the CPU", requested)
    return "cpu"


@register_model(NAME)
class DeepInferLM(TemplateLM):
    """lm-eval's ``LM`` over a deepinfer ``LLM``: ``loglikelihood``, ``loglikelihood_rolling``
    and ``generate_until``, with chat templates from the checkpoint's tokenizer."""

    def __init__(
        self,
        pretrained: str,
        device: str | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        own = {
            "pretrained": pretrained,
            "add_bos_token": add_bos_token,
            "prefix_token_id": prefix_token_id,
            "max_length": max_length,
            "max_gen_toks": max_gen_toks,
        }
        own = {k: convert(k, v, OWN_ARGS[k]) for k, v in own.items()}
        options = engine_options({k: v for k, v in kwargs.items() if k not in IGNORED_ARGS})
        if "device" not in options and _device(device) is not None:
            options["device"] = _device(device)
        self.llm = LLM(own["pretrained"], **options)
        if self.llm.tokenizer is None:
            raise ValueError(f"pretrained: {own['pretrained']} has no tokenizer, which lm-eval needs")
        self.tokenizer = self.llm.tokenizer
        self.add_bos_token = own["add_bos_token"]
        self.custom_prefix_token_id = own["prefix_token_id"]
        self._max_length = own["max_length"]
        self._max_gen_toks = own["max_gen_toks"]
        self.pretrained = own["pretrained"]

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DeepInferLM:
        """Values stay text until each is converted to its option's type (lm-eval's own parser
        would read ``quantization=none`` as None)."""
        return cls(**_merged(split_arg_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> DeepInferLM:
        return cls(**_merged(dict(arg_dict), additional_config))

    # ---- what lm-eval reads of a model --------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What conditions a continuation with an empty context (HFLM's choice)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or self.llm.max_request_tokens

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The conversation as text in the tokenizer's chat template; a template that refuses
        a system turn gets the conversation without it (HFLM's fallback)."""

        def render(history: list[dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(
                history,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            logger.warning("the chat template failed; retrying without the system turn")
            return render([m for m in chat_history if m["role"] != "system"])

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """HFLM's rule: ``add_bos_token`` decides special tokens unless the caller does, and a
        string that already starts with the prefix token gets none added."""
        special: dict[str, bool] = {}
        if add_special_tokens is not None:
            special["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            special["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None and string.startswith(self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    # ---- requests -----------------------------------------------------------------------

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Score each (cache key, context ids, continuation ids): one engine call for all. A
        context too long for the model loses its oldest tokens."""
        if not requests:
            return []
        limit = self.max_length - 1  # the prompt, with room for the one step the engine runs
        prompts, ctxlens = [], []
        for _, context, continuation in requests:
            if len(continuation) >= limit:
                raise ValueError(
                    f"a continuation of {len(continuation)} tokens leaves no context within "
                    f"max_length={self.max_length}"
                )
            whole = (context + continuation)[-limit:]
            prompts.append({"prompt_token_ids": whole})
            ctxlens.append(len(whole) - len(continuation))
        outputs = self.llm.generate(prompts, SCORING, use_tqdm=not disable_tqdm)
        results = []
        for (key, _, _), out, ctxlen in zip(requests, outputs, ctxlens, strict=True):
            answer = continuation_score(out.prompt_token_ids, out.prompt_logprobs, ctxlen)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            results.append(answer)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows that fit the model (lm-eval's
        windowing); every window of every text goes to the engine at once."""
        windows: list[tuple[Any, list[int], list[int]]] = []
        owners: list[int] = []
        for i, req in enumerate(requests):
            (text,) = req.args
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 2,  # a window, its context token and one step
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Generate for every request at once, each with its own stop strings and settings
        (greedy unless the task samples); the text ends before the first stop string."""
        if not requests:
            return []
        eos = self.tokenizer.decode(self.eot_token_id)
        prompts, params, stops = [], [], []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            kwargs.pop("do_sample", None)
            ids, max_gen_toks = maybe_truncate(
                self.tok_encode(context), max_gen_toks=max_gen_toks, max_model_len=self.max_length
            )
            try:
                params.append(SamplingParams(max_tokens=max_gen_toks, stop=[s for s in until if s], **kwargs))
            except ValueError as exc:
                raise ValueError(f"gen_kwargs: {exc}") from exc
            prompts.append({"prompt_token_ids": ids})
            stops.append(until)
        outputs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        texts = []
        for req, out, until in zip(requests, outputs, stops, strict=True):
            text = postprocess_generated_text(out.outputs[0].text, until, None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records of the model in its results."""
        return {"model": str(self.llm.path), "dtype": self.llm.config.dtype, "engine": NAME}


def _merged(args: dict[str, Any], additional_config: dict | None) -> dict[str, Any]:
    """model_args, then what lm-eval's command line adds (``--device``, ``--batch_size``)
    where model_args does not say it."""
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in args}
    return {**args, **extra}
