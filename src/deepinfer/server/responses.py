"""How engine outputs become response bodies: whole responses, and server-sent event streams
(``data: {...}`` chunks ending in ``data: [DONE]``) of the completion and chat endpoints."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.server.asgi_guards import error_body
from deepinfer.server.async_llm import ShuttingDownError
from deepinfer.server.protocol import StreamOptions


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


class Delta:
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


# turns choice ``i``'s newest output into the choice objects to send (none: nothing new)
Entries = Callable[[int, Delta, RequestOutput], list[dict]]


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def whole_response(
    model: str, rid: str, kind: str, created: int, choices: list[dict], prompt_tokens: int, finals: list
) -> dict:
    """A whole (non-streamed) response of either endpoint, usage counted from the outputs."""
    completion_tokens = sum(len(f.outputs[0].token_ids) for f in finals)
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(prompt_tokens, completion_tokens),
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def collect(streams: list[AsyncIterator[RequestOutput]], request: Request) -> list[RequestOutput]:
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


def event_stream(
    model: str,
    streams: list[AsyncIterator[RequestOutput]],
    rid: str,
    created: int,
    kind: str,
    entries: Entries,
    prompt_tokens: int,
    stream_options: StreamOptions | None,
) -> StreamingResponse:
    """Server-sent events for one streamed request: ``entries(i, sent, out)`` turns each new
    output of choice ``i`` into choice objects (none: nothing to send); then the usage chunk
    when asked for, and ``[DONE]``. An error after the 200 went out travels as an event."""
    sent = [Delta() for _ in streams]

    def event(choices: list[dict], **extra: Any) -> str:
        return _sse(
            {"id": rid, "object": kind, "created": created, "model": model, "choices": choices, **extra}
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


def completion_logprobs(
    token_text: Callable[[int], str],
    ids: list[int],
    entries: list[dict[int, Logprob] | None],
    start: int | None,
) -> dict:
    """The completions endpoint's ``logprobs`` object for ``ids``: each token's text, logprob
    and entries (token text -> logprob: the token and the top-k). An entry of None (the first
    prompt token, which nothing conditions) gives nulls, as OpenAI and vLLM report it.
    ``text_offset``: where each token's text starts, counted from ``start`` over the token
    texts (OpenAI's rule); ``start`` None leaves it empty (stream chunks)."""
    tokens = [token_text(t) for t in ids]
    offsets = (
        [] if start is None else list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=start))
    )
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(ids, entries, strict=True)],
        "top_logprobs": [
            None if e is None else {token_text(k): v.logprob for k, v in e.items()} for e in entries
        ],
        "text_offset": offsets[: len(tokens)],
    }


def completion_entries(choice: Callable) -> Entries:
    def entries(i: int, sent: Delta, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        text, ids, lps = sent.take(c, out.finished)
        if not text and not ids and not out.finished:
            return []
        return [choice(i, c, text, ids, lps, out.finished)]

    return entries


def chat_entries(logprobs_of: Callable, parsers: list[Any]) -> Entries:
    """Chunks of one choice; with a reply parser the text goes out as ``reasoning_content``,
    ``content`` and ``tool_calls`` deltas, markup held back until it is settled."""

    def entries(i: int, sent: Delta, out: RequestOutput) -> list[dict]:
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
