"""The OpenAI endpoints: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``
(vLLM's field names; streamed as server-sent events when ``stream`` is set). Completions take
``echo``: the prompt comes back before the completion, with ``logprobs`` for its tokens too
(what lm-eval's ``local-completions`` scores with ``max_tokens=1``, ``logprobs=1``). A request
whose ``model`` names a loaded LoRA adapter runs with it (``/v1/models`` lists them after the
served model, each with its directory as ``root`` and its base model as ``parent``)."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request

from deepinfer.chat.tool_choice import named_function
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    check_body,
    sampling_params,
)
from deepinfer.server.responses import (
    chat_entries,
    collect,
    completion_entries,
    completion_logprobs,
    event_stream,
    whole_response,
)
from deepinfer.server.state import ServerState, StateDep

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()


@router.get("/v1/models")
async def models(server: StateDep) -> dict:
    created = int(time.time())
    cards = [_model_card(server, server.name, server.client.model_path, None, created)]
    for adapter in server.client.lora_adapters():
        parent = adapter.parent or server.name
        cards.append(_model_card(server, adapter.name, adapter.path, parent, created))
    return {"object": "list", "data": cards}


def _model_card(server: ServerState, name: str, root: str, parent: str | None, created: int) -> dict:
    """One ``/v1/models`` entry: ``parent`` is None for the served model, its base for an adapter."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "deepinfer",
        "root": root,
        "parent": parent,
        "max_model_len": server.client.max_model_len,
    }


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, server: StateDep):
    lora = server.resolve_model(body.model)
    model = server.response_model(lora)
    check_body(body.model_dump())
    if body.echo and body.stream:
        raise RequestError("echo is not supported with stream=true", "echo")
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not prompts:
        raise RequestError("prompt must not be empty", "prompt")
    server.check_width(len(prompts), body.n, "n" if len(prompts) == 1 else "prompt")
    server.prompts.check_text("prompt", [p for p in prompts if isinstance(p, str)])
    id_lists = [await server.prompt_ids(p, "prompt") for p in prompts]
    # echo with max_tokens=0 scores the prompt alone: the engine runs one step, whose token is dropped
    prompt_only = body.echo and body.max_tokens == 0
    max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    prompt_logprobs = body.logprobs if body.echo else None
    params = sampling_params(body, 1 if prompt_only else max_tokens, body.logprobs, prompt_logprobs)
    if body.max_tokens is not None and not prompt_only:
        server.check_fits([len(ids) for ids in id_lists], body.max_tokens, "max_tokens", "prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = await server.add_all(
        rid, id_lists, body.n, params, body.cache_salt, "prompt", lora, body.kv_transfer_params
    )

    def choice(
        index: int, c: CompletionOutput, text: str, ids: list[int], lps, finished: bool, start: int | None
    ) -> dict:
        out = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": c.finish_reason if finished else None,
        }
        if finished:
            out["stop_reason"] = c.stop_reason
        if body.logprobs is not None and lps is not None:
            out["logprobs"] = completion_logprobs(server.token_text, ids, lps, start)
        return out

    prompt_tokens = sum(len(ids) for ids in id_lists)
    if body.stream:
        entries = completion_entries(lambda *args: choice(*args, None))
        return event_stream(
            model, streams, rid, created, "text_completion", entries, prompt_tokens, body.stream_options
        )
    finals = await collect(streams, request)
    if prompt_only:
        finals = [_without_completion(f) for f in finals]
    choices = []
    for i, f in enumerate(finals):
        c = f.outputs[0]
        if not body.echo:
            choices.append(choice(i, c, c.text, c.token_ids, c.logprobs, True, 0))
            continue
        p = i // body.n  # the n siblings of each prompt are consecutive
        prompt_text = prompts[p] if isinstance(prompts[p], str) else _decode(server, id_lists[p])
        # a one-token prompt has no position to score: its single entry is the null one
        lps = None if body.logprobs is None else [*(f.prompt_logprobs or [None]), *(c.logprobs or [])]
        choices.append(choice(i, c, prompt_text + c.text, [*id_lists[p], *c.token_ids], lps, True, 0))
    response = whole_response(model, rid, "text_completion", created, choices, prompt_tokens, finals)
    if server.kv_roles is not None and len(id_lists) == 1:  # a prefill server's handover
        params = server.kv_roles.answer(body.kv_transfer_params, id_lists[0], body.cache_salt)
        if params is not None:
            response["kv_transfer_params"] = params
    return response


def _decode(server: ServerState, ids: list[int]) -> str:
    """A token-id prompt's text (special tokens kept, as the model read them)."""
    return "" if server.tokenizer is None else server.tokenizer.decode(ids)


