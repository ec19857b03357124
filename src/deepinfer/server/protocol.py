"""OpenAI request bodies (vLLM's field names and extra sampling fields) and their conversion
to ``SamplingParams``. Pydantic checks the types strictly (``"stream": "yes"`` or
``"max_tokens": true`` are errors, not coerced); ``SamplingParams`` checks the values; both
errors name the field, which the app turns into a 400 with ``param`` set."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams

# OpenAI's range for a logit bias (SamplingParams clamps to it; the HTTP API refuses past it)
MAX_LOGIT_BIAS = 100.0
_STRICT = ConfigDict(strict=True, extra="ignore")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields both endpoints share (OpenAI's and vLLM's extras)."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    # OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}} or {"type": "json_object"},
    # and vLLM's extra field (StructuredOutputsParams' fields)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # prefill/decode disaggregation (vLLM's field): {"do_remote_decode": true} asks a prefill
    # server to keep the prompt's blocks and say where to take them
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    # the prompt is returned before the completion (with logprobs: the prompt tokens' too)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | int | None = None


class TokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    tokens: list[int]


class RequestError(ValueError):
    """A bad request: ``param`` names the field (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


# deeper JSON than this is no request a client means; nested data (tool schemas, template
# arguments) reaches recursive code (renderers, grammar compilers) that must not meet it
MAX_NESTING = 64


def check_body(body: Any) -> int:
    """What JSON allows and the server refuses, each a 400 naming the field: a lone surrogate
    (``"\\ud800"``: not text, and no tokenizer takes it; a valid pair is one character once
    parsed) and nesting deeper than ``MAX_NESTING``. Iterative, so any depth is safe to walk.
    Returns how many characters the body's strings hold (the prompt size check reads it)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    chars = 0
    while stack:
        value, path, depth = stack.pop()
        where = path or "body"
        if depth > MAX_NESTING:
            raise RequestError(f"{where}: nested deeper than {MAX_NESTING} levels", where)
        if isinstance(value, str):
            chars += len(value)
            found = _LONE_SURROGATE.search(value)
            if found:
                raise RequestError(
                    f"{where}: contains the lone surrogate U+{ord(found.group()):04X}, which is not valid Unicode",
                    where,
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, where, depth + 1))
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{path}[{k}]", depth + 1) for k, item in enumerate(value))
    return chars


def param_of(message: str) -> str | None:
    """The field a ``SamplingParams`` or engine error names (their messages start with it, or
    with "unknown FIELD field(s)")."""
    words = message.split(" ", 2)
    head = (words[1] if words[0] == "unknown" and len(words) > 1 else words[0]).rstrip(":")
    return head if head.replace("_", "").replace(".", "").isalnum() else None


def structured_outputs(req: SamplingFields) -> dict[str, Any] | None:
    """The request's constraint from ``structured_outputs`` or ``response_format``."""
    fmt = req.response_format
    kind = None if fmt is None else fmt.get("type")
    if fmt is not None and kind not in ("text", "json_object", "json_schema"):
        raise RequestError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format",
        )
    if req.structured_outputs is not None and kind in ("json_object", "json_schema"):
        raise RequestError("give structured_outputs or response_format, not both", "response_format")
    if req.structured_outputs is not None:
        return req.structured_outputs
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema") if fmt is not None else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError(
                "response_format.json_schema.schema must be a JSON schema object", "response_format"
            )
        return {"json": schema}
    return None


def sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    """The request's ``SamplingParams`` (OpenAI defaults: temperature 1, max_tokens 16 for
    completions; the caller passes the chat endpoint's own default). ``prompt_logprobs``: the
    top-k to report at every prompt position (``echo`` with ``logprobs`` on completions)."""
    kwargs: dict[str, Any] = {
        "n": 1,  # the front end runs n siblings of one request
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "seed": req.seed,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.repetition_penalty is not None:
        kwargs["repetition_penalty"] = req.repetition_penalty
    if req.stop is not None:
        kwargs["stop"] = req.stop
    if req.stop_token_ids is not None:
        kwargs["stop_token_ids"] = req.stop_token_ids
    if req.logit_bias:
        if len(req.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:  # before converting them all
            raise RequestError(
                f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(req.logit_bias)}",
                "logit_bias",
            )
        try:
            kwargs["logit_bias"] = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError as exc:
            raise RequestError("logit_bias keys must be token ids", "logit_bias") from exc
        far = [v for v in req.logit_bias.values() if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS]
        if far:
            raise RequestError(f"logit_bias values must be in [-100, 100], got {far[0]!r}", "logit_bias")
    if not isinstance(req.n, int) or req.n < 1:
        raise RequestError(f"n must be an integer >= 1, got {req.n!r}", "n")
    constraint = structured_outputs(req)
    if constraint is not None:
        kwargs["structured_outputs"] = constraint
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise RequestError(str(exc), param_of(str(exc))) from exc
