"""The service endpoints: ``/health``, ``/version``, ``/metrics`` (Prometheus text), and
``/tokenize`` / ``/detokenize`` (vLLM's, for clients that count tokens themselves)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import deepinfer
from deepinfer.server.protocol import DetokenizeRequest, RequestError, TokenizeRequest, check_body
from deepinfer.server.state import StateDep

router = APIRouter()


@router.get("/health")
async def health(server: StateDep) -> Response:
    ok = server.client.healthy()
    return Response(status_code=200 if ok else 503)


@router.get("/version")
async def version() -> dict:
    return {"version": deepinfer.__version__}


@router.get("/metrics")
async def metrics(server: StateDep) -> Response:
    load = server.client.load()
    server.metrics.refresh(load.running, load.waiting, load.kv_usage, load.moe_lb)
    server.metrics.refresh_cache(load.cache)
    if load.lora is not None:
        server.metrics.refresh_lora(load.lora)
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, server: StateDep) -> dict:
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
    return {"tokens": ids, "count": len(ids), "max_model_len": server.client.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, server: StateDep) -> dict:
    server.check_model(body.model)
    if server.tokenizer is None:
        raise RequestError("this model has no tokenizer", "tokens")
    bad = [t for t in body.tokens if not 0 <= t < server.client.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary", "tokens")
    return {"prompt": await server.prompts.run("tokens", server.tokenizer.decode, body.tokens)}
