"""The OpenAI-compatible HTTP app (FastAPI): ``deepinfer serve``.

Endpoints and field names follow vLLM's OpenAI-compatible server:
``/v1/completions`` and ``/v1/chat/completions`` (streaming as ``data: {...}`` events ending in
``data: [DONE]``), ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/health``, ``/version``,
``/metrics``. Every error is OpenAI's JSON shape ``{"error": {"message", "type", "param",
"code"}}``, ``param`` naming the field: 400 for bad input (and for a request that could never
run: more sequences than the server runs at once, or more tokens than the context holds),
401 for a wrong key, 404 for an unknown model or route, 405 for a wrong method, 408 for a body
too slow to arrive, 413 for one too large, 429 with ``Retry-After`` only when the waiting queue
is full, 500 for a request that failed inside the engine (alone: the others go on), 503 while
shutting down.

One request cannot stall the others: prompts are tokenized and rendered on worker threads
within size and time budgets (``prompts.py``), the key and body checks are pure ASGI so that
abandoned requests are aborted (``asgi_guards.py``), and slow headers time out
(``http_protocol.py``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import deepinfer
from deepinfer.chat import ChatOptions
from deepinfer.llm import LLM
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.server.asgi_guards import RequestGuard, error_body
from deepinfer.server.async_llm import AsyncLLM, QueueFullError, RequestFailedError, ShuttingDownError
from deepinfer.server.limits import ServerLimits
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.prompts import PromptPreparer
from deepinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    StreamOptions,
    TokenizeRequest,
    check_body,
    param_of,
    sampling_params,
)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def error_response(
    status: int, message: str, param: str | None = None, kind: str | None = None
) -> JSONResponse:
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(error_body(status, message, param, kind), status_code=status, headers=headers)


class Server:
    """The app's state: the model, its async engine, names, limits and metrics."""

    def __init__(
        self,
        llm: LLM,
        served_model_name: str,
        api_key: str | None,
        max_queued_requests: int,
        limits: ServerLimits,
    ) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.chat_format = llm.chat_format
        self.name = served_model_name
        self.api_key = api_key
        self.limits = limits
        self.engine = AsyncLLM(llm, max_queued_requests)
        self.prompts = PromptPreparer(
            llm.tokenizer, llm.engine.max_model_len, limits.max_messages, limits.prompt_timeout_s
        )
        self.metrics = ServerMetrics(served_model_name)
        self.engine.stats_callbacks.append(self.metrics.observe_finished)
        self.warm_up()

    def warm_up(self) -> None:
        """Build what the first prompt would build (the chat encoder's tokenizer without added
        tokens, the compiled template): long native calls that hold the GIL, which would stall
        every connection if the first request paid for them."""
        if self.tokenizer is None:
            return
        try:
            self.tokenizer("warm-up")
            self.chat_format.encode([{"role": "user", "content": "warm-up"}], None, True, ChatOptions())
        except Exception:  # e.g. no chat template: such requests get their own error later
            pass

    # ---- helpers --------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise RequestError(f"The model `{model}` does not exist.", "model", 404)

    def cache_capacity(self) -> int:
        e = self.llm.engine
        return min(e.max_model_len, e.num_blocks * e.layout.block_size)

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.cache_capacity() - prompt_len)

    def check_fits(self, prompt_lens: list[int], max_tokens: int, field: str, prompt_field: str) -> None:
        """An explicit ``max_tokens`` that no prompt of the request leaves room for is a 400
        (vLLM's rule and message), not a silent clamp. ``param`` names the prompt when it
        alone fills the context."""
        context = self.llm.engine.max_model_len
        longest = max(prompt_lens)
        if longest >= context:
            field = prompt_field
        if longest + max_tokens > context:
            raise RequestError(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} in the completion). "
                "Please reduce the length of the prompt or completion.",
                field,
            )

    def check_width(self, num_prompts: int, n: int, field: str) -> None:
        """A request of more sequences than run at once can never be admitted: 400, not 429."""
        most = self.llm.engine.config.max_num_seqs
        if num_prompts * n > most:
            what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
            raise RequestError(
                f"{field}: {what} is {num_prompts * n} sequences; this server runs at most {most} at once",
                field,
            )

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    async def prompt_ids(self, prompt: str | list[int], field: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send token ids", field)
            self.prompts.check_text(field, [prompt])
            return await self.prompts.run(field, lambda: self.tokenizer(prompt).input_ids)
        return list(prompt)

    async def encode_chat(
        self,
        messages: list[Any],
        tools: list[Any] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
        chars: int,
        reasoning_effort: str | int | None = None,
    ) -> tuple[list[int], ChatOptions]:
        """Prompt ids of a conversation in the model's chat format, on a worker thread within
        the limits; errors name the field."""
        self.prompts.check_messages(messages, chars)

        def encode() -> tuple[list[int], ChatOptions]:
            try:
                options = ChatOptions.from_request(template_kwargs, reasoning_effort)
                return self.chat_format.encode(messages, tools, add_generation_prompt, options), options
            except ValueError as exc:
                raise RequestError(str(exc), _chat_param(str(exc))) from exc
            except Exception as exc:  # the template met something in these messages it cannot render
                raise RequestError(
                    f"messages: the chat template cannot render these messages ({type(exc).__name__}: {exc})",
                    "messages",
                ) from exc

        return await self.prompts.run("messages", encode)

    def kv_usage(self) -> float:
        pool = self.llm.engine.pool
        return 1.0 - pool.num_free / pool.num_blocks

    async def add_all(
        self,
        base_id: str,
        prompts: list[list[int]],
        n: int,
        params: SamplingParams,
        salt: str | None,
        field: str,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Queue ``n`` siblings of every prompt (seeds offset per sibling, as ``LLM`` does).
        All or nothing: if one is refused the others are aborted; add errors become
        ``RequestError`` naming ``field`` for the prompt, or the sampling field."""
        streams: list[AsyncIterator[RequestOutput]] = []
        ids_added: list[str] = []
        try:
            for p, ids in enumerate(prompts):
                for j in range(n):
                    rid = f"{base_id}-{p}-{j}"
                    streams.append(await self.engine.add(rid, ids, params, j, salt))
                    ids_added.append(rid)
        except Exception as exc:
            for rid in ids_added:
                self.engine.abort(rid)
            if isinstance(exc, ValueError) and not isinstance(exc, RequestError):
                msg = str(exc)
                param = field if msg.startswith("prompt_token_ids") else param_of(msg)
                raise RequestError(msg, param) from exc
            raise
        return streams


def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as ``(index, item)`` pairs; an error in one is raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    async def merged() -> AsyncIterator[tuple[int, Any]]:
        tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(streams)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for it in streams:
                if hasattr(it, "aclose"):
                    await it.aclose()

    return merged()


class _Delta:
    """What a stream has sent of one choice: tokens and text (a trailing partial character is
    held back until it completes)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = ""
        self.role_sent = False

    def take(self, c: CompletionOutput, finished: bool) -> tuple[str, list[int], list[dict] | None]:
        text = c.text
        new_text = "" if text.endswith("\ufffd") and not finished else text[len(self.text) :]
        if new_text:
            self.text = text
        new_ids = c.token_ids[self.tokens :]
        new_lp = c.logprobs[self.tokens :] if c.logprobs is not None else None
        self.tokens = len(c.token_ids)
        return new_text, new_ids, new_lp


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def build_app(
    llm: LLM,
    served_model_name: str,
    api_key: str | None = None,
    max_queued_requests: int = 256,
    engine_thread: bool = True,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The app over ``llm``. ``engine_thread``: run the engine loop on a background thread
    started with the app; False leaves it to the caller (``AsyncLLM.run_here``)."""
    limits = limits or ServerLimits()
    server = Server(llm, served_model_name, api_key, max_queued_requests, limits)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if engine_thread:
            server.engine.start()
        yield
        server.engine.stop()
        server.prompts.close()

    app = FastAPI(title="deepinfer", version=deepinfer.__version__, lifespan=lifespan)
    app.state.server = server
    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        max_body_bytes=limits.max_request_bytes,
        body_timeout_s=limits.body_timeout_s,
    )

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        if err.get("type") == "json_invalid":  # its loc is a byte offset, not a field
            return error_response(400, f"body: invalid JSON ({err.get('msg', '')})", "body")
        param = _loc_param(err.get("loc", ()))
        return error_response(400, f"{param or 'body'}: {err.get('msg', 'invalid request')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException):
        # unknown routes, wrong methods, bodies FastAPI could not parse (bad UTF-8, nesting
        # too deep for the JSON decoder)
        param = "body" if exc.status_code == 400 else None
        response = error_response(exc.status_code, str(exc.detail), param)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError):
        return error_response(exc.code, str(exc), exc.param)

    @app.exception_handler(RequestFailedError)
    async def _failed(_request: Request, exc: RequestFailedError):
        return error_response(500, f"this request failed in the engine: {exc}")

    @app.exception_handler(ShuttingDownError)
    async def _shutting_down(_request: Request, exc: ShuttingDownError):
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):  # e.g. an engine step that failed
        return error_response(500, f"{type(exc).__name__}: {exc}")

    @app.exception_handler(QueueFullError)
    async def _queue_full(_request: Request, exc: QueueFullError):
        return error_response(429, str(exc))

    @app.get("/health")
    async def health() -> Response:
        ok = server.engine.healthy and server.engine._thread.is_alive() and not server.engine.shutting_down
        return Response(status_code=200 if ok else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": deepinfer.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": server.name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "deepinfer",
                    "root": str(llm.path),
                    "max_model_len": llm.engine.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        running, waiting = server.engine.num_requests()
        server.metrics.refresh(running, waiting, server.kv_usage(), server.llm.engine.moe_lb())
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        server.check_model(body.model)
        chars = check_body(body.model_dump())
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            ids, _ = await server.encode_chat(
                body.messages, body.tools, body.add_generation_prompt, body.chat_template_kwargs, chars
            )
        else:
            if server.tokenizer is None:
                raise RequestError("this model has no tokenizer", "prompt")
            prompt = body.prompt
            server.prompts.check_text("prompt", [prompt])
            ids = await server.prompts.run(
                "prompt",
                lambda: server.tokenizer(prompt, add_special_tokens=body.add_special_tokens).input_ids,
            )
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        server.check_model(body.model)
        if server.tokenizer is None:
            raise RequestError("this model has no tokenizer", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < llm.engine.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary", "tokens")
        return {"prompt": await server.prompts.run("tokens", server.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        check_body(body.model_dump())
        if body.echo:
            raise RequestError("echo is not supported", "echo")
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not prompts:
            raise RequestError("prompt must not be empty", "prompt")
        server.check_width(len(prompts), body.n, "n" if len(prompts) == 1 else "prompt")
        server.prompts.check_text("prompt", [p for p in prompts if isinstance(p, str)])
        id_lists = [await server.prompt_ids(p, "prompt") for p in prompts]
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, body.logprobs)
        if body.max_tokens is not None:
            server.check_fits([len(ids) for ids in id_lists], body.max_tokens, "max_tokens", "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await server.add_all(rid, id_lists, body.n, params, body.cache_salt, "prompt")

        def choice(index: int, c: CompletionOutput, text: str, ids: list[int], lps, finished: bool) -> dict:
            out = {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": c.finish_reason if finished else None,
            }
            if finished:
                out["stop_reason"] = c.stop_reason
            if body.logprobs is not None and lps is not None:
                toks = [server.token_text(t) for t in ids]
                out["logprobs"] = {
                    "tokens": toks,
                    "token_logprobs": [lp[t].logprob for t, lp in zip(ids, lps, strict=True)],
                    "top_logprobs": [{server.token_text(k): v.logprob for k, v in lp.items()} for lp in lps],
                    "text_offset": [],
                }
            return out

        prompt_tokens = sum(len(ids) for ids in id_lists)
        if body.stream:
            entries = _completion_entries(choice)
            return _event_stream(
                server, streams, rid, created, "text_completion", entries, prompt_tokens, body.stream_options
            )
        finals = await _collect(streams, request)
        choices = [
            choice(i, f.outputs[0], f.outputs[0].text, f.outputs[0].token_ids, f.outputs[0].logprobs, True)
            for i, f in enumerate(finals)
        ]
        return _response(server, rid, "text_completion", created, choices, prompt_tokens, finals)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        chars = check_body(body.model_dump())
        server.check_width(1, body.n, "n")
        if body.tool_choice not in (None, "auto", "none"):
            raise RequestError(
                "tool_choice: only 'auto' and 'none' are supported (forcing a call needs structured outputs)",
                "tool_choice",
            )
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
            streams = await server.add_all(rid, [ids], body.n, params, body.cache_salt, "messages")
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
            entries = _chat_entries(logprobs_of, parsers)
            return _event_stream(
                server, streams, rid, created, "chat.completion.chunk", entries, len(ids), body.stream_options
            )
        finals = await _collect(streams, request)
        choices = []
        for i, f in enumerate(finals):
            c = f.outputs[0]
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if parsers[i] is not None:
                reply = parsers[i].parse(c.text, True)
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
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": logprobs_of(c.token_ids, c.logprobs),
                    "finish_reason": finish,
                    "stop_reason": c.stop_reason,
                }
            )
        return _response(server, rid, "chat.completion", created, choices, len(ids), finals)

    return app


def _response(
    server: Server, rid: str, kind: str, created: int, choices: list[dict], prompt_tokens: int, finals: list
) -> dict:
    """A whole (non-streamed) response of either endpoint, usage counted from the outputs."""
    completion_tokens = sum(len(f.outputs[0].token_ids) for f in finals)
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": server.name,
        "choices": choices,
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _collect(streams: list[AsyncIterator[RequestOutput]], request: Request) -> list[RequestOutput]:
    """Every stream's final output; a client that disconnects first aborts them all."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def consume() -> None:
        async for i, out in _merge(streams):
            if out.finished:
                finals[i] = out

    task = asyncio.create_task(consume())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            raise asyncio.CancelledError
    task.result()
    assert all(f is not None for f in finals)
    return finals  # type: ignore[return-value]


def _event_stream(
    server: Server,
    streams: list[AsyncIterator[RequestOutput]],
    rid: str,
    created: int,
    kind: str,
    entries: Callable[[int, _Delta, RequestOutput], list[dict]],
    prompt_tokens: int,
    stream_options: StreamOptions | None,
) -> StreamingResponse:
    """Server-sent events for one streamed request: ``entries(i, sent, out)`` turns each new
    output of choice ``i`` into choice objects (none: nothing to send); then the usage chunk
    when asked for, and ``[DONE]``. An error after the 200 went out travels as an event."""
    sent = [_Delta() for _ in streams]

    def event(choices: list[dict], **extra: Any) -> str:
        return _sse(
            {"id": rid, "object": kind, "created": created, "model": server.name, "choices": choices, **extra}
        )

    async def events() -> AsyncIterator[str]:
        try:
            async for i, out in _merge(streams):
                for entry in entries(i, sent[i], out):
                    yield event([entry])
        except Exception as exc:  # the request failed or the server is ending it: say so, then [DONE]
            status = 503 if isinstance(exc, ShuttingDownError) else 500
            yield _sse(error_body(status, str(exc)))
        else:
            if stream_options is not None and stream_options.include_usage:
                yield event([], usage=_usage(prompt_tokens, sum(d.tokens for d in sent)))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _completion_entries(choice: Callable) -> Callable[[int, _Delta, RequestOutput], list[dict]]:
    def entries(i: int, sent: _Delta, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        text, ids, lps = sent.take(c, out.finished)
        if not text and not ids and not out.finished:
            return []
        return [choice(i, c, text, ids, lps, out.finished)]

    return entries


# the names pydantic puts in an error's location for the member of a union that failed
_UNION_MEMBERS = {"str", "int", "float", "bool", "list", "dict", "none", "nullable"}


def _loc_param(loc: tuple | list) -> str | None:
    """A validation error's location as the field path check_body writes (``messages[0].content``):
    list indices in brackets, without ``body`` or the union member pydantic tried."""
    param = ""
    for part in loc:
        if part == "body" and not param:
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _UNION_MEMBERS or "[" in str(part) or "-" in str(part):
            continue
        else:
            param += f".{part}" if param else str(part)
    return param or None


def _chat_param(message: str) -> str:
    """The request field a chat-encoding error names (``messages[1].tool_calls[0]...``)."""
    head = message.split(" ", 1)[0].rstrip(":")
    known = ("messages", "tools", "tool_choice", "reasoning_effort", "chat_template_kwargs")
    return head if head.startswith(known) else "messages"


def _chat_entries(
    logprobs_of: Callable, parsers: list[Any]
) -> Callable[[int, _Delta, RequestOutput], list[dict]]:
    """Chunks of one choice; with a reply parser the text goes out as ``reasoning_content``,
    ``content`` and ``tool_calls`` deltas, markup held back until it is settled."""

    def entries(i: int, sent: _Delta, out: RequestOutput) -> list[dict]:
        found = []
        if not sent.role_sent:  # each choice's first chunk carries the role
            sent.role_sent = True
            role = {"role": "assistant", "content": ""}
            found.append({"index": i, "delta": role, "logprobs": None, "finish_reason": None})
        c = out.outputs[0]
        text, ids, lps = sent.take(c, out.finished)
        parser = parsers[i]
        delta = (
            parser.delta(sent.text, out.finished)
            if parser is not None
            else ({"content": text} if text else {})
        )
        if not delta and not ids and not out.finished:
            return found
        finish = c.finish_reason if out.finished else None
        if finish == "stop" and parser is not None and parser.last is not None and parser.last.tool_calls:
            finish = "tool_calls"
        entry = {
            "index": i,
            "delta": delta,
            "logprobs": logprobs_of(ids, lps),
            "finish_reason": finish,
        }
        if out.finished:
            entry["stop_reason"] = c.stop_reason
        return [*found, entry]

    return entries