def _without_completion(out: RequestOutput) -> RequestOutput:
    """``out`` as ``max_tokens=0`` asks for it: the prompt alone, no completion tokens."""
    c = out.outputs[0]
    empty = replace(
        c,
        text="",
        token_ids=[],
        logprobs=None if c.logprobs is None else [],
        cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
        finish_reason="length",
        stop_reason=None,
    )
    return replace(out, outputs=[empty])


@router.post("/v1/chat/completions")
async def chat(body: ChatCompletionRequest, request: Request, server: StateDep):
    lora = server.resolve_model(body.model)
    model = server.response_model(lora)
    chars = check_body(body.model_dump())
    server.check_width(1, body.n, "n")
    try:
        named_function(body.tool_choice)
    except ValueError as exc:
        raise RequestError(str(exc), "tool_choice") from exc
    tools = body.tools if body.tools and body.tool_choice != "none" else None
    ids, options = await server.encode_chat(
        body.messages,
        tools,
        body.add_generation_prompt,
        body.chat_template_kwargs,
        chars,
        body.reasoning_effort,
    )
    try:
        parsers = [server.chat_format.reply_parser(bool(tools), options) for _ in range(body.n)]
    except ValueError as exc:
        raise RequestError(str(exc), "tools") from exc
    body = _with_tool_constraint(server, body, options)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = server.default_max_tokens(len(ids))
    else:
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        server.check_fits([len(ids)], max_tokens, field, "messages")
    top = None
    if body.logprobs:
        top = body.top_logprobs or 0
    elif body.top_logprobs is not None:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    try:
        params = sampling_params(body, max_tokens, top)
    except RequestError as exc:
        if exc.param == "logprobs":
            exc.param = "top_logprobs"
        raise
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    try:
        streams = await server.add_all(
            rid, [ids], body.n, params, body.cache_salt, "messages", lora, body.kv_transfer_params
        )
    except RequestError as exc:
        if exc.param == "logprobs":  # the engine's name for what chat calls top_logprobs
            exc.param = "top_logprobs"
        raise

    def logprobs_of(ids_: list[int], lps) -> dict | None:
        if not body.logprobs or lps is None:
            return None
        content = []
        for t, lp in zip(ids_, lps, strict=True):
            tops = sorted(lp.items(), key=lambda kv: kv[1].rank)[: body.top_logprobs or 0]
            text = server.token_text(t)
            content.append(
                {
                    "token": text,
                    "logprob": lp[t].logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": server.token_text(k),
                            "logprob": v.logprob,
                            "bytes": list(server.token_text(k).encode()),
                        }
                        for k, v in tops
                    ],
                }
            )
        return {"content": content}

    if body.stream:
        entries = chat_entries(logprobs_of, parsers)
        return event_stream(
            model,
            streams,
            rid,
            created,
            "chat.completion.chunk",
            entries,
            len(ids),
            body.stream_options,
        )
    finals = await collect(streams, request)
    choices = []
    for i, f in enumerate(finals):
        c = f.outputs[0]
        message, finish = _chat_message(c, parsers[i])
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": logprobs_of(c.token_ids, c.logprobs),
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            }
        )
    return whole_response(model, rid, "chat.completion", created, choices, len(ids), finals)


def _with_tool_constraint(
    server: ServerState, body: ChatCompletionRequest, options: Any
) -> ChatCompletionRequest:
    """``body`` with the structural tag that enforces its ``tool_choice`` as its constraint
    (unchanged where nothing is enforced); a forced call leaves no room for another format."""
    try:
        tag = server.chat_format.tool_constraint(
            body.tools, body.tool_choice, options, body.parallel_tool_calls is not False
        )
    except ValueError as exc:
        field = "tool_choice" if str(exc).startswith("tool_choice") else "tools"
        raise RequestError(str(exc), field) from exc
    if tag is None:
        return body
    fmt = (body.response_format or {}).get("type")
    if body.structured_outputs is not None or fmt not in (None, "text"):
        raise RequestError(
            "tool_choice enforces the tool-call format: it cannot be combined with "
            "response_format or structured_outputs",
            "tool_choice",
        )
    return body.model_copy(update={"structured_outputs": {"structural_tag": tag}})


def _chat_message(c: CompletionOutput, parser: Any) -> tuple[dict[str, Any], str | None]:
    """A whole reply as the assistant message and its finish reason; with a reply parser the
    text is split into ``reasoning_content``, ``content`` and ``tool_calls``."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish = c.finish_reason
    if parser is not None:
        reply = parser.parse(c.text, True)
        message["content"] = reply.content if reply.content or not reply.tool_calls else None
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": t.id,
                    "type": "function",
                    "function": {"name": t.name, "arguments": t.arguments_json()},
                }
                for t in reply.tool_calls
            ]
            finish = "tool_calls" if finish == "stop" else finish
    return message, finish
